"""ImageNet ResNet-50 (v1.5: stride on the 3x3 conv of each bottleneck).

Benchmark model for rankaudit. Self-contained (no torchvision); module names
follow the usual layout: conv1, bn1, relu, maxpool, layer1..layer4 (each a
Sequential of bottleneck blocks with conv1/bn1/conv2/bn2/conv3/bn3/relu and an
optional ``downsample`` Sequential(conv1x1, BN)), avgpool, fc.

Only one nn.Module subclass lives at module level (the block class is nested
inside it), so ``rankaudit resnet50.py`` needs no ``:NAME`` suffix.

Expected parameter count: 25,557,032.
"""

import torch
from torch import nn

INPUT_SHAPE = (3, 224, 224)


class ResNet50(nn.Module):
    """ResNet-50: bottleneck blocks [3, 4, 6, 3], 1000 classes."""

    LAYERS = (3, 4, 6, 3)
    NUM_CLASSES = 1000

    class Bottleneck(nn.Module):
        expansion = 4

        def __init__(self, in_ch, width, stride=1):
            super().__init__()
            out_ch = width * self.expansion
            self.conv1 = nn.Conv2d(in_ch, width, kernel_size=1, bias=False)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, width, kernel_size=3, stride=stride, padding=1, bias=False)
            self.bn2 = nn.BatchNorm2d(width)
            self.conv3 = nn.Conv2d(width, out_ch, kernel_size=1, bias=False)
            self.bn3 = nn.BatchNorm2d(out_ch)
            self.relu = nn.ReLU(inplace=True)
            if stride != 1 or in_ch != out_ch:
                self.downsample = nn.Sequential(
                    nn.Conv2d(in_ch, out_ch, kernel_size=1, stride=stride, bias=False),
                    nn.BatchNorm2d(out_ch),
                )
            else:
                self.downsample = None

        def forward(self, x):
            identity = x
            out = self.relu(self.bn1(self.conv1(x)))
            out = self.relu(self.bn2(self.conv2(out)))
            out = self.bn3(self.conv3(out))
            if self.downsample is not None:
                identity = self.downsample(x)
            out = out + identity
            return self.relu(out)

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        in_ch = 64
        stages = []
        for i, (blocks, width) in enumerate(zip(self.LAYERS, (64, 128, 256, 512))):
            stride = 1 if i == 0 else 2
            layer = []
            for b in range(blocks):
                layer.append(self.Bottleneck(in_ch, width, stride if b == 0 else 1))
                in_ch = width * self.Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(in_ch, self.NUM_CLASSES)

        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)
