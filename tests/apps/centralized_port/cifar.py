"""Centralized PyTorch training, in the style of Flower's pytorch-from-centralized-to-federated example: the
federated client reuses train() and load_data(); main() is the centralized run the federation never makes."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

DEVICE = torch.device("cpu")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def load_data():
    trainset = TensorDataset(torch.randn(64, 3, 8, 8), torch.zeros(64, dtype=torch.long))
    testset = TensorDataset(torch.randn(16, 3, 8, 8), torch.zeros(16, dtype=torch.long))
    trainloader = DataLoader(trainset, batch_size=32, shuffle=True)
    testloader = DataLoader(testset, batch_size=16)
    return trainloader, testloader, {"trainset": len(trainset), "testset": len(testset)}


def train(net, trainloader, epochs, device):
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            criterion(net(images.to(device)), labels.to(device)).backward()
            optimizer.step()


def main():
    print("Centralized PyTorch training")
    trainloader, testloader, _ = load_data()
    net = Net().to(DEVICE)
    train(net=net, trainloader=trainloader, epochs=2, device=DEVICE)


if __name__ == "__main__":
    main()
