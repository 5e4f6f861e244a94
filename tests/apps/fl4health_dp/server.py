"""The server: it sends each client the batch, epochs and DP settings of config.yaml."""

import argparse
from functools import partial

import flwr as fl
from fl4health.servers.instance_level_dp_server import InstanceLevelDpServer
from fl4health.strategies.basic_fedavg import OpacusBasicFedAvg
from fl4health.utils.config import load_config
from model import Net


def fit_config(batch_size, noise_multiplier, clipping_bound, local_epochs, current_round):
    return {
        "batch_size": batch_size,
        "noise_multiplier": noise_multiplier,
        "clipping_bound": clipping_bound,
        "local_epochs": local_epochs,
        "current_server_round": current_round,
    }


def main(config):
    fit_config_fn = partial(
        fit_config, config["batch_size"], config["noise_multiplier"], config["clipping_bound"], config["local_epochs"]
    )
    strategy = OpacusBasicFedAvg(
        model=Net(),
        fraction_fit=config["client_sampling_rate"],
        min_available_clients=config["n_clients"],
        on_fit_config_fn=fit_config_fn,
    )
    server = InstanceLevelDpServer(
        strategy=strategy,
        noise_multiplier=config["noise_multiplier"],
        batch_size=config["batch_size"],
        num_server_rounds=config["n_server_rounds"],
    )
    fl.server.start_server(server=server, config=fl.server.ServerConfig(num_rounds=config["n_server_rounds"]))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--config_path", type=str, default="config.yaml")
    main(load_config(parser.parse_args().config_path))
