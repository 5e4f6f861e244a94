"""Hostile: the forward pass raises on the second real batch (tracing and the first batch go through)."""
import torch
from torch import nn


class RaiseSecondBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(12, 8)
        self.fc = nn.Linear(8, 3)
        self.real_calls = 0

    def forward(self, x):
        if isinstance(x, torch.Tensor) and x.device.type != "meta":
            self.real_calls += 1
            if self.real_calls >= 2:
                raise RuntimeError("batch 2 is cursed")
        return self.fc(torch.relu(self.hidden(x.flatten(1))))


INPUT_SHAPE = (3, 2, 2)
