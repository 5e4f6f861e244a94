"""quickstart_app: a module the client app does not import (its model is no candidate)."""
from torch import nn


class Unused(nn.Module):
    def forward(self, x):
        return x
