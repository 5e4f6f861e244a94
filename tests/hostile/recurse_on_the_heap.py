"""Hostile: recursion without end whose frames live on the heap (Python calls Python without the C stack)."""
import sys

from torch import nn

INPUT_SHAPE = (4,)
sys.setrecursionlimit(10**9)


def deeper(depth):
    return deeper(depth + 1) + 1


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        deeper(0)

    def forward(self, x):
        return self.fc(x)
