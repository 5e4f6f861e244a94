"""FedPer's entry point (trimmed from Flower's fedper baseline; rankaudit never runs it)."""
import flwr as fl
import hydra
from hydra.utils import instantiate

from fedper import client, server


@hydra.main(config_path="conf", config_name="base", version_base=None)
def main(cfg) -> None:
    client_fn = client.get_client_fn_simulation(config=cfg, client_state_save_path="client_states")
    strategy = instantiate(cfg.strategy, create_model=server.create_model(cfg))
    fl.simulation.start_simulation(
        client_fn=client_fn,
        num_clients=cfg.num_clients,
        config=fl.server.ServerConfig(num_rounds=cfg.num_rounds),
        strategy=strategy,
    )


if __name__ == "__main__":
    main()
