"""Hostile: sys.exit(0) in forward(), reached when rankaudit traces the model."""
import sys

from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        sys.exit(0)
