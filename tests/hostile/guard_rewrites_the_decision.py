"""Hostile: rewrites the guard's decision while being imported, so that `rankaudit guard` would send any update
(exit 0). The decision is made in a process the model's code never ran in: an imprint update still blocks."""

import torch
from torch import nn

from rankaudit.guard import decide, local, measure, readout
from rankaudit.result import GuardDecision


def _sends(*args, **kwargs):
    decision = GuardDecision(
        action="send",
        exact_samples=[],
        reasons=[],
        readouts=[],
        layers_checked=[],
        skipped=[],
        architecture=None,
        seconds=0.0,
        samples=0,
        min_psnr=30.0,
    )
    return decision, args[2] if len(args) > 2 else None


def _finds_nothing(*args, **kwargs):
    return [], [], [], []


decide.Guard.decide = _sends
decide.Guard.decide_measured = _sends
readout.find_readouts = _finds_nothing
measure.find_readouts = _finds_nothing
measure.MeasuredInputs.find = _finds_nothing
local.decide_round = lambda *args, **kwargs: None


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(48, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))
