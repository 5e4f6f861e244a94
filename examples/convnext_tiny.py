"""A tiny ConvNeXt: patchify stem, blocks of depthwise 7x7 conv, LayerNorm, GELU MLP, layer scale and residual."""

import torch
import torch.nn as nn
import torch.nn.functional as F

INPUT_SHAPE = (3, 16, 16)


class ChannelsFirstLayerNorm(nn.Module):
    """LayerNorm over the channels of an N,C,H,W map (ConvNeXt's stem and downsampling norm)."""

    def __init__(self, channels, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.eps = eps

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class ConvNeXtBlock(nn.Module):
    """dwconv 7x7 -> LayerNorm (channels last) -> Linear 4x wider -> GELU -> Linear back -> layer scale -> + x."""

    def __init__(self, channels, expansion=4, layer_scale=1e-1):
        super().__init__()
        self.dwconv = nn.Conv2d(channels, channels, kernel_size=7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels, eps=1e-6)
        self.pwconv1 = nn.Linear(channels, expansion * channels)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(expansion * channels, channels)
        self.gamma = nn.Parameter(layer_scale * torch.ones(channels))

    def forward(self, x):
        out = self.dwconv(x).permute(0, 2, 3, 1)
        out = self.pwconv2(self.act(self.pwconv1(self.norm(out))))
        out = (self.gamma * out).permute(0, 3, 1, 2)
        return x + out


class ConvNeXtTiny(nn.Module):
    """2x2 patchify stem to 8x8, two blocks of 24 channels, global average, LayerNorm, logits."""

    def __init__(self, num_classes=10, channels=24, depth=2):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, kernel_size=2, stride=2)
        self.stem_norm = ChannelsFirstLayerNorm(channels)
        self.blocks = nn.Sequential(*(ConvNeXtBlock(channels) for _ in range(depth)))
        self.head_norm = nn.LayerNorm(channels, eps=1e-6)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.blocks(self.stem_norm(self.stem(x)))
        return self.head(self.head_norm(x.mean(dim=(2, 3))))
