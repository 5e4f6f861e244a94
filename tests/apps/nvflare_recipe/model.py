"""The job's models, for rankaudit's tests: the recipe trains CNN; Other is never used."""

import torch
from torch import nn


class CNN(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 6 * 6, num_classes)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 2)

    def forward(self, x):
        return self.fc(x.flatten(1))
