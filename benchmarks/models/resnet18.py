"""CIFAR ResNet-18 at the standard widths 64-128-256-512: the verifier benchmark's large model (3x32x32 input).

The CIFAR layout of He et al. (2016) as most federated-learning papers use it: a 3x3 stem at stride 1 and no
max-pool (a 32-pixel image would otherwise shrink to 8 pixels before the first block), four stages of two basic
blocks, global average pooling, ten classes. Self-contained (no torchvision), one nn.Module subclass at module
level, so ``rankaudit resnet18.py`` needs no ``:NAME`` suffix.

Expected parameter count: 11,173,962.
"""

import torch.nn.functional as F
from torch import nn

INPUT_SHAPE = (3, 32, 32)


class ResNet18(nn.Module):
    """Basic blocks [2, 2, 2, 2] at widths 64, 128, 256, 512; a 1x1 projection where a block changes shape."""

    WIDTHS = (64, 128, 256, 512)
    NUM_CLASSES = 10

    class BasicBlock(nn.Module):
        def __init__(self, in_channels, out_channels, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
            self.bn1 = nn.BatchNorm2d(out_channels)
            self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(out_channels)
            self.shortcut = None
            if stride != 1 or in_channels != out_channels:
                self.shortcut = nn.Sequential(
                    nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                    nn.BatchNorm2d(out_channels),
                )

        def forward(self, x):
            residual = x if self.shortcut is None else self.shortcut(x)
            out = F.relu(self.bn1(self.conv1(x)))
            return F.relu(self.bn2(self.conv2(out)) + residual)

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, self.WIDTHS[0], 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(self.WIDTHS[0])
        in_channels = self.WIDTHS[0]
        for stage, width in enumerate(self.WIDTHS, start=1):
            stride = 1 if stage == 1 else 2
            blocks = [self.BasicBlock(in_channels, width, stride), self.BasicBlock(width, width, 1)]
            setattr(self, f"layer{stage}", nn.Sequential(*blocks))
            in_channels = width
        self.fc = nn.Linear(in_channels, self.NUM_CLASSES)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
