"""The 6-layer MLP of GDBR: hidden widths [2048, 1024, 512, 256, 128, 64], ReLU, 10 classes."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)
HIDDEN_WIDTHS = (2048, 1024, 512, 256, 128, 64)


class MLP6(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.flatten = nn.Flatten()
        widths = (3 * 32 * 32,) + HIDDEN_WIDTHS
        for index, (width_in, width_out) in enumerate(zip(widths, widths[1:]), start=1):
            setattr(self, f"fc{index}", nn.Linear(width_in, width_out))
        self.classifier = nn.Linear(HIDDEN_WIDTHS[-1], num_classes)
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.flatten(x)
        for index in range(1, len(HIDDEN_WIDTHS) + 1):
            x = self.act(getattr(self, f"fc{index}")(x))
        return self.classifier(x)
