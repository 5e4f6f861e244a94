"""Hostile: an import that never returns."""
import torch.nn as nn

INPUT_SHAPE = (4,)

while True:
    pass
