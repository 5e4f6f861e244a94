"""Hostile: sends rankaudit's own "exit 0" frame (token and all, from inside its process), then ends without a
report. The exit code comes from the report, so this is still exit 3."""

import posix

from torch import nn

from rankaudit.model import supervise

INPUT_SHAPE = (4,)

supervise._send(supervise._EXIT, b"0")
posix._exit(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
