"""local_dp_app: the model and its data (positional DataLoader batch size)."""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc1(x)


def load_data():
    train_set = TensorDataset(torch.randn(32, 16), torch.randint(0, 4, (32,)))
    return DataLoader(train_set, 16, True)
