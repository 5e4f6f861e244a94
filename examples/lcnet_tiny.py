"""A tiny PP-LCNet-style network: depthwise-separable blocks with hardswish, hardsigmoid-gated SE in the last ones."""

import torch.nn as nn

INPUT_SHAPE = (3, 16, 16)


class SqueezeExcite(nn.Module):
    """Global average -> 1x1 conv reduce, ReLU -> 1x1 conv expand, hardsigmoid (modules, as timm's LCNet has)."""

    def __init__(self, channels, reduction=4):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, channels // reduction, 1)
        self.relu = nn.ReLU()
        self.expand = nn.Conv2d(channels // reduction, channels, 1)
        self.gate = nn.Hardsigmoid()

    def forward(self, x):
        return x * self.gate(self.expand(self.relu(self.reduce(self.pool(x)))))


class DepthwiseSeparable(nn.Module):
    """k x k depthwise conv, BN, hardswish, optional SE, then a 1x1 pointwise conv, BN, hardswish (no residual)."""

    def __init__(self, in_channels, out_channels, kernel, stride, se=False):
        super().__init__()
        self.depthwise = nn.Conv2d(
            in_channels, in_channels, kernel, stride=stride, padding=kernel // 2, groups=in_channels, bias=False
        )
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.act1 = nn.Hardswish()
        self.se = SqueezeExcite(in_channels) if se else nn.Identity()
        self.pointwise = nn.Conv2d(in_channels, out_channels, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.act2 = nn.Hardswish()

    def forward(self, x):
        x = self.se(self.act1(self.bn1(self.depthwise(x))))
        return self.act2(self.bn2(self.pointwise(x)))


class LCNetTiny(nn.Module):
    """Stem conv (stride 2), four depthwise-separable blocks (3x3, then 5x5 with SE), global average, a 1x1 conv
    with bias and hardswish in place of a wide head, and the logits."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.Hardswish()
        )
        self.blocks = nn.Sequential(
            DepthwiseSeparable(8, 16, 3, 1),
            DepthwiseSeparable(16, 16, 3, 2),
            DepthwiseSeparable(16, 32, 5, 1, se=True),
            DepthwiseSeparable(32, 32, 5, 1, se=True),
        )
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Conv2d(32, 64, 1)
        self.act = nn.Hardswish()
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.act(self.head(self.pool(self.blocks(self.stem(x)))))
        return self.fc(x.flatten(1))
