"""DepthFL's client: each trains its model for num_epochs with a decaying learning rate."""
import flwr as fl
import torch
from hydra.utils import instantiate

from depthfl.models import train


class FlowerClient(fl.client.NumPyClient):
    def __init__(self, net, trainloader, num_epochs, learning_rate, learning_rate_decay):
        self.net, self.trainloader = net, trainloader
        self.num_epochs, self.learning_rate, self.learning_rate_decay = num_epochs, learning_rate, learning_rate_decay

    def get_parameters(self, config):
        return [val.cpu().numpy() for _, val in self.net.state_dict().items()]

    def fit(self, parameters, config):
        curr_round = int(config["curr_round"]) - 1
        train(
            self.net,
            self.trainloader,
            epochs=self.num_epochs,
            learning_rate=self.learning_rate * self.learning_rate_decay**curr_round,
        )
        return self.get_parameters({}), len(self.trainloader), {}


def gen_client_fn(num_epochs, trainloaders, learning_rate, learning_rate_decay, models):
    def client_fn(cid: str) -> FlowerClient:
        net = instantiate(models[int(cid)]).to(torch.device("cpu"))
        return FlowerClient(net, trainloaders[int(cid)], num_epochs, learning_rate, learning_rate_decay)

    return client_fn
