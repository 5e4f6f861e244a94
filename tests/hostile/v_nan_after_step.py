"""Hostile: finite at the weights it starts from, NaN once a local step has moved them (sqrt of minus the distance
moved; tracing and the first forward pass see -0, which is finite)."""
import torch
from torch import nn


class NanAfterStep(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)
        self.start = None

    def forward(self, x):
        out = self.fc(x.flatten(1))
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            weight = self.fc.weight.detach()
            if self.start is None or self.start.shape != weight.shape:
                self.start = weight.clone()
            moved = (weight - self.start).abs().sum()
            out = out * (torch.sqrt(-moved) + 1)
        return out


INPUT_SHAPE = (3, 2, 2)
