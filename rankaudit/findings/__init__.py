"""Findings: the verdict's level and sentences, the leakage findings and the exit-code policy."""
