"""The small CNN of the guard's command-line walkthrough (docs/guard.md): two convolutions, global average pooling,
a ReLU head of 64 units and 10 logits. `features` is the part before the head: the server's imprint weights in the
walkthrough set their thresholds on it."""

import torch
import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


class Net(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.hidden = nn.Linear(32, 64)
        self.out = nn.Linear(64, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return x.mean(dim=(2, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(self.features(x))))
