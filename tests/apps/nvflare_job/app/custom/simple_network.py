"""An NVFlare-style job's network; its clients withhold fc1 with ExcludeVars."""
import torch
from torch import nn

INPUT_SHAPE = (16,)


class SimpleNetwork(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))
