"""The branches app's model."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 6)
        self.fc2 = nn.Linear(6, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
