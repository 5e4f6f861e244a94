"""CIFAR ResNet-18 with base width 16, as in R-GAP Figure 4 (RA-i about -1.0e4)."""

import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 32, 32)


class BasicBlock(nn.Module):
    """Two 3x3 convs with a skip; a 1x1 projection when the shape changes, unless the skip is cut."""

    def __init__(self, in_channels, out_channels, stride, skip=True):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.skip = skip
        self.downsample = None
        if skip and (stride != 1 or in_channels != out_channels):
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.skip:
            identity = x if self.downsample is None else self.downsample(x)
            out += identity
        return F.relu(out)


class ResNet18W16(nn.Module):
    """Blocks are numbered 1..8 from the input; `cut_skips` removes the skip of those blocks."""

    def __init__(self, width=16, num_classes=10, cut_skips=()):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        block_number = 0
        in_channels = width
        for stage, (multiplier, stride) in enumerate(((1, 1), (2, 2), (4, 2), (8, 2)), start=1):
            blocks = []
            for position in range(2):
                block_number += 1
                out_channels = width * multiplier
                blocks.append(
                    BasicBlock(
                        in_channels, out_channels, stride if position == 0 else 1, skip=block_number not in cut_skips
                    )
                )
                in_channels = out_channels
            setattr(self, f"layer{stage}", nn.Sequential(*blocks))
        self.avgpool = nn.AvgPool2d(4)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = self.avgpool(x)
        return self.fc(x.flatten(1))
