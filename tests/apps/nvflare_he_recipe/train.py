"""Each site's training script (the job passes its batch and epochs)."""

import argparse

import nvflare.client as flare
import torch
from net import SmallNet
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--batch_size", type=int, default=4)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.02)
args = parser.parse_args()

net = SmallNet()
optimizer = torch.optim.SGD(net.parameters(), lr=args.lr)
loader = DataLoader(
    TensorDataset(torch.randn(24, 16), torch.randint(0, 3, (24,))), batch_size=args.batch_size, shuffle=True
)
flare.init()
while flare.is_running():
    received = flare.receive()
    net.load_state_dict(received.params)
    for _ in range(args.epochs):
        for features, labels in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(net(features), labels).backward()
            optimizer.step()
    flare.send(flare.FLModel(params=net.state_dict()))
