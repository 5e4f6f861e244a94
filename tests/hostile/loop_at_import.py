"""Hostile: an import that never returns."""
import torch  # noqa: F401 - a model file imports torch; this one never gets further

INPUT_SHAPE = (4,)

while True:
    pass
