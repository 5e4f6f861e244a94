"""Hostile: raises SystemExit(3) while the model is built."""
from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        raise SystemExit(3)

    def forward(self, x):
        return self.fc(x)
