"""Hostile: every parameter is frozen (requires_grad False), so no gradient is shared."""
from torch import nn


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)
        for parameter in self.parameters():
            parameter.requires_grad_(False)

    def forward(self, x):
        return self.fc(x.flatten(1))


INPUT_SHAPE = (3, 2, 2)
