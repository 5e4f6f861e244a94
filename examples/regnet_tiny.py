"""A small RegNet (Radosavovic et al., Designing Network Design Spaces): the constructor computes the stage
widths with tensor arithmetic and .tolist(), as torchvision's and timm's RegNets do."""

import math

import torch
import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)


def regnet_stages(
    depth: int = 6, initial_width: int = 16, slope: float = 12.0, multiplier: float = 2.0, quantum: int = 8
) -> tuple[list[int], list[int]]:
    """RegNet's quantised linear widths u_j = w_0 + w_a·j, snapped to w_0·w_m^k, grouped into stages."""
    continuous = initial_width + slope * torch.arange(depth, dtype=torch.float64)
    exponent = torch.round(torch.log(continuous / initial_width) / math.log(multiplier))
    widths = (torch.round(initial_width * multiplier**exponent / quantum) * quantum).to(torch.int64)
    stage_widths, stage_depths = torch.unique_consecutive(widths, return_counts=True)
    return stage_widths.tolist(), stage_depths.tolist()


class XBlock(nn.Module):
    """1x1 conv, 3x3 group conv (stride on the first block of a stage), 1x1 conv; projection skip when needed."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, group_width: int = 8):
        super().__init__()
        self.a = nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels), nn.ReLU()
        )
        self.b = nn.Sequential(
            nn.Conv2d(
                out_channels, out_channels, 3, stride=stride, padding=1, groups=out_channels // group_width, bias=False
            ),
            nn.BatchNorm2d(out_channels),
            nn.ReLU(),
        )
        self.c = nn.Sequential(nn.Conv2d(out_channels, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.proj = None
        if stride != 1 or in_channels != out_channels:
            self.proj = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )
        self.relu = nn.ReLU()

    def forward(self, x):
        shortcut = x if self.proj is None else self.proj(x)
        return self.relu(self.c(self.b(self.a(x))) + shortcut)


class RegNetTiny(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        widths, depths = regnet_stages()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        blocks, in_channels = [], 16
        for width, depth in zip(widths, depths):
            for index in range(depth):
                blocks.append(XBlock(in_channels, width, stride=2 if index == 0 else 1))
                in_channels = width
        self.trunk = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(in_channels, num_classes)

    def forward(self, x):
        return self.fc(self.pool(self.trunk(self.stem(x))).flatten(1))
