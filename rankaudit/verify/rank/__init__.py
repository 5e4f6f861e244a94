"""The exact check (spec §10, §14): the numerical rank of the shared gradient's Jacobian in the input."""
