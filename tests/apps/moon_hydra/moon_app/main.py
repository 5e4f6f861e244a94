"""Runs MOON under Hydra (rankaudit reads it, never runs it)."""

import flwr as fl
import hydra
import torch
from torch.utils.data import DataLoader, TensorDataset

from moon_app import client


@hydra.main(config_path="conf", config_name="base", version_base=None)
def main(cfg):
    loaders = [
        DataLoader(
            TensorDataset(torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))),
            batch_size=cfg.batch_size,
            shuffle=True,
        )
        for _ in range(cfg.num_clients)
    ]
    strategy = fl.server.strategy.FedAvg(fraction_fit=cfg.fraction_fit)
    fl.simulation.start_simulation(
        client_fn=client.gen_client_fn(loaders, cfg),
        num_clients=cfg.num_clients,
        config=fl.server.ServerConfig(num_rounds=cfg.num_rounds),
        strategy=strategy,
    )


if __name__ == "__main__":
    main()
