"""The match app's ClientApp (imports flwr; rankaudit never runs it)."""

from flwr.client import ClientApp, NumPyClient

from match_app.task import Net, Preferences, load_data, make_optimizer, train


class FlowerClient(NumPyClient):
    def __init__(self, net, loader, local_epochs):
        self.net, self.loader, self.local_epochs = net, loader, local_epochs

    def fit(self, parameters, config):
        preferences = Preferences()
        train(self.net, self.loader, self.local_epochs, make_optimizer(self.net, preferences))
        return [], 24, {}


def client_fn(context):
    preferences = Preferences()
    return FlowerClient(Net(), load_data(preferences), context.run_config["local-epochs"]).to_client()


app = ClientApp(client_fn=client_fn)
