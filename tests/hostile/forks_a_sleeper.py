"""Hostile: forks a long sleeper that shares rankaudit's stderr, then sleeps itself while being imported.

Its pid files go to $RANKAUDIT_TEST_PIDS (the test reads them): the model's own process and the sleeper's."""

import os
import subprocess
import sys
import time

from torch import nn

INPUT_SHAPE = (4,)

sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", __file__])
folder = os.environ.get("RANKAUDIT_TEST_PIDS")
if folder:
    with open(os.path.join(folder, "pids"), "w") as handle:
        handle.write(f"{os.getpid()} {sleeper.pid}\n")
print("forked a sleeper", file=sys.stderr, flush=True)
time.sleep(600)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
