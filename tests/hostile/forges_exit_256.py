"""Hostile: sends rankaudit's "exit 256" frame (an exit status no process can have), token and all, then exits 0.
Before, the parent took it for rankaudit's own answer: exit 3 without a word. Now only rankaudit's own process may
send it, and the model's frame is said to be forged (exit 3, one line)."""

import os
import posix

from rankaudit.model import supervise

INPUT_SHAPE = (4,)

supervise._send(supervise._EXIT, b"256")
if supervise._channel is not None:
    payload = b"256"
    os.write(supervise._channel, supervise._HEADER.pack(supervise._token, supervise._EXIT, len(payload)) + payload)
posix._exit(0)
