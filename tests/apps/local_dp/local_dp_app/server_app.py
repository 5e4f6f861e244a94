"""local_dp_app: the ServerApp (never run by rankaudit)."""
from flwr.server import ServerApp, ServerConfig
from flwr.server.strategy import FedAvg

app = ServerApp(config=ServerConfig(num_rounds=4), strategy=FedAvg())
