"""Not hostile: the smallest well-behaved model, for the cases where a flag (not the model) is the problem."""
from torch import nn


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        return self.fc(x.flatten(1))


INPUT_SHAPE = (3, 2, 2)
