"""The Opacus client started by hand: its data loaders read the batch size from dp_cifar_main's PARAMS."""

import math

import flwr as fl
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from dp_cifar_main import PARAMS, DPCifarClient, Net


def load_data():
    data = TensorDataset(torch.randn(100, 3, 8, 8), torch.zeros(100, dtype=torch.long))
    split = math.floor(len(data) * PARAMS["train_split"])
    trainset = Subset(data, list(range(0, split)))
    testset = Subset(data, list(range(split, len(data))))
    trainloader = DataLoader(trainset, PARAMS["batch_size"])
    testloader = DataLoader(testset, PARAMS["batch_size"])
    sample_rate = PARAMS["batch_size"] / len(trainset)
    return trainloader, testloader, sample_rate


model = Net()
trainloader, testloader, sample_rate = load_data()
fl.client.start_client(
    server_address="127.0.0.1:8080",
    client=DPCifarClient(model, trainloader, testloader, sample_rate).to_client(),
)
