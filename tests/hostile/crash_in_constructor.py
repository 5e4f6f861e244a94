"""Hostile: the process dies of SIGSEGV while the model is built (as a broken C extension would make it)."""
import ctypes

from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        ctypes.string_at(0)   # reads address 0

    def forward(self, x):
        return self.fc(x)
