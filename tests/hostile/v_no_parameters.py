"""Hostile: a model without any parameter."""
from torch import nn


class NoParameters(nn.Module):
    def forward(self, x):
        return x.flatten(1)[:, :3].relu()


INPUT_SHAPE = (3, 2, 2)
