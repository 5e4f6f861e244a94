"""A tiny MLP-Mixer: 4x4 patches as tokens; each block mixes across tokens, then across channels, with MLPs."""

import torch.nn as nn

INPUT_SHAPE = (3, 16, 16)


class MLP(nn.Sequential):
    def __init__(self, features, hidden):
        super().__init__(nn.Linear(features, hidden), nn.GELU(), nn.Linear(hidden, features))


class MixerBlock(nn.Module):
    """Token mixing acts on each channel's column of tokens (hence the transposes); channel mixing on each token."""

    def __init__(self, tokens, channels, token_hidden, channel_hidden):
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_mlp = MLP(tokens, token_hidden)
        self.norm2 = nn.LayerNorm(channels)
        self.channel_mlp = MLP(channels, channel_hidden)

    def forward(self, x):
        x = x + self.token_mlp(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mlp(self.norm2(x))


class MixerTiny(nn.Module):
    """16 tokens of 32 channels from a 4x4 patch embedding, two mixer blocks, mean over tokens, logits."""

    def __init__(self, num_classes=10, patch=4, channels=32, depth=2):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, channels, kernel_size=patch, stride=patch)
        tokens = (INPUT_SHAPE[1] // patch) * (INPUT_SHAPE[2] // patch)
        self.blocks = nn.Sequential(
            *(MixerBlock(tokens, channels, token_hidden=32, channel_hidden=64) for _ in range(depth))
        )
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        tokens = self.norm(self.blocks(tokens))
        return self.head(tokens.mean(dim=1))
