"""tfexample: the ServerApp (imports flwr; rankaudit never runs it)."""
from flwr.common import Context, ndarrays_to_parameters
from flwr.server import ServerApp, ServerAppComponents, ServerConfig
from flwr.server.strategy import FedAvg

from tfexample.task import load_model


def server_fn(context: Context):
    parameters = ndarrays_to_parameters(load_model().get_weights())
    strategy = FedAvg(fraction_fit=1.0, initial_parameters=parameters)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=context.run_config["num-server-rounds"]))


app = ServerApp(server_fn=server_fn)
