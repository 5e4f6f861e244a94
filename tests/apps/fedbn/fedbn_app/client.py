"""Two clients: one shares every parameter, the FedBN one keeps its BatchNorm layers local."""

from collections import OrderedDict

import flwr as fl
import torch
from hydra.utils import instantiate

from fedbn_app.models import train


class SharedClient(fl.client.NumPyClient):
    def __init__(self, model, loader, lr):
        self.model, self.loader, self.lr = model, loader, lr

    def get_parameters(self, config):
        return [tensor.cpu().numpy() for _, tensor in self.model.state_dict().items()]

    def set_parameters(self, parameters):
        keys = self.model.state_dict().keys()
        self.model.load_state_dict(OrderedDict((k, torch.tensor(v)) for k, v in zip(keys, parameters)))

    def fit(self, parameters, config):
        self.set_parameters(parameters)
        train(self.model, self.loader, epochs=2, lr=self.lr)
        return self.get_parameters({}), len(self.loader.dataset), {}


class LocalNormClient(SharedClient):
    def get_parameters(self, config):
        return [tensor.cpu().numpy() for key, tensor in self.model.state_dict().items() if "bn" not in key]

    def set_parameters(self, parameters):
        keys = [k for k in self.model.state_dict().keys() if "bn" not in k]
        state = OrderedDict((k, torch.tensor(v)) for k, v in zip(keys, parameters))
        self.model.load_state_dict(state, strict=False)


def gen_client_fn(loaders, client_cfg, model_cfg):
    def client_fn(cid: str):
        return instantiate(client_cfg, model=instantiate(model_cfg), loader=loaders[int(cid)])

    return client_fn
