"""The optim app's ClientApp (imports flwr; rankaudit never runs it)."""

from flwr.client import ClientApp, NumPyClient

from optim_app.task import Net, get_optimizer, load_data, train


class FlowerClient(NumPyClient):
    def __init__(self, net, loader, run_config):
        self.net, self.loader, self.run_config = net, loader, run_config

    def fit(self, parameters, config):
        optimizer = get_optimizer(
            self.net,
            self.run_config["optimizer"],
            self.run_config["learning-rate"],
            self.run_config["momentum"],
        )
        train(self.net, self.loader, self.run_config["local-epochs"], optimizer)
        return [], 32, {}


def client_fn(context):
    return FlowerClient(Net(), load_data(context.run_config["batch-size"]), context.run_config).to_client()


app = ClientApp(client_fn=client_fn)
