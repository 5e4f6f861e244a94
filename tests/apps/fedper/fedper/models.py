"""FedPer's model split (a body sent, a head kept) and model manager."""
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

    def forward(self, x):
        return self.head(self.body(x))


class ModelManager(ABC):
    def __init__(self, config, trainloader, model_split_class, learning_rate=0.01):
        self.config, self.trainloader, self.learning_rate = config, trainloader, learning_rate
        self._model = model_split_class(self._create_model())

    @abstractmethod
    def _create_model(self) -> nn.Module:
        """The model to split into body and head."""

    @property
    def model(self):
        return self._model

    def train(self, epochs=1):
        criterion = torch.nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(self.model.parameters(), lr=self.learning_rate)
        for _ in range(epochs):
            for images, labels in self.trainloader:
                optimizer.zero_grad()
                criterion(self.model(images), labels).backward()
                optimizer.step()
