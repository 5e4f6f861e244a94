"""The quickstart's model, data and training, offline: the CNN of Flower's PyTorch quickstart, trained on 32x32
crops of scikit-learn's two bundled sample photographs (nothing is downloaded)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

CROPS_PER_PARTITION = 64
CLASSES = 10


class Net(nn.Module):
    """Flower's quickstart CNN: conv 6 - pool - conv 16 - pool - fc 120 - fc 84 - fc 10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, CLASSES)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = x.view(-1, 16 * 5 * 5)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


class PhotoCrops(Dataset):
    """32x32 crops of the sample photos as {"img", "label"} items, the way Flower Datasets' CIFAR-10 partitions
    come out of a transform: the image normalised to [-1, 1], channels first; the label a brightness decile."""

    def __init__(self, crops: np.ndarray, labels: np.ndarray):
        self.crops, self.labels = crops, labels

    def __len__(self):
        return len(self.crops)

    def __getitem__(self, index):
        image = torch.from_numpy(self.crops[index]).permute(2, 0, 1).float() / 127.5 - 1.0
        return {"img": image, "label": int(self.labels[index])}


def _crops(partition_id: int, num_partitions: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    generator = np.random.default_rng(1000 + partition_id)  # each partition its own crops
    crops = []
    for _ in range(count):
        photo = photos[int(generator.integers(len(photos)))]
        top = int(generator.integers(photo.shape[0] - 32))
        left = int(generator.integers(photo.shape[1] - 32))
        crops.append(photo[top : top + 32, left : left + 32])
    crops = np.stack(crops)
    brightness = crops.mean(axis=(1, 2, 3))
    labels = np.minimum((brightness / 25.6).astype(np.int64), CLASSES - 1)
    return crops, labels


def load_data(partition_id: int, num_partitions: int):
    """(trainloader, testloader) of this partition, as the quickstart's load_data returns them."""
    crops, labels = _crops(partition_id, num_partitions, CROPS_PER_PARTITION + CROPS_PER_PARTITION // 4)
    cut = CROPS_PER_PARTITION
    trainloader = DataLoader(PhotoCrops(crops[:cut], labels[:cut]), batch_size=32, shuffle=True)
    testloader = DataLoader(PhotoCrops(crops[cut:], labels[cut:]), batch_size=32)
    return trainloader, testloader


def train(net, trainloader, epochs, lr, device):
    """The quickstart's local training: SGD with momentum over the train loader; the mean loss."""
    net.to(device)
    criterion = nn.CrossEntropyLoss().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    net.train()
    running_loss = 0.0
    for _ in range(epochs):
        for batch in trainloader:
            optimizer.zero_grad()
            loss = criterion(net(batch["img"].to(device)), batch["label"].to(device))
            loss.backward()
            optimizer.step()
            running_loss += loss.item()
    return running_loss / (epochs * len(trainloader))


def test(net, testloader, device):
    """The loss and accuracy on the test loader."""
    net.to(device)
    criterion = nn.CrossEntropyLoss()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for batch in testloader:
            outputs = net(batch["img"].to(device))
            labels = batch["label"].to(device)
            loss += criterion(outputs, labels).item()
            correct += (torch.max(outputs.data, 1)[1] == labels).sum().item()
    return loss / len(testloader), correct / len(testloader.dataset)
