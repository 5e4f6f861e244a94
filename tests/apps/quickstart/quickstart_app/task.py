"""quickstart_app: the model, the data and the training loop."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from quickstart_app.layers import Head


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.head = Head(4 * 6 * 6, 10)

    def forward(self, x):
        return self.head(torch.relu(self.conv1(x)).flatten(1))


def load_data(partition_id: int, num_partitions: int, batch_size: int):
    data = TensorDataset(torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,)))
    trainloader = DataLoader(data, batch_size=batch_size, shuffle=True)
    testloader = DataLoader(data, batch_size=128)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            criterion(net(images), labels).backward()
            optimizer.step()
