"""The strategy app's ClientApp: the run config's strategy reaches train() through the client's constructor."""

import torch
from flwr.client import ClientApp, NumPyClient
from torch.utils.data import DataLoader, TensorDataset

from strategy_app.task import Net, train

CLIENT_MOMENTUM = 0.9


class FlowerClient(NumPyClient):
    def __init__(self, net, trainloader, local_epochs, strategy_name, lr):
        self.net = net
        self.trainloader = trainloader
        self.local_epochs = local_epochs
        self.strategy_name = strategy_name
        self.lr = lr

    def fit(self, parameters, config):
        train(self.net, self.trainloader, self.local_epochs, self.strategy_name, self.lr, momentum=CLIENT_MOMENTUM)
        return [], len(self.trainloader.dataset), {}


def client_fn(context):
    data = TensorDataset(torch.randn(40, 8), torch.zeros(40, dtype=torch.long))
    trainloader = DataLoader(data, batch_size=context.run_config["batch-size"], shuffle=True)
    return FlowerClient(
        Net(),
        trainloader,
        context.run_config["local-epochs"],
        context.run_config["strategy"],
        context.run_config["learning-rate"],
    ).to_client()


app = ClientApp(client_fn=client_fn)
