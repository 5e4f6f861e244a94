"""A tiny DenseNet: inside each dense block every conv reads the concatenation of all earlier feature maps."""

import torch
import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 16, 16)


class DenseLayer(nn.Module):
    """BatchNorm, ReLU, 3x3 conv: adds `growth` new channels to the running concatenation."""

    def __init__(self, in_channels, growth):
        super().__init__()
        self.norm = nn.BatchNorm2d(in_channels)
        self.conv = nn.Conv2d(in_channels, growth, kernel_size=3, padding=1, bias=False)

    def forward(self, features):
        return self.conv(F.relu(self.norm(features)))


class DenseBlock(nn.Module):
    def __init__(self, in_channels, growth, depth):
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(in_channels + i * growth, growth) for i in range(depth))
        self.out_channels = in_channels + depth * growth

    def forward(self, x):
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, dim=1)))
        return torch.cat(features, dim=1)


class Transition(nn.Module):
    """1x1 conv to fewer channels, then 2x2 average pooling: halves the resolution between blocks."""

    def __init__(self, in_channels, out_channels):
        super().__init__()
        self.norm = nn.BatchNorm2d(in_channels)
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=1, bias=False)
        self.pool = nn.AvgPool2d(2)

    def forward(self, x):
        return self.pool(self.conv(F.relu(self.norm(x))))


class DenseNetTiny(nn.Module):
    """16x16 stem -> dense block (3 layers, growth 8) -> transition to 8x8 -> dense block -> pooled logits."""

    def __init__(self, num_classes=10, growth=8):
        super().__init__()
        self.stem = nn.Conv2d(3, 2 * growth, kernel_size=3, padding=1, bias=False)
        self.block1 = DenseBlock(2 * growth, growth, depth=3)
        self.transition = Transition(self.block1.out_channels, 2 * growth)
        self.block2 = DenseBlock(2 * growth, growth, depth=3)
        self.norm = nn.BatchNorm2d(self.block2.out_channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.block2.out_channels, num_classes)

    def forward(self, x):
        x = self.block2(self.transition(self.block1(self.stem(x))))
        x = self.pool(F.relu(self.norm(x)))
        return self.fc(torch.flatten(x, 1))
