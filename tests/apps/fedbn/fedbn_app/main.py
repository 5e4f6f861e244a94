"""Runs the FedBN experiment under Hydra (rankaudit reads it, never runs it)."""

import flwr as fl
import hydra
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset

from fedbn_app.client import gen_client_fn


@hydra.main(config_path="conf", config_name="base", version_base=None)
def main(cfg):
    loaders = [
        DataLoader(
            TensorDataset(torch.randn(40, 1, 8, 8), torch.randint(0, 6, (40,))),
            batch_size=cfg.dataset.batch_size,
            shuffle=True,
        )
        for _ in range(cfg.num_clients)
    ]
    fl.simulation.start_simulation(
        client_fn=gen_client_fn(loaders, cfg.client, cfg.model),
        num_clients=cfg.num_clients,
        config=fl.server.ServerConfig(num_rounds=cfg.num_rounds),
        strategy=instantiate(cfg.strategy),
    )


if __name__ == "__main__":
    main()
