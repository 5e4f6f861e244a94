"""Not hostile: a model whose class needs an argument (model-args in [tool.rankaudit] gives it)."""

from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = nn.Linear(4, width)

    def forward(self, x):
        return self.fc(x)
