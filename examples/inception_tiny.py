"""A tiny Inception network: parallel 1x1, 3x3, 5x5 and pooling branches, concatenated along the channels."""

import torch
import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 16, 16)


class ConvReLU(nn.Sequential):
    def __init__(self, in_channels, out_channels, kernel_size):
        super().__init__(nn.Conv2d(in_channels, out_channels, kernel_size, padding=kernel_size // 2), nn.ReLU())


class InceptionModule(nn.Module):
    """Four branches at the same resolution; the 3x3 and 5x5 ones first reduce the channels with a 1x1 conv."""

    def __init__(self, in_channels, c1, c3_reduce, c3, c5_reduce, c5, pool_proj):
        super().__init__()
        self.branch1 = ConvReLU(in_channels, c1, 1)
        self.branch3 = nn.Sequential(ConvReLU(in_channels, c3_reduce, 1), ConvReLU(c3_reduce, c3, 3))
        self.branch5 = nn.Sequential(ConvReLU(in_channels, c5_reduce, 1), ConvReLU(c5_reduce, c5, 5))
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), ConvReLU(in_channels, pool_proj, 1))
        self.out_channels = c1 + c3 + c5 + pool_proj

    def forward(self, x):
        return torch.cat([self.branch1(x), self.branch3(x), self.branch5(x), self.branch_pool(x)], dim=1)


class InceptionTiny(nn.Module):
    """Stem conv, one inception module at 16x16, max-pool to 8x8, a second module, global average, logits."""

    def __init__(self, num_classes=10):
        super().__init__()
        self.stem = ConvReLU(3, 16, 3)
        self.inception1 = InceptionModule(16, c1=8, c3_reduce=8, c3=12, c5_reduce=4, c5=6, pool_proj=6)
        self.pool = nn.MaxPool2d(2)
        self.inception2 = InceptionModule(
            self.inception1.out_channels, c1=12, c3_reduce=12, c3=16, c5_reduce=6, c5=8, pool_proj=8
        )
        self.fc = nn.Linear(self.inception2.out_channels, num_classes)

    def forward(self, x):
        x = self.inception2(self.pool(self.inception1(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))
