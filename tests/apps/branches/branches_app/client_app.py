"""The branches app's ClientApp: the run config picks Adam or SGD with momentum (rankaudit never runs it)."""

import torch
from flwr.clientapp import ClientApp
from torch.utils.data import DataLoader, TensorDataset

from branches_app.task import Net

app = ClientApp()


@app.train()
def train(msg, context):
    model = Net()
    lr = context.run_config["lr"]
    if context.run_config["optimizer"] == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loader = DataLoader(TensorDataset(torch.randn(16, 12)), batch_size=context.run_config["batch-size"], shuffle=True)
    for (x,) in loader:
        optimizer.zero_grad()
        model(x).sum().backward()
        optimizer.step()
