"""The model, and the data the quickstart loads with Hugging Face datasets (not installed where rankaudit runs)."""

import torch
from datasets import load_dataset  # noqa: F401
from flwr_datasets import FederatedDataset
from flwr_datasets.partitioner import IidPartitioner
from torch import nn

fds = None  # cached FederatedDataset, built on first use


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def load_data(partition_id: int, num_partitions: int):
    global fds
    if fds is None:
        fds = FederatedDataset(dataset="mnist", partitioners={"train": IidPartitioner(num_partitions=num_partitions)})
    return fds.load_partition(partition_id)


def train(net, trainloader, epochs, lr):
    optimizer = torch.optim.SGD(net.parameters(), lr=lr)
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            net(batch["image"]).sum().backward()
            optimizer.step()
