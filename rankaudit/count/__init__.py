"""Counting: each op family's rule, the output-shape formulas, and the per-layer counts (RA-i)."""
