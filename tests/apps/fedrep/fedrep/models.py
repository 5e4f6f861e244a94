"""fedrep: a model split into a body (shared) and a head (kept by FedRep), and its manager."""
from abc import ABC, abstractmethod

import torch
from torch import nn


class ModelSplit(ABC, nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self._body, self._head = self._get_model_parts(model)

    @abstractmethod
    def _get_model_parts(self, model):
        """The body and the head of the model."""

    @property
    def body(self):
        return self._body

    @property
    def head(self):
        return self._head

    def get_parameters(self):
        return [val.cpu().numpy() for val in [*self.body.state_dict().values(), *self.head.state_dict().values()]]

    def forward(self, x):
        return self.head(self.body(x))


class ModelManager(ABC):
    def __init__(self, context, trainloader, model_split_class):
        self.context, self.trainloader = context, trainloader
        self._model = model_split_class(self._create_model())

    @abstractmethod
    def _create_model(self) -> nn.Module:
        """The model to split into body and head."""

    @property
    def model(self):
        return self._model

    def train(self):
        local_epochs = int(self.context.run_config["num-local-epochs"])
        rep_epochs = int(self.context.run_config["num-rep-epochs"])
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(
            self.model.parameters(), lr=float(self.context.run_config["learning-rate"]), momentum=0.5
        )
        for _ in range(local_epochs + rep_epochs):
            for images, labels in self.trainloader:
                optimizer.zero_grad()
                criterion(self.model(images), labels).backward()
                optimizer.step()
