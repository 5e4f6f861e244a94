"""Exactly equal, twice-differentiable stand-ins for ops whose backward PyTorch cannot differentiate (verifiers only).

The rank check (method.md: numerical check) and the inverting-gradients attack differentiate the shared gradient again, so every op of
the model needs a derivative of its backward. A few built-in ops have none; a user cannot rewrite an op inside a
zoo model, so while those verifiers run, :class:`differentiable_ops` (a ``TorchFunctionMode``) answers each call of
an op in :data:`SUBSTITUTES` with a composition of ops that have one. Each composition equals the op's output and
its first derivative (ATen's hardsigmoid_backward multiplies by a float32 1/6 even in float64, 3e-8 off; the
composition's slope is exact), the kinks included; tests/test_substitute.py checks both on random inputs.

Found by running forward-over-reverse and reverse-over-reverse through the activation, normalisation, pooling,
resampling and attention families torchvision, timm and transformers use (torch 2.13, float64; see
tests/test_substitute.py::test_every_listed_op_family_has_a_double_backward_under_the_substitutes). Only these
failed; everything else (hardswish, relu6/hardtanh, silu, gelu and its tanh form, mish, elu, selu, celu, softplus,
logsigmoid, hard/soft shrink, softsign, max/avg/adaptive pools, norms, bilinear/bicubic/nearest upsampling,
channel_shuffle, attention in its math form) differentiates twice as is. ``grid_sample`` has no forward-mode rule
but a double backward, which the rank check's reverse-over-reverse fallback uses.

The analysis path never runs these: it reads the model on the meta device and never differentiates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


def _hardsigmoid(input: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    # ATen computes min(max(x + 3, 0), 6) / 6; relu6 is that clamp, and its backward (hardtanh_backward) is
    # differentiable: zero second derivative, as for the original.
    value = F.relu6(input + 3.0) / 6.0
    return input.copy_(value) if inplace else value


def _hardsigmoid_inplace(input: torch.Tensor) -> torch.Tensor:
    return _hardsigmoid(input, inplace=True)


def _native_channel_shuffle(input: torch.Tensor, groups: int) -> torch.Tensor:
    # ShuffleNet's permutation of channels: (B, g, C/g, ...) -> (B, C/g, g, ...); a reshape and a transpose.
    batch, channels = input.shape[:2]
    spatial = input.shape[2:]
    grouped = input.reshape(batch, groups, channels // groups, *spatial)
    return grouped.transpose(1, 2).reshape(batch, channels, *spatial)


@dataclass(frozen=True)
class Substitute:
    """One op without a derivative of its backward, and the composition that replaces it."""

    name: str  # the op as PyTorch's error message names it (aten::...)
    targets: tuple[Callable, ...]  # every Python entry point that reaches it
    replacement: Callable[..., torch.Tensor]  # same signature as the targets
    composition: str  # the formula, for the docs and the table test
    missing: str  # what PyTorch lacks


def _entry_points(*names: str) -> tuple[Callable, ...]:
    """The functions among torch, torch.nn.functional and torch._C._nn that exist in this PyTorch build."""
    found = []
    for name in names:
        owner, _, attribute = name.rpartition(".")
        module = {"torch": torch, "F": F, "torch._C._nn": torch._C._nn}[owner]
        if hasattr(module, attribute):
            found.append(getattr(module, attribute))
    return tuple(found)


# The single place that lists substituted ops. An entry must equal the op's output and first derivative; a test
# per entry checks both, and one more that the original still lacks the double backward (so a PyTorch that gains
# it shows up as a failing test, and the entry can go).
SUBSTITUTES: tuple[Substitute, ...] = (
    Substitute(
        "aten::hardsigmoid",
        _entry_points("F.hardsigmoid", "torch._C._nn.hardsigmoid"),
        _hardsigmoid,
        "relu6(x + 3) / 6",
        "aten::hardsigmoid_backward has no derivative (nor a forward-mode rule)",
    ),
    Substitute(
        "aten::hardsigmoid_",
        _entry_points("torch._C._nn.hardsigmoid_"),
        _hardsigmoid_inplace,
        "x.copy_(relu6(x + 3) / 6)",
        "aten::hardsigmoid_backward has no derivative (nor a forward-mode rule)",
    ),
    Substitute(
        "aten::native_channel_shuffle",
        _entry_points("torch.native_channel_shuffle"),
        _native_channel_shuffle,
        "x.reshape(B, g, C/g, ...).transpose(1, 2).reshape(B, C, ...)",
        "aten::native_channel_shuffle has no derivative at all",
    ),
)

_BY_TARGET: dict[Callable, Substitute] = {target: entry for entry in SUBSTITUTES for target in entry.targets}


class differentiable_ops(TorchFunctionMode):
    """While active, every call of an op in SUBSTITUTES runs its composition instead; other calls pass through.

    Works under torch.func (grad, jvp, vmap, functional_call) and plain autograd alike: the mode sits in front of
    the dispatcher, so the composition is what every transform sees. ``used`` collects the names of the
    substituted ops, for the report.
    """

    def __init__(self):
        super().__init__()
        self.used: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        entry = _BY_TARGET.get(func)
        if entry is None:
            return func(*args, **(kwargs or {}))
        self.used.add(entry.name)
        return entry.replacement(*args, **(kwargs or {}))
