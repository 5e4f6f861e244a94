"""The recipe's training script (rankaudit never runs it)."""

import argparse

import nvflare.client as flare
import torch
from model import CNN
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=2)
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()


def run():
    model = CNN(num_classes=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train_loader = DataLoader(TensorDataset(torch.randn(32, 1, 8, 8)), batch_size=args.batch_size, shuffle=True)
    flare.init()
    while flare.is_running():
        for _ in range(args.epochs):
            for (images,) in train_loader:
                optimizer.zero_grad()
                model(images).sum().backward()
                optimizer.step()
        flare.send(flare.FLModel(params=model.state_dict()))


run()
