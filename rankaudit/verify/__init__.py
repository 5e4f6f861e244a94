"""The optional verifier: runs real attacks (R-GAP, inverting gradients, GDBR) to confirm the static verdict."""


class AttackUnsupported(Exception):
    """An attack cannot run on this model; `layer` names what stops it and `reason` says why, in plain words."""

    def __init__(self, layer: str, reason: str):
        self.layer = layer
        self.reason = reason
        super().__init__(f"{layer}: {reason}")
