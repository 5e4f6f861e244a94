"""Hostile: maps 3 GiB of shared anonymous memory while being imported (a mapping the data limit does not count)
and fills it. The address-space limit does: exit 3, naming memory."""

import mmap

from torch import nn

INPUT_SHAPE = (4,)

SHARED = [mmap.mmap(-1, 2**28, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS) for _ in range(12)]
for block in SHARED:
    block.write(b"\1" * 2**28)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
