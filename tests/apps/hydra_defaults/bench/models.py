"""Two nets of the benchmark; the config's model group picks one."""

import torch
from torch import nn


class CNN(nn.Module):
    def __init__(self, hidden: int = 8, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.fc1 = nn.Linear(4 * 6 * 6, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = torch.relu(self.conv(x)).flatten(1)
        return self.fc2(torch.relu(self.fc1(x)))


class MLP(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        return self.fc(x.flatten(1))
