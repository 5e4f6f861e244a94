"""A tiny MobileNetV3-small-style network: hardswish, depthwise convs, squeeze-excitation gated by hardsigmoid."""

import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 16, 16)


class SqueezeExcitation(nn.Module):
    """Channel means -> 1x1 conv bottleneck with ReLU -> hardsigmoid gate that rescales the channels."""

    def __init__(self, channels, squeezed):
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)

    def forward(self, x):
        gate = F.adaptive_avg_pool2d(x, 1)
        gate = F.hardsigmoid(self.expand(F.relu(self.reduce(gate))))
        return x * gate


class InvertedResidual(nn.Module):
    """1x1 expansion (skipped when it would not widen), k x k depthwise, optional SE, linear 1x1 projection;
    the input is added back when the shapes allow."""

    def __init__(self, in_channels, expanded, out_channels, kernel, stride, se, activation):
        super().__init__()
        self.expand = None
        if expanded != in_channels:
            self.expand = nn.Sequential(
                nn.Conv2d(in_channels, expanded, 1, bias=False), nn.BatchNorm2d(expanded), activation()
            )
        self.depthwise = nn.Sequential(
            nn.Conv2d(expanded, expanded, kernel, stride=stride, padding=kernel // 2, groups=expanded, bias=False),
            nn.BatchNorm2d(expanded),
            activation(),
        )
        self.se = SqueezeExcitation(expanded, max(8, expanded // 4)) if se else nn.Identity()
        self.project = nn.Sequential(nn.Conv2d(expanded, out_channels, 1, bias=False), nn.BatchNorm2d(out_channels))
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x):
        out = self.expand(x) if self.expand is not None else x
        out = self.project(self.se(self.depthwise(out)))
        return out + x if self.residual else out


class MobileNetV3Tiny(nn.Module):
    """Stem conv (stride 2, hardswish), three inverted residual blocks as in MobileNetV3-small's first stages,
    a 1x1 conv, global average, a hardswish hidden layer and the logits."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8), nn.Hardswish()
        )
        self.blocks = nn.Sequential(
            InvertedResidual(8, 8, 8, 3, 1, se=True, activation=nn.ReLU),
            InvertedResidual(8, 24, 12, 3, 2, se=False, activation=nn.ReLU),
            InvertedResidual(12, 32, 12, 5, 1, se=True, activation=nn.Hardswish),
        )
        self.head = nn.Sequential(nn.Conv2d(12, 48, 1, bias=False), nn.BatchNorm2d(48), nn.Hardswish())
        self.classifier = nn.Sequential(nn.Linear(48, 32), nn.Hardswish(), nn.Dropout(0.2), nn.Linear(32, num_classes))

    def forward(self, x):
        x = self.head(self.blocks(self.stem(x)))
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))
