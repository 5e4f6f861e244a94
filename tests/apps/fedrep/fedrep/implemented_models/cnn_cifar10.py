"""fedrep: the CIFAR-10 CNN, its body/head split and its manager."""
from torch import nn

from fedrep.models import ModelManager, ModelSplit


class CNNCifar10(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 8, 5),
            nn.ReLU(),
            nn.MaxPool2d(2, 2),
            nn.Flatten(),
            nn.Linear(8 * 14 * 14, 32),
            nn.ReLU(),
        )
        self.head = nn.Sequential(nn.Linear(32, 10))

    def forward(self, x):
        return self.head(self.body(x))


class CNNCifar10ModelSplit(ModelSplit):
    def _get_model_parts(self, model):
        return model.body, model.head


class CNNCifar10ModelManager(ModelManager):
    def __init__(self, context, trainloader):
        super().__init__(context, trainloader, CNNCifar10ModelSplit)

    def _create_model(self) -> nn.Module:
        return CNNCifar10()
