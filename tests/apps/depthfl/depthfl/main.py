"""DepthFL's entry point: Hydra composes the config, the strategy is built with run-time arguments."""
import flwr as fl
import hydra
from hydra.utils import instantiate

from depthfl import client
from depthfl.dataset import load_datasets


@hydra.main(config_path="conf", config_name="config", version_base=None)
def main(cfg) -> None:
    trainloaders = load_datasets(num_clients=cfg.num_clients, batch_size=cfg.batch_size)
    client_fn = client.gen_client_fn(
        num_epochs=cfg.num_epochs,
        trainloaders=trainloaders,
        learning_rate=cfg.learning_rate,
        learning_rate_decay=cfg.learning_rate_decay,
        model=cfg.model,
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
