"""The FedProx app's ServerApp, in the older strategy arguments (rankaudit reads it, never runs it)."""

from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedProx


def server_fn(context):
    strategy = FedProx(fraction_fit=1.0, min_fit_clients=5, proximal_mu=context.run_config["algorithm.proximal-mu"])
    return ServerAppComponents(
        strategy=strategy, config=ServerConfig(num_rounds=context.run_config["num-server-rounds"])
    )


app = ServerApp(server_fn=server_fn)
