"""The match app's model, preferences and training: the optimizer is picked by a `match` on the preferences, or
by the strategy the run config names (rankaudit reads it, never runs it)."""

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

MOMENTUM = 0.9


@dataclass
class Preferences:
    optimizer: str = "adam"
    batch_size: int = 12
    lr: float = 0.005


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 6)
        self.fc2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def make_optimizer(net, preferences):
    match preferences.optimizer.lower():
        case "sgd":
            return torch.optim.SGD(net.parameters(), lr=preferences.lr, momentum=MOMENTUM)
        case "adam":
            return torch.optim.Adam(net.parameters(), lr=preferences.lr)
        case _:
            raise ValueError(preferences.optimizer)


def load_data(preferences):
    data = TensorDataset(torch.randn(24, 10), torch.zeros(24, dtype=torch.long))
    return DataLoader(data, batch_size=preferences.batch_size, shuffle=True)


def train(net, loader, epochs, optimizer):
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
