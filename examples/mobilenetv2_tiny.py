"""A tiny MobileNetV2-style network: ReLU6, inverted residual blocks without squeeze-excitation, 3x16x16 input."""

import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 16, 16)


class InvertedResidual(nn.Module):
    """1x1 expansion with ReLU6 (absent at expand ratio 1), 3x3 depthwise with ReLU6, linear 1x1 projection (the
    linear bottleneck: no activation after it); the input is added back when stride and channels allow."""

    def __init__(self, in_channels, expand_ratio, out_channels, stride):
        super().__init__()
        expanded = in_channels * expand_ratio
        layers = []
        if expand_ratio != 1:
            layers += [nn.Conv2d(in_channels, expanded, 1, bias=False), nn.BatchNorm2d(expanded), nn.ReLU6()]
        layers += [
            nn.Conv2d(expanded, expanded, 3, stride=stride, padding=1, groups=expanded, bias=False),
            nn.BatchNorm2d(expanded),
            nn.ReLU6(),
            nn.Conv2d(expanded, out_channels, 1, bias=False),
            nn.BatchNorm2d(out_channels),
        ]
        self.conv = nn.Sequential(*layers)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x):
        out = self.conv(x)
        return out + x if self.residual else out


class MobileNetV2Tiny(nn.Module):
    """Stem conv (stride 2, ReLU6), three inverted residual blocks following MobileNetV2's first rows (t = 1, then
    t = 6 with stride 2, then t = 6 with a residual), a 1x1 conv with ReLU6, global average, dropout and the
    logits. Widths are kept small so that `--verify rank` takes seconds on a CPU."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.blocks = nn.Sequential(
            InvertedResidual(8, 1, 8, 1),
            InvertedResidual(8, 6, 12, 2),
            InvertedResidual(12, 6, 12, 1),
        )
        self.head = nn.Sequential(nn.Conv2d(12, 48, 1, bias=False), nn.BatchNorm2d(48), nn.ReLU6())
        self.dropout = nn.Dropout(0.2)
        self.fc = nn.Linear(48, num_classes)

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(self.dropout(F.adaptive_avg_pool2d(x, 1).flatten(1)))
