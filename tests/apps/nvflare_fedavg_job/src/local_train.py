"""One site's local training with the client API."""

import argparse

import nvflare.client as flare
import torch
from network import TinyNetwork
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--local_epochs", type=int, default=1)
args = parser.parse_args()

model = TinyNetwork()
loader = DataLoader(TensorDataset(torch.randn(20, 3, 6, 6), torch.randint(0, 10, (20,))), batch_size=5, shuffle=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5)
flare.init()
while flare.is_running():
    model.load_state_dict(flare.receive().params)
    for _ in range(args.local_epochs):
        for images, labels in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(images), labels).backward()
            optimizer.step()
    flare.send(flare.FLModel(params=model.state_dict()))
