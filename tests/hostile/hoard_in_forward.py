"""Hostile: its forward() allocates real tensors without end (it runs while rankaudit traces it)."""

from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        hoard = [bytearray(2**29) for _ in range(160)]  # real memory whatever x is: 80 GiB
        return self.fc(x) + len(hoard)
