"""Hostile: a slow import, long enough to press Ctrl-C during it."""
import sys
import time

import torch  # noqa: F401 - a model file imports torch; this one sleeps instead

INPUT_SHAPE = (4,)
print("importing", file=sys.stderr, flush=True)
time.sleep(60)
