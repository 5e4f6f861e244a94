"""Hostile: writes a frame saying "exit 0" onto every file descriptor it did not open, then ends the process
without a report (before issue 31 the supervising parent took that frame for the result: exit 0)."""

import os
import posix

from torch import nn

INPUT_SHAPE = (4,)

for fd in range(3, 64):
    try:
        os.write(fd, b"X\x00\x00\x00\x010")  # kind, length, payload: the frame format without a run's token
    except OSError:
        pass
posix._exit(0)  # not os._exit: rankaudit does not hear where it was called


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
