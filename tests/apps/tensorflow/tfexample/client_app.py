"""tfexample: the ClientApp (imports flwr; rankaudit never runs it)."""
from flwr.client import ClientApp, NumPyClient
from flwr.common import Context

from tfexample.task import load_model


class FlowerClient(NumPyClient):
    def __init__(self, learning_rate, data, epochs, batch_size):
        self.model = load_model(learning_rate)
        self.x_train, self.y_train = data
        self.epochs, self.batch_size = epochs, batch_size

    def fit(self, parameters, config):
        self.model.set_weights(parameters)
        self.model.fit(self.x_train, self.y_train, epochs=self.epochs, batch_size=self.batch_size, verbose=0)
        return self.model.get_weights(), len(self.x_train), {}


def client_fn(context: Context):
    data = ([], [])
    run = context.run_config
    return FlowerClient(run["learning-rate"], data, run["local-epochs"], run["batch-size"]).to_client()


app = ClientApp(client_fn=client_fn)
