"""The FedProx job's training script, written for NVFlare's Client API (rankaudit reads it, never runs it)."""

import argparse

import nvflare.client as flare
import torch
from model import ModerateCNN
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_idx_root", type=str, default="/tmp/cifar10_splits")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--aggregation_epochs", type=int, default=4)
    parser.add_argument("--fedproxloss_mu", type=float, default=0.0)
    args = parser.parse_args()
    model = ModerateCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    data = TensorDataset(torch.randn(64, 3, 8, 8), torch.zeros(64, dtype=torch.long))
    train_loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    flare.init()
    while flare.is_running():
        received = flare.receive()
        model.load_state_dict(received.params)
        for epoch in range(args.aggregation_epochs):
            for images, labels in train_loader:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(model(images), labels).backward()
                optimizer.step()
        flare.send(flare.FLModel(params=model.state_dict()))


if __name__ == "__main__":
    main()
