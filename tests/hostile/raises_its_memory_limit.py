"""Hostile: raises its own memory limit to the hard limit (unlimited before) and then takes 3 GiB while being
imported. The hard limit is the limit now: it stays under --memory-limit (exit 3, naming memory)."""

import resource

from torch import nn

INPUT_SHAPE = (4,)

for which in (resource.RLIMIT_DATA, resource.RLIMIT_AS):
    try:
        resource.setrlimit(which, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    except (ValueError, OSError):
        _, hard = resource.getrlimit(which)
        resource.setrlimit(which, (hard, hard))
HOARD = [bytearray(2**28) for _ in range(12)]  # 3 GiB, a quarter GiB at a time


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
