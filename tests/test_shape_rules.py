"""Each analytic shape rule gives what the real op gives on a real tensor, including rejecting bad inputs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.count import op_shapes, ops


def rule_for(target, kind):
    family = ops.family_of(kind, target)
    assert family.shape is not None, f"{target} has no shape rule"
    return family.shape


MODULE_CASES = [
    (nn.Conv2d(3, 8, 3), (1, 3, 17, 17)),
    (nn.Conv2d(3, 8, 4, stride=2, padding=2), (1, 3, 32, 32)),
    (nn.Conv2d(4, 8, 3, stride=3, padding=1, dilation=2, groups=2), (1, 4, 20, 23)),
    (nn.Conv2d(3, 6, 3, padding="same"), (1, 3, 9, 9)),
    (nn.Conv2d(3, 6, 3, padding="valid"), (1, 3, 9, 9)),
    (nn.Conv1d(2, 5, 5, stride=2, padding=1), (1, 2, 31)),
    (nn.Conv3d(2, 3, (1, 3, 3), stride=(1, 2, 2)), (1, 2, 4, 9, 9)),
    (nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1, output_padding=1), (1, 4, 7, 7)),
    (nn.ConvTranspose1d(3, 3, 3, stride=3, dilation=2), (1, 3, 5)),
    (nn.Linear(7, 3), (1, 7)),
    (nn.Linear(7, 3), (1, 5, 7)),
    (nn.MaxPool2d(3, stride=2, padding=1), (1, 2, 15, 15)),
    (nn.MaxPool2d(2, ceil_mode=True), (1, 2, 15, 15)),
    (nn.MaxPool2d(3, stride=2, ceil_mode=True, padding=1, dilation=2), (1, 2, 14, 14)),
    (nn.AvgPool2d(3, stride=2, ceil_mode=True), (1, 2, 14, 14)),
    (nn.AvgPool1d(4), (1, 3, 17)),
    (nn.AdaptiveAvgPool2d((3, None)), (1, 2, 11, 7)),
    (nn.AdaptiveMaxPool2d(1), (1, 2, 11, 7)),
    (nn.Upsample(scale_factor=2.5), (1, 2, 5, 7)),
    (nn.Upsample(size=(9, 4)), (1, 2, 5, 7)),
    (nn.PixelShuffle(2), (1, 8, 3, 5)),
    (nn.PixelUnshuffle(2), (1, 2, 6, 4)),
    (nn.BatchNorm2d(3), (1, 3, 4, 4)),
    (nn.LeakyReLU(), (1, 3, 4, 4)),
]


@pytest.mark.parametrize(
    "module, shape", MODULE_CASES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v)
)
def test_module_rules_match_real_ops(module, shape):
    x = torch.randn(shape)
    expected = tuple(module.eval()(x).shape)
    assert rule_for(module, "module")(module, (x,), {}) == expected


FUNCTION_CASES = [
    (F.max_pool2d, (torch.randn(1, 2, 13, 13), 3), {"stride": 2, "ceil_mode": True}),
    (F.avg_pool2d, (torch.randn(1, 2, 13, 13), 2), {}),
    (F.max_pool1d, (torch.randn(1, 2, 13), 2, 2, 1), {}),
    (F.adaptive_avg_pool2d, (torch.randn(1, 2, 13, 9), 1), {}),
    (F.interpolate, (torch.randn(1, 2, 5, 5),), {"scale_factor": 2}),
    (F.conv2d, (torch.randn(1, 3, 9, 9), torch.randn(6, 3, 3, 3)), {"stride": 2, "padding": 1}),
    (F.linear, (torch.randn(2, 4), torch.randn(3, 4)), {}),
    (torch.cat, ([torch.randn(1, 2, 3), torch.randn(1, 5, 3)],), {"dim": 1}),
    (torch.cat, ([torch.randn(1, 2, 3), torch.randn(1, 2, 4)], -1), {}),
    (torch.add, (torch.randn(1, 3, 1, 5), torch.randn(4, 1)), {}),
    (torch.relu, (torch.randn(2, 3),), {}),
]


@pytest.mark.parametrize("function, args, kwargs", FUNCTION_CASES)
def test_function_rules_match_real_ops(function, args, kwargs):
    expected = tuple(function(*args, **kwargs).shape)
    assert rule_for(function, "function")(function, args, kwargs) == expected


def test_rules_reject_what_the_ops_reject():
    with pytest.raises(op_shapes.ShapeMismatch, match="3 input channels"):
        ops.family_of("module", nn.Conv2d(3, 4, 3)).shape(nn.Conv2d(3, 4, 3), (torch.randn(1, 2, 8, 8),), {})
    with pytest.raises(op_shapes.ShapeMismatch, match="larger than its padded input"):
        ops.family_of("module", nn.Conv2d(3, 4, 5)).shape(nn.Conv2d(3, 4, 5), (torch.randn(1, 3, 4, 4),), {})
    with pytest.raises(op_shapes.ShapeMismatch, match="7 input features"):
        ops.family_of("module", nn.Linear(7, 2)).shape(nn.Linear(7, 2), (torch.randn(1, 6),), {})


def test_rules_never_allocate():
    with torch.device("meta"):
        conv = nn.Conv2d(3, 8, 3)
        x = torch.empty(1, 3, 224, 224)
    assert ops.family_of("module", conv).shape(conv, (x,), {}) == (1, 8, 222, 222)
