"""The MOON model: a feature extractor, a projection head and a classifier; init_net builds it on a device."""

import torch
from torch import nn

from moon_app.utils import compute_accuracy


class SmallFeatures(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, hidden)

    def forward(self, x):
        return torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1)))


class ContrastiveNet(nn.Module):
    def __init__(self, base_model, out_dim, n_classes):
        super().__init__()
        if base_model == "simple-cnn":
            self.features = SmallFeatures(hidden=24)
            width = 24
        else:
            raise ValueError(f"unknown base model {base_model}")
        self.project1 = nn.Linear(width, width)
        self.project2 = nn.Linear(width, out_dim)
        self.classify = nn.Linear(out_dim, n_classes)

    def forward(self, x):
        h = self.features(x)
        z = self.project2(torch.relu(self.project1(h)))
        return h, z, self.classify(z)


def init_net(dataset, model, output_dim, device="cpu"):
    n_classes = 100 if dataset == "cifar100" else 10
    net = ContrastiveNet(model, output_dim, n_classes)
    if device == "cpu":
        net.to(device)
    else:
        net = net.cuda()
    return net


def train_moon(net, global_net, loader, epochs, lr, mu, temperature):
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9, weight_decay=1e-5)
    similarity = nn.CosineSimilarity(dim=-1)
    for _ in range(epochs):
        for images, labels in loader:
            optimizer.zero_grad()
            _, z, out = net(images)
            _, z_global, _ = global_net(images)
            logits = similarity(z, z_global).reshape(-1, 1) / temperature
            loss = nn.functional.cross_entropy(out, labels) + mu * logits.mean()
            loss.backward()
            optimizer.step()
    return compute_accuracy(net, loader)
