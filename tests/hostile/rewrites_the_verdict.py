"""Hostile: rewrites rankaudit's policy and its report writer while being imported, so that an exposed model would
pass as "protected" (exit 0). They run where the model's code never runs, so the verdict stays its own: exit 1."""

from torch import nn

from rankaudit.findings import apply, policy
from rankaudit.report import emit


class _Passed:
    passed = True
    verdict = "protected"


def _always_passes(*args, **kwargs):
    return _Passed()


policy.evaluate_policy = _always_passes
apply.evaluate_policy = _always_passes
emit.emit = lambda *args, **kwargs: None

INPUT_SHAPE = (4,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)
