"""A Hydra-configured Flower simulation (rankaudit reads it, never runs it)."""

import flwr as fl
import hydra
import torch
from model import Net
from torch.utils.data import DataLoader, TensorDataset


class FlowerClient(fl.client.NumPyClient):
    def __init__(self, cfg):
        self.cfg = cfg
        self.net = Net()
        self.loader = DataLoader(TensorDataset(torch.randn(40, 10)), batch_size=cfg.batch_size, shuffle=True)

    def fit(self, parameters, config):
        optimizer = torch.optim.SGD(self.net.parameters(), lr=self.cfg.train.lr, momentum=self.cfg.train.momentum)
        for _ in range(self.cfg.train.local_epochs):
            for (x,) in self.loader:
                optimizer.zero_grad()
                self.net(x).sum().backward()
                optimizer.step()
        return [], 40, {}


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg):
    strategy = fl.server.strategy.FedAvg(fraction_fit=0.25, min_fit_clients=2)
    fl.simulation.start_simulation(
        client_fn=lambda cid: FlowerClient(cfg),
        num_clients=cfg.num_clients,
        config=fl.server.ServerConfig(num_rounds=cfg.num_rounds),
        strategy=strategy,
    )


if __name__ == "__main__":
    main()
