"""A script-style Flower client running Opacus' PrivacyEngine on the client, in the style of Flower's older Opacus
example: the settings, the model, training and the client class (rankaudit reads it, never runs it)."""

import flwr as fl
import torch
from opacus import PrivacyEngine
from torch import nn

PARAMS = {
    "batch_size": 32,
    "train_split": 0.7,
    "local_epochs": 1,
}
PRIVACY_PARAMS = {
    "target_delta": 1e-5,
    "noise_multiplier": 0.4,
    "max_grad_norm": 1.2,
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))


def train(net, trainloader, privacy_engine, epochs):
    optimizer = torch.optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    privacy_engine.attach(optimizer)
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(images), labels).backward()
            optimizer.step()


class DPCifarClient(fl.client.NumPyClient):
    def __init__(self, model, trainloader, testloader, sample_rate) -> None:
        super().__init__()
        self.model, self.trainloader, self.testloader = model, trainloader, testloader
        self.privacy_engine = PrivacyEngine(
            self.model,
            sample_rate=sample_rate,
            target_delta=PRIVACY_PARAMS["target_delta"],
            max_grad_norm=PRIVACY_PARAMS["max_grad_norm"],
            noise_multiplier=PRIVACY_PARAMS["noise_multiplier"],
        )

    def fit(self, parameters, config):
        train(self.model, self.trainloader, self.privacy_engine, PARAMS["local_epochs"])
        return [], len(self.trainloader), {}
