"""Hostile: takes memory without end while being imported (11 GB resident in 8 s before the memory limit)."""

import torch
from torch import nn

INPUT_SHAPE = (4,)
HOARD = [torch.ones(2**27) for _ in range(160)]  # 80 GiB, half a GiB at a time


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
