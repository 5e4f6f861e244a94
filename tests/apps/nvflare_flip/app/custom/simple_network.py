"""The FLIP-style job's model."""

import torch
from torch import nn


class SimpleNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 6 * 6, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
