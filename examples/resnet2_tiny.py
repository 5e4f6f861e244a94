"""A two-block residual net at 3x16x16 (5,140 parameters), comparable to the federated-round reference net (method.md: the round)."""

import torch
import torch.nn as nn

INPUT_SHAPE = (3, 16, 16)


class Block(nn.Module):
    """x + conv(act(conv(x))), then the activation: an identity shortcut around two 3x3 convs."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.LeakyReLU(0.2)

    def forward(self, x):
        return self.act(x + self.conv2(self.act(self.conv1(x))))


class ResNet2Tiny(nn.Module):
    """Stem conv, two residual blocks, 4x4 average pooling, a linear layer to 20 classes; `width` channels."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.block1 = Block(width)
        self.block2 = Block(width)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(16 * width, 20)

    def forward(self, x):
        x = self.block2(self.block1(torch.relu(self.stem(x))))
        return self.fc(self.pool(x).flatten(1))
