"""Every op the registry calls constant-Jacobian has one: its Jacobian, evaluated numerically in float64, is the
same at two random points (method.md: the bound: such ops add no forward-to-backward edge to the flow network).

Two kinds of constancy are checked:
- linear ops (conv, pooling by averaging, views, sums, scalings): the Jacobians at two independent random points
  are equal;
- piecewise-linear ops (ReLU, clamp, max-pooling): the Jacobian is constant almost everywhere, on the pieces, not
  across them, so the two points are a random point and the same point moved by 1e-6 (the same piece with
  probability ~1). A smooth op fails this too: its Jacobian moves by ~1e-6, far above the 1e-11 tolerance.

A binary op (x + y, x * y, cat) is checked in its traced operand with the others held fixed: the product of two
data tensors is the flow network's own rule (each operand's δ is fed by the others' values). Dropout is checked in
eval mode: in training its mask is drawn per step and fixed within it, a constant of that step.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.count import ops

torch.manual_seed(0)
W2 = torch.randn(4, 8, dtype=torch.float64)
B4 = torch.randn(4, dtype=torch.float64)
OTHER = torch.randn(1, 3, 8, 8, dtype=torch.float64)
C1, C2, C3 = (torch.randn(4, 3, *(3,) * d, dtype=torch.float64) for d in (1, 2, 3))
T1, T2, T3 = (torch.randn(3, 4, *(3,) * d, dtype=torch.float64) for d in (1, 2, 3))

# Input shapes: "seq" (1, 3, 8), "image" (1, 3, 8, 8), "volume" (1, 3, 4, 4, 4), "features" (1, 8)
SHAPES = {
    "seq": (1, 3, 8),
    "image": (1, 3, 8, 8),
    "volume": (1, 3, 4, 4, 4),
    "features": (1, 8),
    "pixels": (1, 4, 4, 4),
}

LINEAR, PIECEWISE = "linear", "piecewise"


def _modules():
    d = torch.float64
    return {
        nn.Linear: (lambda: nn.Linear(8, 4), "features", LINEAR),
        nn.LazyLinear: (lambda: nn.LazyLinear(4, dtype=d), "features", LINEAR),
        nn.Conv1d: (lambda: nn.Conv1d(3, 4, 3), "seq", LINEAR),
        nn.Conv2d: (lambda: nn.Conv2d(3, 4, 3), "image", LINEAR),
        nn.Conv3d: (lambda: nn.Conv3d(3, 4, 3), "volume", LINEAR),
        nn.ConvTranspose1d: (lambda: nn.ConvTranspose1d(3, 4, 3), "seq", LINEAR),
        nn.ConvTranspose2d: (lambda: nn.ConvTranspose2d(3, 4, 3), "image", LINEAR),
        nn.ConvTranspose3d: (lambda: nn.ConvTranspose3d(3, 4, 3), "volume", LINEAR),
        nn.AvgPool1d: (lambda: nn.AvgPool1d(2), "seq", LINEAR),
        nn.AvgPool2d: (lambda: nn.AvgPool2d(2), "image", LINEAR),
        nn.AvgPool3d: (lambda: nn.AvgPool3d(2), "volume", LINEAR),
        nn.MaxPool1d: (lambda: nn.MaxPool1d(2), "seq", PIECEWISE),
        nn.MaxPool2d: (lambda: nn.MaxPool2d(2), "image", PIECEWISE),
        nn.MaxPool3d: (lambda: nn.MaxPool3d(2), "volume", PIECEWISE),
        nn.AdaptiveAvgPool1d: (lambda: nn.AdaptiveAvgPool1d(3), "seq", LINEAR),
        nn.AdaptiveAvgPool2d: (lambda: nn.AdaptiveAvgPool2d(3), "image", LINEAR),
        nn.AdaptiveAvgPool3d: (lambda: nn.AdaptiveAvgPool3d(3), "volume", LINEAR),
        nn.AdaptiveMaxPool1d: (lambda: nn.AdaptiveMaxPool1d(3), "seq", PIECEWISE),
        nn.AdaptiveMaxPool2d: (lambda: nn.AdaptiveMaxPool2d(3), "image", PIECEWISE),
        nn.AdaptiveMaxPool3d: (lambda: nn.AdaptiveMaxPool3d(3), "volume", PIECEWISE),
        nn.Upsample: (lambda: nn.Upsample(scale_factor=2, mode="bilinear"), "image", LINEAR),
        nn.UpsamplingNearest2d: (lambda: nn.UpsamplingNearest2d(scale_factor=2), "image", LINEAR),
        nn.UpsamplingBilinear2d: (lambda: nn.UpsamplingBilinear2d(scale_factor=2), "image", LINEAR),
        nn.PixelShuffle: (lambda: nn.PixelShuffle(2), "pixels", LINEAR),
        nn.PixelUnshuffle: (lambda: nn.PixelUnshuffle(2), "image", LINEAR),
        nn.Flatten: (nn.Flatten, "image", LINEAR),
        nn.Unflatten: (lambda: nn.Unflatten(1, (1, 8)), "features", LINEAR),
        nn.Identity: (nn.Identity, "image", LINEAR),
        nn.Dropout: (lambda: nn.Dropout(0.5), "image", LINEAR),
        nn.Dropout1d: (lambda: nn.Dropout1d(0.5), "seq", LINEAR),
        nn.Dropout2d: (lambda: nn.Dropout2d(0.5), "image", LINEAR),
        nn.Dropout3d: (lambda: nn.Dropout3d(0.5), "volume", LINEAR),
        nn.AlphaDropout: (lambda: nn.AlphaDropout(0.5), "image", LINEAR),
        nn.FeatureAlphaDropout: (lambda: nn.FeatureAlphaDropout(0.5), "image", LINEAR),
        nn.ZeroPad1d: (lambda: nn.ZeroPad1d(1), "seq", LINEAR),
        nn.ZeroPad2d: (lambda: nn.ZeroPad2d(1), "image", LINEAR),
        nn.ZeroPad3d: (lambda: nn.ZeroPad3d(1), "volume", LINEAR),
        nn.ConstantPad1d: (lambda: nn.ConstantPad1d(1, 0.5), "seq", LINEAR),
        nn.ConstantPad2d: (lambda: nn.ConstantPad2d(1, 0.5), "image", LINEAR),
        nn.ConstantPad3d: (lambda: nn.ConstantPad3d(1, 0.5), "volume", LINEAR),
        nn.ReLU: (nn.ReLU, "image", PIECEWISE),
        nn.ReLU6: (nn.ReLU6, "image", PIECEWISE),
        nn.Hardtanh: (nn.Hardtanh, "image", PIECEWISE),
        nn.Hardsigmoid: (nn.Hardsigmoid, "image", PIECEWISE),
    }


FUNCTIONS = {
    F.linear: (lambda x: F.linear(x, W2, B4), "features", LINEAR),
    F.conv1d: (lambda x: F.conv1d(x, C1), "seq", LINEAR),
    F.conv2d: (lambda x: F.conv2d(x, C2), "image", LINEAR),
    F.conv3d: (lambda x: F.conv3d(x, C3), "volume", LINEAR),
    torch.conv1d: (lambda x: torch.conv1d(x, C1), "seq", LINEAR),
    torch.conv2d: (lambda x: torch.conv2d(x, C2), "image", LINEAR),
    torch.conv3d: (lambda x: torch.conv3d(x, C3), "volume", LINEAR),
    F.conv_transpose1d: (lambda x: F.conv_transpose1d(x, T1), "seq", LINEAR),
    F.conv_transpose2d: (lambda x: F.conv_transpose2d(x, T2), "image", LINEAR),
    F.conv_transpose3d: (lambda x: F.conv_transpose3d(x, T3), "volume", LINEAR),
    F.avg_pool1d: (lambda x: F.avg_pool1d(x, 2), "seq", LINEAR),
    F.avg_pool2d: (lambda x: F.avg_pool2d(x, 2), "image", LINEAR),
    F.avg_pool3d: (lambda x: F.avg_pool3d(x, 2), "volume", LINEAR),
    torch.avg_pool1d: (lambda x: torch.avg_pool1d(x, 2), "seq", LINEAR),
    F.max_pool1d: (lambda x: F.max_pool1d(x, 2), "seq", PIECEWISE),
    F.max_pool2d: (lambda x: F.max_pool2d(x, 2), "image", PIECEWISE),
    F.max_pool3d: (lambda x: F.max_pool3d(x, 2), "volume", PIECEWISE),
    torch.max_pool1d: (lambda x: torch.max_pool1d(x, 2), "seq", PIECEWISE),
    torch.max_pool2d: (lambda x: torch.max_pool2d(x, 2), "image", PIECEWISE),
    torch.max_pool3d: (lambda x: torch.max_pool3d(x, 2), "volume", PIECEWISE),
    F.adaptive_avg_pool1d: (lambda x: F.adaptive_avg_pool1d(x, 3), "seq", LINEAR),
    F.adaptive_avg_pool2d: (lambda x: F.adaptive_avg_pool2d(x, 3), "image", LINEAR),
    F.adaptive_avg_pool3d: (lambda x: F.adaptive_avg_pool3d(x, 3), "volume", LINEAR),
    F.adaptive_max_pool1d: (lambda x: F.adaptive_max_pool1d(x, 3), "seq", PIECEWISE),
    F.adaptive_max_pool2d: (lambda x: F.adaptive_max_pool2d(x, 3), "image", PIECEWISE),
    F.adaptive_max_pool3d: (lambda x: F.adaptive_max_pool3d(x, 3), "volume", PIECEWISE),
    F.interpolate: (lambda x: F.interpolate(x, scale_factor=2, mode="bicubic"), "image", LINEAR),
    F.upsample: (lambda x: F.upsample(x, scale_factor=2, mode="bilinear"), "image", LINEAR),
    F.pixel_shuffle: (lambda x: F.pixel_shuffle(x, 2), "pixels", LINEAR),
    F.pixel_unshuffle: (lambda x: F.pixel_unshuffle(x, 2), "image", LINEAR),
    torch.pixel_shuffle: (lambda x: torch.pixel_shuffle(x, 2), "pixels", LINEAR),
    torch.pixel_unshuffle: (lambda x: torch.pixel_unshuffle(x, 2), "image", LINEAR),
    operator.getitem: (lambda x: x[:, 1:, ::2], "image", LINEAR),
    torch.flatten: (lambda x: torch.flatten(x, 1), "image", LINEAR),
    torch.reshape: (lambda x: torch.reshape(x, (1, -1)), "image", LINEAR),
    torch.permute: (lambda x: torch.permute(x, (0, 2, 3, 1)), "image", LINEAR),
    torch.transpose: (lambda x: torch.transpose(x, 1, 3), "image", LINEAR),
    torch.squeeze: (lambda x: torch.squeeze(x, 0), "image", LINEAR),
    torch.unsqueeze: (lambda x: torch.unsqueeze(x, 0), "image", LINEAR),
    torch.t: (lambda x: torch.t(x), "features", LINEAR),
    torch.movedim: (lambda x: torch.movedim(x, 1, 3), "image", LINEAR),
    F.dropout: (lambda x: F.dropout(x, 0.5, training=False), "image", LINEAR),
    F.dropout1d: (lambda x: F.dropout1d(x, 0.5, training=False), "seq", LINEAR),
    F.dropout2d: (lambda x: F.dropout2d(x, 0.5, training=False), "image", LINEAR),
    F.dropout3d: (lambda x: F.dropout3d(x, 0.5, training=False), "volume", LINEAR),
    F.alpha_dropout: (lambda x: F.alpha_dropout(x, 0.5, training=False), "image", LINEAR),
    F.pad: (lambda x: F.pad(x, (1, 2, 0, 1), mode="reflect"), "image", LINEAR),
    torch.clone: (lambda x: torch.clone(x), "image", LINEAR),
    F.relu: (lambda x: F.relu(x), "image", PIECEWISE),
    torch.relu: (lambda x: torch.relu(x), "image", PIECEWISE),
    F.relu6: (lambda x: F.relu6(x * 4), "image", PIECEWISE),
    F.hardtanh: (lambda x: F.hardtanh(x), "image", PIECEWISE),
    F.relu_: (lambda x: F.relu_(x.clone()), "image", PIECEWISE),
    torch.relu_: (lambda x: torch.relu_(x.clone()), "image", PIECEWISE),
    torch.clamp: (lambda x: torch.clamp(x, -0.5, 0.5), "image", PIECEWISE),
    torch.clip: (lambda x: torch.clip(x, min=0.0), "image", PIECEWISE),
    F.hardsigmoid: (lambda x: F.hardsigmoid(x * 4), "image", PIECEWISE),
    operator.add: (lambda x: operator.add(x, OTHER), "image", LINEAR),
    operator.iadd: (lambda x: operator.iadd(x.clone(), OTHER), "image", LINEAR),
    operator.sub: (lambda x: operator.sub(OTHER, x), "image", LINEAR),
    operator.isub: (lambda x: operator.isub(x.clone(), OTHER), "image", LINEAR),
    torch.add: (lambda x: torch.add(x, OTHER, alpha=2), "image", LINEAR),
    torch.sub: (lambda x: torch.sub(x, OTHER), "image", LINEAR),
    operator.mul: (lambda x: operator.mul(x, OTHER), "image", LINEAR),
    operator.imul: (lambda x: operator.imul(x.clone(), 3.0), "image", LINEAR),
    operator.truediv: (lambda x: operator.truediv(x, OTHER), "image", LINEAR),
    operator.itruediv: (lambda x: operator.itruediv(x.clone(), 3.0), "image", LINEAR),
    operator.neg: (lambda x: operator.neg(x), "image", LINEAR),
    torch.mul: (lambda x: torch.mul(OTHER, x), "image", LINEAR),
    torch.div: (lambda x: torch.div(x, OTHER), "image", LINEAR),
    torch.neg: (lambda x: torch.neg(x), "image", LINEAR),
    torch.cat: (lambda x: torch.cat([x, OTHER], 1), "image", LINEAR),
    torch.concat: (lambda x: torch.concat([OTHER, x], 2), "image", LINEAR),
    torch.concatenate: (lambda x: torch.concatenate([x, OTHER], 3), "image", LINEAR),
    torch.stack: (lambda x: torch.stack([x, OTHER]), "image", LINEAR),
    torch.addmm: (lambda x: torch.addmm(B4, x, W2.t()), "features", LINEAR),
    torch.broadcast_to: (lambda x: torch.broadcast_to(x, (2, 3, 8, 8)), "image", LINEAR),
    torch.tile: (lambda x: torch.tile(x, (1, 2, 1, 1)), "image", LINEAR),
    torch.repeat_interleave: (lambda x: torch.repeat_interleave(x, 2, dim=1), "image", LINEAR),
    torch.split: (lambda x: torch.split(x, 1, dim=1)[2], "image", LINEAR),
    torch.chunk: (lambda x: torch.chunk(x, 2, dim=2)[1], "image", LINEAR),
    torch.unbind: (lambda x: torch.unbind(x, 1)[0], "image", LINEAR),
    torch.tensor_split: (lambda x: torch.tensor_split(x, 3, dim=3)[1], "image", LINEAR),
    torch.mean: (lambda x: torch.mean(x, dim=(2, 3)), "image", LINEAR),
    torch.sum: (lambda x: torch.sum(x), "image", LINEAR),
}

METHODS = {
    "narrow": (lambda x: x.narrow(2, 1, 4), LINEAR),
    "view": (lambda x: x.view(1, -1), LINEAR),
    "reshape": (lambda x: x.reshape(3, -1), LINEAR),
    "flatten": (lambda x: x.flatten(1), LINEAR),
    "permute": (lambda x: x.permute(0, 3, 1, 2), LINEAR),
    "transpose": (lambda x: x.transpose(2, 3), LINEAR),
    "contiguous": (lambda x: x.transpose(2, 3).contiguous(), LINEAR),
    "squeeze": (lambda x: x.squeeze(0), LINEAR),
    "unsqueeze": (lambda x: x.unsqueeze(2), LINEAR),
    "t": (lambda x: x.flatten(1).t(), LINEAR),
    "movedim": (lambda x: x.movedim(3, 1), LINEAR),
    "view_as": (lambda x: x.flatten().view_as(OTHER), LINEAR),
    "reshape_as": (lambda x: x.flatten().reshape_as(OTHER), LINEAR),
    "clone": (lambda x: x.clone(), LINEAR),
    "float": (lambda x: x.float(), LINEAR),
    "double": (lambda x: x.double(), LINEAR),
    "half": (lambda x: x.half(), LINEAR),
    "bfloat16": (lambda x: x.bfloat16(), LINEAR),
    "to": (lambda x: x.to(torch.float32), LINEAR),
    "type": (lambda x: x.type(torch.float32), LINEAR),
    "type_as": (lambda x: x.type_as(OTHER), LINEAR),
    "unflatten": (lambda x: x.unflatten(1, (1, 3)), LINEAR),
    "relu": (lambda x: x.relu(), PIECEWISE),
    "relu_": (lambda x: x.clone().relu_(), PIECEWISE),
    "clamp": (lambda x: x.clamp(-0.5, 0.5), PIECEWISE),
    "clamp_": (lambda x: x.clone().clamp_(max=0.2), PIECEWISE),
    "clip": (lambda x: x.clip(0.1, 0.9), PIECEWISE),
    "add": (lambda x: x.add(OTHER), LINEAR),
    "add_": (lambda x: x.clone().add_(OTHER), LINEAR),
    "sub": (lambda x: x.sub(OTHER), LINEAR),
    "sub_": (lambda x: x.clone().sub_(OTHER), LINEAR),
    "mul": (lambda x: x.mul(OTHER), LINEAR),
    "mul_": (lambda x: x.clone().mul_(OTHER), LINEAR),
    "div": (lambda x: x.div(OTHER), LINEAR),
    "div_": (lambda x: x.clone().div_(OTHER), LINEAR),
    "neg": (lambda x: x.neg(), LINEAR),
    "addmm": (lambda x: B4.expand(1, 4).addmm(x.flatten(1)[:, :8], W2.t()), LINEAR),
    "expand": (lambda x: x.expand(2, -1, -1, -1), LINEAR),
    "expand_as": (lambda x: x[:, :1].expand_as(OTHER), LINEAR),
    "repeat": (lambda x: x.repeat(1, 1, 2, 1), LINEAR),
    "repeat_interleave": (lambda x: x.repeat_interleave(2, dim=3), LINEAR),
    "tile": (lambda x: x.tile((2,)), LINEAR),
    "broadcast_to": (lambda x: x.broadcast_to(3, 1, 3, 8, 8), LINEAR),
    "split": (lambda x: x.split(3, dim=2)[1], LINEAR),
    "chunk": (lambda x: x.chunk(3, dim=1)[2], LINEAR),
    "unbind": (lambda x: x.unbind(2)[5], LINEAR),
    "tensor_split": (lambda x: x.tensor_split(2, dim=3)[0], LINEAR),
    "mean": (lambda x: x.mean(1), LINEAR),
    "sum": (lambda x: x.sum(dim=(1, 3)), LINEAR),
}

# Constant-Jacobian entries without a float input of their own, each with the reason it is not evaluated here.
NOT_EVALUATED = {
    nn.Embedding: "reads integer token ids, not a float input: no Jacobian in the input",
    nn.EmbeddingBag: "reads integer token ids, not a float input: no Jacobian in the input",
    F.embedding: "reads integer token ids, not a float input: no Jacobian in the input",
    F.embedding_bag: "reads integer token ids, not a float input: no Jacobian in the input",
}


def _constant_entries(registry):
    return [spelling for spelling, family in registry.items() if not family.input_dependent_jacobian]


def _jacobian(function, x):
    return torch.autograd.functional.jacobian(lambda t: function(t).double(), x, vectorize=True)


def _assert_constant(label, function, shape, kind):
    generator = torch.Generator().manual_seed(1)
    first = 2 * torch.randn(shape, generator=generator, dtype=torch.float64)
    if kind == LINEAR:
        second = 2 * torch.randn(shape, generator=generator, dtype=torch.float64)
    else:  # the same piece: a move far smaller than the distance to any kink, with probability ~1
        second = first + 1e-6 * torch.randn(shape, generator=generator, dtype=torch.float64)
    at_first, at_second = _jacobian(function, first), _jacobian(function, second)
    difference = (at_first - at_second).abs().max().item()
    assert difference <= 1e-11, f"{label}: Jacobians differ by {difference:.3g} between two {kind} test points"


def test_every_constant_jacobian_spelling_is_evaluated():
    """A new constant-Jacobian entry in the registry needs a check below (or a reason it has no float input)."""
    modules = _modules()
    missing = [m.__name__ for m in _constant_entries(ops.MODULES) if m not in modules and m not in NOT_EVALUATED]
    missing += [
        getattr(f, "__name__", str(f))
        for f in _constant_entries(ops.FUNCTIONS)
        if f not in FUNCTIONS and f not in NOT_EVALUATED
    ]
    missing += [m for m in _constant_entries(ops.METHODS) if m not in METHODS]
    assert not missing, f"constant-Jacobian spellings without a numerical check: {missing}"


@pytest.mark.parametrize("module_type", _constant_entries(ops.MODULES), ids=lambda m: m.__name__)
def test_module_jacobian_is_constant(module_type):
    if module_type in NOT_EVALUATED:
        pytest.skip(NOT_EVALUATED[module_type])
    build, shape, kind = _modules()[module_type]
    torch.manual_seed(0)
    module = build().double().eval()
    _assert_constant(module_type.__name__, module, SHAPES[shape], kind)


@pytest.mark.parametrize(
    "function", _constant_entries(ops.FUNCTIONS), ids=lambda f: f"{getattr(f, '__module__', '')}.{f.__name__}"
)
def test_function_jacobian_is_constant(function):
    if function in NOT_EVALUATED:
        pytest.skip(NOT_EVALUATED[function])
    call, shape, kind = FUNCTIONS[function]
    _assert_constant(function.__name__, call, SHAPES[shape], kind)


@pytest.mark.parametrize("method", _constant_entries(ops.METHODS))
def test_method_jacobian_is_constant(method):
    call, kind = METHODS[method]
    _assert_constant(method, call, SHAPES["image"], kind)


@pytest.mark.parametrize(
    "label, function",
    [
        ("nn.LPPool2d", nn.LPPool2d(2, 2)),
        ("F.lp_pool1d", lambda x: F.lp_pool1d(x, 2, 2)),
        ("1 / x", lambda x: 1.0 / (x + 10.0)),
        ("x * x", lambda x: x * x),
    ],
)
def test_the_check_catches_an_input_dependent_jacobian(label, function):
    """The ops once registered as constant, and a repeated operand: the same check fails on them."""
    with pytest.raises(AssertionError, match="Jacobians differ"):
        _assert_constant(label, function, SHAPES["image"] if "2d" in label or "x" in label else SHAPES["seq"], LINEAR)
    with pytest.raises(AssertionError, match="Jacobians differ"):
        _assert_constant(
            label, function, SHAPES["image"] if "2d" in label or "x" in label else SHAPES["seq"], PIECEWISE
        )
