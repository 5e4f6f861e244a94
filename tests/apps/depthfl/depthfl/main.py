"""DepthFL's entry point: Hydra composes the config, each client gets a model depth, the strategy is built with
run-time arguments."""
import copy

import flwr as fl
import hydra
from hydra.utils import instantiate

from depthfl import client
from depthfl.dataset import load_datasets


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg) -> None:
    trainloaders = load_datasets(num_clients=cfg.num_clients, batch_size=cfg.batch_size)
    models = []
    for i in range(cfg.num_clients):
        model = copy.deepcopy(cfg.model)
        # a quarter of the clients at each depth, 1 to 4 blocks
        model.n_blocks = i // (cfg.num_clients // 4) + 1
        models.append(model)
    client_fn = client.gen_client_fn(
        num_epochs=cfg.num_epochs,
        trainloaders=trainloaders,
        learning_rate=cfg.learning_rate,
        learning_rate_decay=cfg.learning_rate_decay,
        models=models,
    )
    net = instantiate(cfg.model)
    strategy = instantiate(
        cfg.strategy,
        cfg,
        net,
        min_fit_clients=int(cfg.num_clients * cfg.fraction),
        min_available_clients=int(cfg.num_clients * cfg.fraction),
    )
    fl.simulation.start_simulation(
        client_fn=client_fn,
        num_clients=cfg.num_clients,
        config=fl.server.ServerConfig(num_rounds=cfg.num_rounds),
        strategy=strategy,
    )


if __name__ == "__main__":
    main()
