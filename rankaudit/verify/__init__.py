"""The optional verifier: runs real attacks (R-GAP, inverting gradients, GDBR) to confirm the static verdict."""
