"""Hostile: its forward() returns on the meta device (where rankaudit traces) and loops on real tensors."""

from torch import nn

INPUT_SHAPE = (3, 2, 2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        while x.device.type != "meta":
            pass
        return self.fc(x.flatten(1))
