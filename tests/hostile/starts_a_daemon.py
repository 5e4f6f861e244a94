"""Hostile: starts two sleepers that leave rankaudit's process group while being imported: one in a session of its
own (subprocess's start_new_session), one as a daemon (fork, setsid, fork again, the middle process exits). Each
outlived rankaudit by a minute before. Its pid file goes to $RANKAUDIT_TEST_PIDS (the test reads it)."""

import os
import subprocess
import sys
import time

from torch import nn

INPUT_SHAPE = (4,)

session = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", __file__], start_new_session=True)
read_end, write_end = os.pipe()
middle = os.fork()
if middle == 0:
    os.setsid()
    daemon = os.fork()
    if daemon == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", __file__])
    os.write(write_end, str(daemon).encode())
    os._exit(0)
os.waitpid(middle, 0)
daemon = int(os.read(read_end, 32))
folder = os.environ.get("RANKAUDIT_TEST_PIDS")
if folder:
    with open(os.path.join(folder, "pids"), "w") as handle:
        handle.write(f"{session.pid} {daemon}\n")
print("started two sleepers", file=sys.stderr, flush=True)
if os.environ.get("RANKAUDIT_TEST_WAIT"):
    time.sleep(600)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
