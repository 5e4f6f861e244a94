"""A Hydra-configured Flower simulation whose model is named by `model_name` in the config and built in code
(rankaudit reads it, never runs it)."""

import flwr as fl
import hydra
import torch
from models import CNN, MLP
from torch.utils.data import DataLoader, TensorDataset


def get_model(cfg):
    if cfg.model_name == "mlp":
        return MLP(num_classes=cfg.num_classes)
    elif cfg.model_name == "cnn":
        return CNN(num_classes=cfg.num_classes)
    raise ValueError(f"unknown model {cfg.model_name}")


class FlowerClient(fl.client.NumPyClient):
    def __init__(self, cfg):
        self.cfg = cfg
        self.net = get_model(cfg)
        data = TensorDataset(torch.randn(24, 3, 8, 8), torch.zeros(24, dtype=torch.long))
        self.loader = DataLoader(data, batch_size=cfg.client.batch_size, shuffle=True)

    def fit(self, parameters, config):
        optimizer = torch.optim.SGD(self.net.parameters(), lr=self.cfg.client.lr)
        for _ in range(self.cfg.client.local_epochs):
            for x, y in self.loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(self.net(x), y).backward()
                optimizer.step()
        return [], 24, {}


@hydra.main(config_path="conf", config_name="base", version_base=None)
def main(cfg):
    fl.simulation.start_simulation(
        client_fn=lambda cid: FlowerClient(cfg),
        num_clients=cfg.num_clients,
        config=fl.server.ServerConfig(num_rounds=cfg.num_rounds),
        strategy=fl.server.strategy.FedAvg(fraction_fit=0.5, min_fit_clients=2),
    )


if __name__ == "__main__":
    main()
