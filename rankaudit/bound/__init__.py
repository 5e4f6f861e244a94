"""The bounds: min cut, the round and every round, each sample, the energy certificate and DP."""
