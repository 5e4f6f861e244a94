"""The substitution table (rankaudit/verify/substitute.py): each stand-in equals its op's output and first derivative,
makes the double backward possible, and the MobileNetV3- and LCNet-style examples become checkable."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import measured_rank
from torch import nn
from torch.func import grad, jvp

from rankaudit.verify.rank import sketch
from rankaudit.verify.substitute import SUBSTITUTES, differentiable_ops

# Inputs for each entry's op, and how to call the original and its targets with them.
CALLS = {
    "aten::hardsigmoid": lambda op, x: op(x),
    "aten::hardsigmoid_": lambda op, x: op(x.clone()),
    "aten::native_channel_shuffle": lambda op, x: op(x.reshape(2, 6, 2, 2), 3),
}
# native_channel_shuffle has no derivative at all: its first derivative is checked against channel_shuffle's, the
# same permutation with one.
DERIVATIVE_OF = {"aten::native_channel_shuffle": F.channel_shuffle}


def _random(seed: int) -> torch.Tensor:
    # Spread over the kinks at ±3 of hardsigmoid (and far beyond them).
    return torch.randn(48, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 4.0


@pytest.mark.parametrize("entry", SUBSTITUTES, ids=[entry.name for entry in SUBSTITUTES])
def test_each_stand_in_equals_the_op_and_its_first_derivative(entry):
    call = CALLS[entry.name]
    assert entry.targets, f"{entry.name}: no entry point in this PyTorch"
    for seed in range(5):
        x = _random(seed)
        cotangent = torch.randn_like(call(entry.targets[0], x), dtype=torch.float64)
        for target in entry.targets:
            expected = call(target, x)
            assert torch.equal(call(entry.replacement, x), expected)
            # First derivative: the vector-Jacobian product along a random cotangent.
            a = x.clone().requires_grad_()
            b = x.clone().requires_grad_()
            reference = DERIVATIVE_OF.get(entry.name, target)
            (original,) = torch.autograd.grad((call(reference, a * 1.0) * cotangent).sum(), a)
            (replaced,) = torch.autograd.grad((call(entry.replacement, b * 1.0) * cotangent).sum(), b)
            # ATen's hardsigmoid_backward multiplies by 1.0f / 6.0f, a float32 constant even in float64 (relative
            # error 3e-8); the composition's slope is 1/6 to float64 precision. Equal up to that constant's rounding:
            torch.testing.assert_close(replaced, original, rtol=5e-8, atol=0)


def _input_gradient_tangent(op, width=8):
    """rᵀ ∂/∂x ∇_w L for L = Σ op(w ⊙ x)² + Σ op(w ⊙ x) · Σ w²: the rank check's forward-over-reverse row."""
    w = torch.randn(width, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = torch.randn(width, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) * 4.0

    def objective(w, x):
        y = op(w * x)
        return (y**2).sum() + y.sum() * (w**2).sum()

    input_gradient = grad(objective, argnums=1)
    return jvp(lambda w_: input_gradient(w_, x), (w,), (torch.ones_like(w),))[1]


def test_hardsigmoid_lacks_a_double_backward_and_the_mode_supplies_it():
    """If a PyTorch release gains the derivative, the first half fails and the entry can go."""
    with pytest.raises(RuntimeError, match="hardsigmoid_backward"):
        _input_gradient_tangent(F.hardsigmoid)
    with differentiable_ops() as mode:
        row = _input_gradient_tangent(F.hardsigmoid)
    assert torch.isfinite(row).all() and mode.used == {"aten::hardsigmoid"}
    # Reverse-over-reverse too (the rank check's fallback), through the module form.
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    with differentiable_ops():
        (g,) = torch.autograd.grad((nn.Hardsigmoid()(w * x) ** 2).sum(), w, create_graph=True)
        (second,) = torch.autograd.grad(g.sum(), x)
    assert torch.isfinite(second).all()


@pytest.mark.parametrize(
    "op",
    [
        F.hardswish,
        F.relu6,
        F.silu,
        F.gelu,
        lambda t: F.gelu(t, approximate="tanh"),
        F.mish,
        F.elu,
        F.selu,
        F.celu,
        F.softplus,
        F.logsigmoid,
        F.hardshrink,
        F.softshrink,
        F.softsign,
        F.hardtanh,
        lambda t: F.channel_shuffle(t.reshape(1, 4, 1, 2), 2).reshape(-1),
        lambda t: F.interpolate(t.reshape(1, 1, 2, 4), scale_factor=2, mode="bilinear").reshape(-1),
        lambda t: F.max_pool2d(t.reshape(1, 2, 2, 2), 3, 2, 1).reshape(-1),
    ],
    ids=[
        "hardswish",
        "relu6",
        "silu",
        "gelu",
        "gelu-tanh",
        "mish",
        "elu",
        "selu",
        "celu",
        "softplus",
        "logsigmoid",
        "hardshrink",
        "softshrink",
        "softsign",
        "hardtanh",
        "channel_shuffle",
        "bilinear",
        "max_pool",
    ],
)
def test_every_listed_op_family_has_a_double_backward_under_the_substitutes(op):
    """The families substitute.py's docstring names as twice differentiable as they are (torch 2.13)."""
    with differentiable_ops() as mode:
        row = _input_gradient_tangent(op)
    assert torch.isfinite(row).all() and not mode.used


@pytest.mark.parametrize("example", [pytest.param("mobilenetv3_tiny", marks=pytest.mark.slow), "lcnet_tiny"])
def test_mobile_examples_are_checkable_and_their_rank_respects_the_bound(example):
    """Both examples (3x16x16, hardswish, hardsigmoid-gated SE, depthwise convs): rank 664 of 768 measured in
    float64 (gap > 1e10); the static bound (728) is above it and the verdict admits the deficit."""
    result, measured = measured_rank(example)
    assert (measured.unknowns, measured.rank) == (768, 664)
    assert measured.gap > 1e10 and measured.method == "forward-over-reverse"
    assert measured.rank <= result.identifiability.rank_bound == 728
    # a certified deficit (728 of 768), though the 40 hidden directions hold little of a photograph's energy: exposed
    assert result.identifiability.sample.rank_bound < 768 and result.verdict == "exposed"
    # The static side knows hardsigmoid (a clamp, in ops.py's ReLU family): no "not modelled" caveat for it.
    assert not [c for c in result.caveats if c.code == "RA101" and "hardsigmoid" in c.message.lower()]


# Measured at seed 0, uniform inputs, random initialisation, float64 (tests/conftest.py's measured_rank). Both share
# the stride-2 3x3 stem with 8 channels that bounds MobileNetV3's and LCNet's examples (cut at stem.0: 728). The
# EfficientNet-style net loses the same 104 directions as those two; the MobileNetV2-style one loses far more: the
# stem's ReLU6 is flat below 0 (and above 6), so its inactive units cut directions (RA102: the bound is generic in
# its ReLU-like maps).
@pytest.mark.parametrize("example, rank_measured", [("efficientnet_tiny", 664), ("mobilenetv2_tiny", 336)])
@pytest.mark.slow  # two exact ranks at 3x16x16 (5-15 s each)
def test_efficientnet_and_mobilenetv2_examples_rank_respects_the_bound(example, rank_measured):
    """MBConv with SiLU and a sigmoid-gated SE; ReLU6 inverted residuals without SE (both 3x16x16, depthwise
    convs): the measured rank is below the bound 728 and the verdict admits a deficit."""
    result, measured = measured_rank(example)
    assert (measured.unknowns, measured.rank) == (768, rank_measured)
    assert measured.gap > 1e10 and measured.reliable and measured.method == "forward-over-reverse"
    assert measured.rank <= result.identifiability.rank_bound == 728
    assert result.identifiability.certified_deficit == 40 and result.verdict == "exposed"  # little energy hidden


@pytest.mark.parametrize("example", ["efficientnet_tiny", "mobilenetv2_tiny"])
def test_efficientnet_and_mobilenetv2_examples_need_no_substitute(example):
    """SiLU, sigmoid and ReLU6 have a double backward of their own: the sketch's rows run without the mode."""
    from conftest import EXAMPLES

    from rankaudit.verify.model import build_real_model

    model, _ = build_real_model(str(EXAMPLES / f"{example}.py"), (3, 16, 16), 0)
    x = torch.rand((1, 3, 16, 16), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    names = [name for name, _ in model.named_parameters()]
    forward = sketch._ForwardOverReverse(model, x, torch.tensor([0]), "cross-entropy", names)
    directions = [torch.randn(1, *p.shape, dtype=torch.float64) for p in model.parameters()]
    assert torch.isfinite(forward(directions)).all()


def test_without_the_substitutes_the_example_would_fail():
    """The reason for the table: the same sketch without the mode stops at hardsigmoid's backward."""
    from conftest import EXAMPLES

    from rankaudit.verify.model import build_real_model

    model, _ = build_real_model(str(EXAMPLES / "lcnet_tiny.py"), (3, 16, 16), 0)
    x = torch.rand((1, 3, 16, 16), dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    net = model.double().eval()
    names = [name for name, _ in net.named_parameters()]
    forward = sketch._ForwardOverReverse(net, x, torch.tensor([0]), "cross-entropy", names)
    directions = [torch.randn(1, *p.shape, dtype=torch.float64) for p in net.parameters()]
    with pytest.raises(RuntimeError, match="hardsigmoid_backward"):
        forward(directions)
    with differentiable_ops():
        assert torch.isfinite(forward(directions)).all()
