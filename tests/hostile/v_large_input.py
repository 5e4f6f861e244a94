"""Hostile: an input larger than scikit-learn's sample photographs (427x640), the verifiers' default images."""
from torch import nn


class LargeInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(self.pool(x).flatten(1))


INPUT_SHAPE = (3, 512, 512)
