"""hello-lightning's model: a small CNN inside a LightningModule (rankaudit reads the Net)."""
import torch
import torch.nn as nn
import torch.nn.functional as F
from pytorch_lightning import LightningModule


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 4, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(4 * 14 * 14, 10)

    def forward(self, x):
        return self.fc1(torch.flatten(self.pool(F.relu(self.conv1(x))), 1))


class LitNet(LightningModule):
    def __init__(self):
        super().__init__()
        self.model = Net()

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, labels = batch
        return F.cross_entropy(self(x), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.001, momentum=0.9)
