"""A small net with a normalisation after each layer, and its training loop."""

import torch
from torch import nn


class NormNet(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn1 = nn.BatchNorm2d(4)
        self.fc1 = nn.Linear(4 * 6 * 6, 16)
        self.bn2 = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, num_classes)

    def forward(self, x):
        x = torch.relu(self.bn1(self.conv1(x))).flatten(1)
        return self.fc2(torch.relu(self.bn2(self.fc1(x))))


def train(model, loader, epochs, lr):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in range(epochs):
        for images, labels in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
