"""A FLIP-style NVFlare executor: its epochs and lr come from config_fed_client.json placeholders (rankaudit reads
it, never runs it)."""

import torch
from nvflare.apis.executor import Executor
from simple_network import SimpleNetwork
from torch.utils.data import DataLoader, TensorDataset


class FLIP_TRAINER(Executor):
    def __init__(self, epochs=5, lr=0.001, project_id="", query="", train_task_name="train"):
        super().__init__()
        self._epochs = epochs
        self._lr = lr
        self._train_task_name = train_task_name
        self.model = SimpleNetwork()
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=self._lr, momentum=0.9)
        data = TensorDataset(torch.randn(48, 1, 8, 8), torch.zeros(48, dtype=torch.long))
        self.train_loader = DataLoader(data, batch_size=8, shuffle=True)

    def local_train(self, abort_signal):
        for epoch in range(self._epochs):
            for images, labels in self.train_loader:
                if abort_signal.triggered:
                    return
                self.optimizer.zero_grad()
                torch.nn.functional.cross_entropy(self.model(images), labels).backward()
                self.optimizer.step()

    def execute(self, task_name, shareable, fl_ctx, abort_signal):
        if task_name == self._train_task_name:
            self.local_train(abort_signal)
        return shareable
