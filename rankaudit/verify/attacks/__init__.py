"""The attacks a verifier runs on a real gradient or update: R-GAP, inverting gradients, FedAvg, GDBR, DAGER, DP, bias."""
