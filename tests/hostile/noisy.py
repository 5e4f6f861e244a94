"""Hostile: prints 2,000 lines at import and more in forward(), and writes to fd 1 directly."""
import os

from torch import nn

INPUT_SHAPE = (4,)

for line in range(2000):
    print(f"noise at import {line}")
os.write(1, b"written straight to fd 1\n")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 3)
        self.fc2 = nn.Linear(3, 2)

    def forward(self, x):
        print("noise in forward")
        os.write(1, b"forward wrote to fd 1\n")
        return self.fc2(self.fc1(x).relu())
