"""A tiny EfficientNet-B0-style network: SiLU, MBConv blocks with sigmoid-gated squeeze-excitation, 3x16x16 input."""

import torch
import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 16, 16)


class SqueezeExcitation(nn.Module):
    """Channel means -> 1x1 conv reduce, SiLU -> 1x1 conv expand, sigmoid gate that rescales the channels.

    As in EfficientNet the bottleneck is a quarter of the block's *input* channels, not of the expanded ones."""

    def __init__(self, channels, squeezed):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        gate = F.adaptive_avg_pool2d(x, 1)
        gate = torch.sigmoid(self.expand(F.silu(self.reduce(gate))))
        return x * gate


class MBConv(nn.Module):
    """1x1 expansion (absent at expand ratio 1), k x k depthwise, SE, linear 1x1 projection (no activation after
    it); the input is added back when stride and channels allow."""

    def __init__(self, in_channels, expand_ratio, out_channels, kernel, stride):
        super().__init__()
        expanded = in_channels * expand_ratio
        self.expand = None
        if expand_ratio != 1:
            self.expand = nn.Sequential(
                nn.Conv2d(in_channels, expanded, 1, bias=False), nn.BatchNorm2d(expanded), nn.SiLU()
            )
        self.depthwise = nn.Sequential(
            nn.Conv2d(expanded, expanded, kernel, stride=stride, padding=kernel // 2, groups=expanded, bias=False),
            nn.BatchNorm2d(expanded),
            nn.SiLU(),
        )
        self.se = SqueezeExcitation(expanded, max(1, in_channels // 4))
        self.project = nn.Sequential(nn.Conv2d(expanded, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x):
        out = self.expand(x) if self.expand is not None else x
        out = self.project(self.se(self.depthwise(out)))
        return out + x if self.residual else out


class EfficientNetTiny(nn.Module):
    """Stem conv (stride 2, SiLU), three MBConv blocks following B0's first stages (MBConv1 3x3, MBConv6 3x3 with
    stride 2, MBConv6 5x5 with a residual), a 1x1 head conv with SiLU, global average, dropout and the logits.
    Widths are kept small so that `--verify rank` (one float64 forward-over-reverse pass per sketch row) takes
    seconds on a CPU."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.SiLU())
        self.blocks = nn.Sequential(
            MBConv(8, 1, 8, 3, 1),
            MBConv(8, 6, 12, 3, 2),
            MBConv(12, 6, 12, 5, 1),
        )
        self.head = nn.Sequential(nn.Conv2d(12, 48, 1, bias=False), nn.BatchNorm2d(48), nn.SiLU())
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(48, num_classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(self.dropout(F.adaptive_avg_pool2d(x, 1).flatten(1)))
