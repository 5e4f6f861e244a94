"""The app's two models; the config's `model_name` picks one in main.py."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.fc1 = nn.Linear(3 * 8 * 8, 16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class CNN(nn.Module):
    def __init__(self, num_classes: int):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 4 * 4, num_classes)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.conv(x))).flatten(1))
