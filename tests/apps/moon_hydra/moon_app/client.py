"""The MOON client (rankaudit reads it, never runs it)."""

import flwr as fl

from moon_app.models import init_net, train_moon


class MoonClient(fl.client.NumPyClient):
    def __init__(self, loader, dataset, model, output_dim, num_epochs, learning_rate, mu, temperature):
        self.net = init_net(dataset, model, output_dim)
        self.loader = loader
        self.dataset, self.model, self.output_dim = dataset, model, output_dim
        self.num_epochs, self.learning_rate = num_epochs, learning_rate
        self.mu, self.temperature = mu, temperature

    def fit(self, parameters, config):
        global_net = init_net(self.dataset, self.model, self.output_dim)
        train_moon(self.net, global_net, self.loader, self.num_epochs, self.learning_rate, self.mu, self.temperature)
        return [], len(self.loader), {}


def gen_client_fn(loaders, cfg):
    def client_fn(cid: str):
        return MoonClient(
            loaders[int(cid)],
            cfg.dataset.name,
            cfg.model.name,
            cfg.model.output_dim,
            cfg.num_epochs,
            cfg.learning_rate,
            cfg.mu,
            cfg.temperature,
        )

    return client_fn
