"""flpa: a block the model imports from its own package."""
from torch import nn


def conv_block(channels_in, channels_out):
    return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
