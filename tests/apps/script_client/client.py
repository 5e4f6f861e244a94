"""An older script-style Flower client with Opacus' PrivacyEngine (rankaudit reads it, never runs it)."""

import flwr as fl
import torch
from models import CNN, ResNet  # noqa: F401  (CNN is imported, never trained)
from opacus import PrivacyEngine
from torch.utils.data import DataLoader, TensorDataset

PARAMS = {"batch_size": 16, "local_epochs": 3}
MAX_GRAD_NORM = 1.5
NOISE_MULTIPLIER = 1.1


class FlowerClient(fl.client.NumPyClient):
    def __init__(self):
        self.model = ResNet()
        self._lr = 0.01 * 2
        data = TensorDataset(torch.randn(64, 1, 8, 8), torch.zeros(64, dtype=torch.long))
        self.trainloader = DataLoader(data, batch_size=PARAMS["batch_size"], shuffle=True)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self._lr)
        self.privacy_engine = PrivacyEngine(
            self.model,
            batch_size=PARAMS["batch_size"],
            sample_size=64,
            noise_multiplier=NOISE_MULTIPLIER,
            max_grad_norm=MAX_GRAD_NORM,
        )
        self.privacy_engine.attach(self.optimizer)

    def fit(self, parameters, config):
        for _ in range(PARAMS["local_epochs"]):
            for images, labels in self.trainloader:
                self.optimizer.zero_grad()
                torch.nn.functional.cross_entropy(self.model(images), labels).backward()
                self.optimizer.step()
        return [], len(self.trainloader.dataset), {}


fl.client.start_numpy_client(server_address="127.0.0.1:8080", client=FlowerClient())
