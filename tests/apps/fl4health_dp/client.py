"""A client with instance-level DP: FL4Health runs DP-SGD with the noise and clipping the server sends."""

import argparse
from pathlib import Path

import flwr as fl
import torch
from fl4health.clients.instance_level_dp_client import InstanceLevelDpClient
from fl4health.utils.load_data import load_cifar10_data
from model import Net


class CifarDpClient(InstanceLevelDpClient):
    def get_data_loaders(self, config):
        batch_size = self.narrow_dict_type(config, "batch_size", int)
        train_loader, val_loader, _ = load_cifar10_data(self.data_path, batch_size)
        return train_loader, val_loader

    def get_model(self, config):
        return Net().to(self.device)

    def get_optimizer(self, config):
        return torch.optim.SGD(self.model.parameters(), lr=0.005, momentum=0.9)

    def get_criterion(self, config):
        return torch.nn.CrossEntropyLoss()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset_path", type=str, default="data")
    args = parser.parse_args()
    client = CifarDpClient(Path(args.dataset_path), [], torch.device("cpu"))
    fl.client.start_client(server_address="0.0.0.0:8080", client=client.to_client())
