"""A tiny squeeze-and-excitation ResNet: each block rescales its channels by a gate computed from their means."""

import torch
import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 16, 16)


class SqueezeExcitation(nn.Module):
    """Global average per channel -> bottleneck MLP -> sigmoid gate that multiplies the feature map."""

    def __init__(self, channels, reduction=4):
        super().__init__()
        self.reduce = nn.Linear(channels, channels // reduction)
        self.expand = nn.Linear(channels // reduction, channels)

    def forward(self, x):
        squeezed = x.mean(dim=(2, 3))
        gate = torch.sigmoid(self.expand(F.relu(self.reduce(squeezed))))
        return x * gate[:, :, None, None]


class SEBlock(nn.Module):
    """Two 3x3 convs with BatchNorm, the SE gate on the residual branch, a 1x1 projection when shapes change."""

    def __init__(self, in_channels, out_channels, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.se = SqueezeExcitation(out_channels)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.se(self.bn2(self.conv2(out)))
        return F.relu(out + self.shortcut(x))


class SETiny(nn.Module):
    """Stem conv, an SE block at 16x16 and one at 8x8, global average, logits."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.block1 = SEBlock(16, 16, stride=1)
        self.block2 = SEBlock(16, 32, stride=2)
        self.fc = nn.Linear(32, num_classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.block2(self.block1(x))
        return self.fc(x.mean(dim=(2, 3)))
