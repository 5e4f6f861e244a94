"""The benchmark's client: the model comes from the config (hydra's instantiate), never named in the code."""

import flwr as fl
import torch
from hydra.utils import instantiate


class BenchClient(fl.client.NumPyClient):
    def __init__(self, model_cfg, loader, num_epochs, learning_rate, momentum):
        self.net = instantiate(model_cfg)
        self.loader = loader
        self.num_epochs = num_epochs
        self.learning_rate = learning_rate
        self.momentum = momentum

    def fit(self, parameters, config):
        optimizer = torch.optim.SGD(self.net.parameters(), lr=self.learning_rate, momentum=self.momentum)
        for _ in range(self.num_epochs):
            for images, labels in self.loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(self.net(images), labels).backward()
                optimizer.step()
        return [], len(self.loader), {}


def gen_client_fn(loaders, num_epochs, learning_rate, model, momentum):
    def client_fn(cid: str):
        return BenchClient(model, loaders[int(cid)], num_epochs, learning_rate, momentum)

    return client_fn
