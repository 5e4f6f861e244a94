"""The design review: single architectural edits re-counted and re-bounded, and model comparisons."""
