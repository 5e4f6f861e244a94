"""The MLP of method.md: each sample: 3x8x8 -> Linear 6 (bias) -> ReLU -> Linear 10. Its first layer's bias reads samples out."""

import torch.nn as nn

INPUT_SHAPE = (3, 8, 8)


class MLPBias(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(3 * 8 * 8, 6)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(6, num_classes)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(x))))
