"""The strategy app's model and training: FedAdam clients train with Adam, the others with SGD and the momentum
their caller passes (rankaudit reads it, never runs it)."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(x)


def train(net, trainloader, epochs, strategy, lr, momentum=0.0):
    if strategy == "fedadam":
        optimizer = torch.optim.Adam(net.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=momentum)
    for _ in range(epochs):
        for x, y in trainloader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
