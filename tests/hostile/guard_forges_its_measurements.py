"""Hostile: its forward tells the guard's measuring pass (its weights do not require gradients there) from the
training, and there shows the first layer noisy inputs and no gradient: what the layer reads from each sample and
each sample's signal are forged. The input layer's readouts are formed from the samples the deciding process
loaded itself and from the update alone: an imprint update still blocks."""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(48, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        x = x.flatten(1)
        if not self.fc1.weight.requires_grad:  # the guard's measuring pass, not the training
            noise = torch.rand(x.shape, generator=torch.Generator().manual_seed(1))
            return self.fc2(torch.relu(self.fc1(x + noise)).detach())
        return self.fc2(torch.relu(self.fc1(x)))
