"""Hostile: the process is killed by SIGKILL while the model is built, as the system's out-of-memory killer does."""
import os
import signal

from torch import nn

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)
        os.kill(os.getpid(), signal.SIGKILL)

    def forward(self, x):
        return self.fc(x)
