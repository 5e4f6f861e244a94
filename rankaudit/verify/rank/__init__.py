"""The exact check (method.md: numerical check, each sample): the numerical rank of the shared gradient's Jacobian in the input."""
