"""fedrep: the ServerApp (rankaudit never runs it)."""
from flwr.common import Context
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg


def server_fn(context: Context):
    strategy = FedAvg(fraction_fit=float(context.run_config["fraction-fit"]), min_fit_clients=2)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=int(context.run_config["num-server-rounds"])))


app = ServerApp(server_fn=server_fn)
