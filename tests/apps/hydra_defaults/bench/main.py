"""Runs the benchmark under Hydra (rankaudit reads it, never runs it)."""

import flwr as fl
import hydra
from hydra.utils import instantiate
from omegaconf import DictConfig

from bench.client import gen_client_fn
from bench.data import load_loaders


@hydra.main(config_path="conf", config_name="base", version_base=None)
def main(cfg: DictConfig) -> None:
    loaders = load_loaders(cfg.dataset, cfg.num_clients)
    client_fn = gen_client_fn(
        loaders,
        num_epochs=cfg.num_epochs,
        learning_rate=cfg.learning_rate,
        model=cfg.model,
        momentum=cfg.momentum,
    )
    strategy = instantiate(cfg.strategy)
    fl.simulation.start_simulation(
        client_fn=client_fn,
        num_clients=cfg.num_clients,
        config=fl.server.ServerConfig(num_rounds=cfg.num_rounds),
        strategy=strategy,
    )


if __name__ == "__main__":
    main()
