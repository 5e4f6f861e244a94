"""Hostile for the verifiers: 200 million parameters, nothing on the meta device, 4.5 GiB in float64 with real
weights and their gradients. --verify rank under a 1 GiB limit is refused before the model is built."""

from torch import nn

INPUT_SHAPE = (20_000,)


class WideLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(20_000, 10_000)

    def forward(self, x):
        return self.fc(x)
