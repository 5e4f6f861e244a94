"""flpa: the model and its training step."""
import logging

import torch
from torch import nn

from flpa.layers import conv_block

logging.basicConfig(level=logging.INFO)  # the app's own log lines, as many apps configure them
logger = logging.getLogger(__name__)
logger.info("flpa: task module loaded")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        logger.info("flpa: building Net")
        self.features = conv_block(1, 4)
        self.fc = nn.Linear(4 * 4 * 4, 10)

    def forward(self, x):
        return self.fc(self.features(x).flatten(1))


def train(net, trainloader, epochs, lr):
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    net.train()
    for _ in range(epochs):
        for images, labels in trainloader:
            optimizer.zero_grad()
            criterion(net(images), labels).backward()
            optimizer.step()
