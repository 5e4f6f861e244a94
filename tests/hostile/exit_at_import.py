"""Hostile: ends the process while being imported (a silent exit 0 before issue 23)."""
import os

from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


os._exit(0)
