"""The job's training script: its options come from argparse, the job passes --batch_size (rankaudit never runs it)."""

import argparse

import nvflare.client as flare
import torch
from net import Net
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    train_loader = DataLoader(TensorDataset(torch.randn(64, 1, 8, 8)), batch_size=args.batch_size, shuffle=True)
    flare.init()
    while flare.is_running():
        model.load_state_dict(flare.receive().params)
        for epoch in range(args.epochs):
            for (images,) in train_loader:
                optimizer.zero_grad()
                model(images).sum().backward()
                optimizer.step()
        flare.send(flare.FLModel(params=model.state_dict()))


if __name__ == "__main__":
    main()
