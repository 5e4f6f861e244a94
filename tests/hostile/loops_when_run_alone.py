"""Hostile: raises when rankaudit imports it, and loops forever when run on its own (the check rankaudit runs to
tell the user whether the file works with plain PyTorch). That check must keep to --timeout too."""
from torch import nn

INPUT_SHAPE = (4,)

if __name__ == "rankaudit_standalone_check":
    while True:
        pass
raise RuntimeError("only imported by rankaudit")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
