"""Hostile: a forward() that never returns (rankaudit traces it)."""
from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        while True:
            pass
