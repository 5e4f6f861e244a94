"""Hostile: says, with rankaudit's own function and token, that its import is a phase without a time limit, then
never returns. The limit is the parent's own: --timeout still ends it (exit 3)."""

from rankaudit.model import supervise

INPUT_SHAPE = (4,)

supervise._send(supervise._PHASE, b"-1.0\tthe analysis")
supervise.enter("a verifier's attack")
while True:
    pass
