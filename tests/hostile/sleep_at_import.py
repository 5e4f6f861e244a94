"""Hostile: a slow import, long enough to press Ctrl-C during it."""
import sys
import time

import torch.nn as nn

INPUT_SHAPE = (4,)
print("importing", file=sys.stderr, flush=True)
time.sleep(60)
