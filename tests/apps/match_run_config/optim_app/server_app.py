"""The optim app's ServerApp (imports flwr; rankaudit never runs it)."""

from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg


def server_fn(context):
    strategy = FedAvg(fraction_fit=1.0, min_fit_clients=2)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=context.run_config["num-server-rounds"]))


app = ServerApp(server_fn=server_fn)
