"""The script-style app's server (rankaudit reads it, never runs it)."""

import flwr as fl

strategy = fl.server.strategy.FedAvg(fraction_fit=1.0, min_fit_clients=5, min_available_clients=5)
fl.server.start_server(server_address="0.0.0.0:8080", config=fl.server.ServerConfig(num_rounds=4), strategy=strategy)
