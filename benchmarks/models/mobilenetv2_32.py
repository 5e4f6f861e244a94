"""A MobileNetV2-style network at 3x32x32 (width 0.35, CIFAR strides): the depthwise-heavy case of the rank check's
benchmark (benchmarks/bench_verify.py)."""

import torch.nn as nn

INPUT_SHAPE = (3, 32, 32)

# (expansion t, output channels c, repeats n, first stride s), MobileNetV2's table at width 0.35, strides for 32 px.
SETTINGS = [(1, 8, 1, 1), (6, 8, 2, 1), (6, 16, 3, 2), (6, 24, 4, 2), (6, 32, 3, 1), (6, 56, 3, 2), (6, 112, 1, 1)]


def conv_bn(in_channels, out_channels, kernel, stride, groups=1, activation=True):
    layers = [
        nn.Conv2d(in_channels, out_channels, kernel, stride, kernel // 2, groups=groups, bias=False),
        nn.BatchNorm2d(out_channels),
    ]
    return nn.Sequential(*layers, nn.ReLU6()) if activation else nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """1x1 expansion, 3x3 depthwise, linear 1x1 projection; residual when the shape is kept."""

    def __init__(self, in_channels, out_channels, stride, expansion):
        super().__init__()
        hidden = in_channels * expansion
        layers = [conv_bn(in_channels, hidden, 1, 1)] if expansion != 1 else []
        layers += [
            conv_bn(hidden, hidden, 3, stride, groups=hidden),
            conv_bn(hidden, out_channels, 1, 1, activation=False),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and in_channels == out_channels

    def forward(self, x):
        return x + self.body(x) if self.residual else self.body(x)


class MobileNetV2Narrow(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        blocks, channels = [conv_bn(3, 16, 3, 1)], 16
        for expansion, out_channels, repeats, stride in SETTINGS:
            for index in range(repeats):
                blocks.append(InvertedResidual(channels, out_channels, stride if index == 0 else 1, expansion))
                channels = out_channels
        blocks.append(conv_bn(channels, 448, 1, 1))
        self.features = nn.Sequential(*blocks)
        self.classifier = nn.Linear(448, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x).mean(dim=(2, 3)))
