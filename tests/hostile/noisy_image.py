"""Hostile: a small image model that prints 2,000 lines at import and more in forward() (for the verifiers)."""
import os

from torch import nn

INPUT_SHAPE = (3, 8, 8)

for line in range(2000):
    print(f"noise at import {line}")
os.write(1, b"written straight to fd 1\n")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.fc1 = nn.Linear(2 * 6 * 6, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        print("noise in forward")
        return self.fc2(self.fc1(self.conv(x).relu().flatten(1)).relu())
