"""The FedProx app's ClientApp (rankaudit reads it, never runs it)."""

import torch
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from fedprox_app.model import MLP, train

app = ClientApp()


@app.train()
def fit(msg, context):
    net = MLP()
    batch_size = context.run_config["dataset.batch-size"]
    loader = DataLoader(TensorDataset(torch.randn(40, 12), torch.zeros(40)), batch_size=batch_size, shuffle=True)
    train(
        net,
        loader,
        context.run_config["algorithm.local-epochs"],
        context.run_config["algorithm.lr"],
        context.run_config["algorithm.proximal-mu"],
    )
