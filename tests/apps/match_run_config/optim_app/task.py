"""The optim app's model and training: the optimizer is picked by a `match` on the name the client passes from
its run config (rankaudit reads it, never runs it)."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 5)
        self.fc2 = nn.Linear(5, 2)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def get_optimizer(net, name, lr, momentum):
    match name:
        case "sgd":
            return torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
        case "adam":
            return torch.optim.Adam(net.parameters(), lr=lr)
        case _:
            raise ValueError(f"unknown optimizer {name}")


def load_data(batch_size):
    data = TensorDataset(torch.randn(32, 8), torch.zeros(32, dtype=torch.long))
    return DataLoader(data, batch_size=batch_size, shuffle=True)


def train(net, loader, epochs, optimizer):
    net.train()
    for _ in range(epochs):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
