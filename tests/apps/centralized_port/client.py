"""The federated client of the centralized-to-federated port: cifar.train for one epoch a round (rankaudit reads
it, never runs it)."""

import cifar
import flwr as fl
import torch

DEVICE = torch.device("cpu")


class CifarClient(fl.client.NumPyClient):
    def __init__(self, model, trainloader, testloader, num_examples):
        self.model, self.trainloader = model, trainloader
        self.testloader, self.num_examples = testloader, num_examples

    def fit(self, parameters, config):
        cifar.train(self.model, self.trainloader, epochs=1, device=DEVICE)
        return [], self.num_examples["trainset"], {}


def main():
    model = cifar.Net().to(DEVICE).train()
    trainloader, testloader, num_examples = cifar.load_data()
    client = CifarClient(model, trainloader, testloader, num_examples).to_client()
    fl.client.start_client(server_address="127.0.0.1:8080", client=client)


if __name__ == "__main__":
    main()
