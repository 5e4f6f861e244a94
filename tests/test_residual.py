"""method.md: counting on small blocks whose counts can be checked by hand."""

import torch
import torch.nn.functional as F
from conftest import analyse_module, row
from torch import nn


class IdentityBlock(nn.Module):
    """x1 (4x8x8=256) -> conv a -> relu -> conv b -> + x1; convs 4->4 3x3 pad 1, no bias (|W| 144 each)."""

    def __init__(self, in_place=True):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1, bias=False)  # 64 -> 256: V(x1) = 192
        self.a = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.b = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.head = nn.Linear(256, 1, bias=False)
        self.in_place = in_place

    def forward(self, x):
        x1 = self.stem(x)
        out = self.b(F.relu(self.a(x1)))
        if self.in_place:
            out += x1
        else:
            out = torch.add(out, x1)
        return self.head(out.flatten(1))


def test_identity_block_in_place_and_functional_add_count_the_same():
    for in_place in (True, False):
        result = analyse_module(lambda in_place=in_place: IdentityBlock(in_place), (1, 8, 8))
        stem, a, b, head = result.layers
        assert (stem.ra_i, a.virtual) == (64 - 36 - 256, 192)
        assert a.ra_i == 256 - 144 - 256 - 192
        assert a.block == b.block == result.blocks[0].name and stem.block is None
        assert b.virtual == 192  # a is not deficient: the chain keeps V
        # Block level: V(f) = V(x1) + max(|f|-|x1|, 0) - max(|x1|-|f|-|W_b|, 0) = 192
        assert head.virtual == 192
        assert [blk.kind for blk in result.blocks] == ["identity"]


class ProjectionBlock(nn.Module):
    """Downsampling block: main 3x3 stride 2 then 3x3; shortcut 1x1 stride 2 conv + BatchNorm."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 4, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(4)
        self.downsample = nn.Sequential(nn.Conv2d(2, 4, 1, stride=2, bias=False), nn.BatchNorm2d(4))
        self.pool = nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out = out + self.downsample(x)
        return self.pool(F.relu(out))


def test_projection_is_folded_into_the_first_main_layer():
    result = analyse_module(ProjectionBlock, (2, 8, 8))
    assert [r.name for r in result.layers] == ["conv1", "conv2", "pool"]  # the projection is no row
    conv1, conv2, pool = result.layers
    # |x1| = 128, conv1: |W| 72 + projection 8, |z| 64.
    assert (conv1.inputs, conv1.weights, conv1.outputs, conv1.virtual) == (128, 80, 64, 0)
    assert conv1.ra_i == 128 - 80 - 64 and conv1.folded == ["downsample.0"]
    # Inside the block the chain runs: conv1 leaves a deficit of 128 - 64 - 80 < 0 -> none.
    assert conv2.virtual == 0 and conv2.ra_i == 64 - 144 - 64
    # Leaving the block: V(f) = 0 + 0 - max(128 - 64 - 144 - 8, 0) = 0.
    assert pool.virtual == 0 and pool.ra_i == 64 - 0 - 4 - 0
    assert result.blocks[0].kind == "projection" and result.blocks[0].shortcut_layers == ["downsample.0"]


class Bottleneck(nn.Module):
    """A deficient main path (16 -> 2 -> 16 channels 1x1) behind an identity skip: the block is not deficient."""

    def __init__(self):
        super().__init__()
        self.reduce = nn.Conv2d(16, 2, 1, bias=False)  # x 256, W 32, z 32: deficit 192 inside
        self.expand = nn.Conv2d(2, 16, 1, bias=False)  # x 32,  W 32, z 256
        self.head = nn.Conv2d(16, 1, 4, bias=False)  # dense: kernel covers the 4x4 input

    def forward(self, x):
        return self.head(F.leaky_relu(self.expand(F.leaky_relu(self.reduce(x)))) + x)


def test_deficit_inside_a_block_does_not_propagate_past_it():
    result = analyse_module(Bottleneck, (16, 4, 4))
    reduce, expand, head = result.layers
    assert reduce.ra_i == 256 - 32 - 32 - 0
    assert expand.virtual == -192  # the chain inside the block carries the deficit
    # Block: V(f) = 0 + max(256-256, 0) - max(256 - 256 - 32, 0) = 0, not -192 + 224.
    assert head.virtual == 0
    assert head.dense and not head.critical
    assert result.critical_layer == "reduce" and result.ra_i == 192


def test_cutting_the_skip_lets_the_deficit_through():
    class NoSkip(Bottleneck):
        def forward(self, x):
            return self.head(F.leaky_relu(self.expand(F.leaky_relu(self.reduce(x)))))

    head = analyse_module(NoSkip, (16, 4, 4)).layers[-1]
    assert head.virtual == -192 + (256 - 32)  # chain rule of method.md: counting
    assert analyse_module(NoSkip, (16, 4, 4)).blocks == []


class CatMerge(nn.Module):
    def __init__(self):
        super().__init__()
        self.left = nn.Conv2d(1, 2, 3, padding=1, bias=False)  # 16 -> 32: V 16
        self.right = nn.Conv2d(1, 3, 3, padding=1, bias=False)  # 16 -> 48: V 32
        self.fuse = nn.Conv2d(5, 1, 1, bias=False)

    def forward(self, x):
        return self.fuse(torch.cat([self.left(x), self.right(x)], dim=1))


def test_cat_sums_virtual_constraints_and_unknowns():
    fuse = row(analyse_module(CatMerge, (1, 4, 4)), "fuse")
    assert (fuse.inputs, fuse.virtual) == (80, 16 + 32)


class TwoLongPaths(nn.Module):
    def __init__(self):
        super().__init__()
        self.a1, self.a2, self.a3 = (nn.Conv2d(2, 2, 3, padding=1, bias=False) for _ in range(3))
        self.b1, self.b2 = (nn.Conv2d(2, 2, 1, bias=False) for _ in range(2))

    def forward(self, x):
        return self.a3(self.a2(self.a1(x))) + self.b2(self.b1(x))


def test_add_of_two_multi_layer_paths_is_approximate_and_says_so():
    result = analyse_module(TwoLongPaths, (2, 4, 4))
    assert [r.name for r in result.layers] == ["a1", "a2", "a3"]
    assert row(result, "a1").weights == 36 + 4 + 4 and row(result, "a1").folded == ["b1", "b2"]
    assert [c.code for c in result.caveats if c.code == "RA103"] == ["RA103"]
