"""The Opacus app's server (rankaudit reads it, never runs it)."""

import flwr as fl

fl.server.start_server(server_address="0.0.0.0:8080", config=fl.server.ServerConfig(num_rounds=3))
