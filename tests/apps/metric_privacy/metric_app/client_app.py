"""The metric app's ClientApp (imports flwr; rankaudit never runs it)."""

import torch
from flwr.clientapp import ClientApp
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

app = ClientApp()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x):
        return self.fc(x)


@app.train()
def train(msg, context):
    net = Net()
    data = TensorDataset(torch.randn(64, 12), torch.zeros(64, dtype=torch.long))
    loader = DataLoader(data, batch_size=context.run_config["batch-size"], shuffle=True)
    optimizer = torch.optim.Adam(net.parameters(), lr=context.run_config["learning-rate"])
    for _ in range(context.run_config["local-epochs"]):
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            optimizer.step()
