"""How each op family counts: a call's Counting from the facts the trace recorded, one small rule per family, by kind."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from rankaudit.count.op_shapes import ntuple
from rankaudit.trace.records import OpFacts


class Role(str, Enum):
    LAYER = "layer"  # a row of its own: |x|, |W|, |z|
    TRANSPARENT = "transparent"  # keeps the count: V and the unknowns pass through
    ADD = "add"  # a merge by sum: residual rules (method.md: counting)
    CAT = "cat"  # a merge by concatenation: V adds up


@dataclass(frozen=True)
class Counting:
    """How one call counts in the rank analysis."""

    role: Role
    weights: int = 0  # trainable parameters: gradient constraints |W|
    reported_params: int = 0  # parameters shown but not counted (norms, not-modelled ops)
    frozen_params: int = 0  # parameters without requires_grad: no gradient is shared for them
    bias_params: int = 0  # the trainable bias among `weights` (for the remove-bias edit)
    dense_candidate: bool = False  # weights applied at exactly one position per sample (method.md: counting)
    out_features: int | None = None  # the B <= out_features condition of method.md: counting and method.md: counting
    non_injective: bool = False  # ReLU-like: a zero output removes a weight constraint
    passes_unknowns: bool = True  # transparent ops: the unknowns of the input flow through
    caveat: str | None = None  # set for ops the counting rules do not model
    # The call's Jacobian depends on its traced input although its family's does not (1 / x is no scaling).
    input_dependent_jacobian: bool = False
    # Positions, among the traced operands, that only weight the others (attention's q and k): a layer that
    # reaches the loss only through them is a side branch (method.md: counting). None: decided from the shapes.
    gates: tuple[int, ...] | None = None


# ---- layers -----------------------------------------------------------------------------------------


def count_linear(f: OpFacts) -> Counting:
    weight = f.module.weight if f.module is not None else f.arg(1, "weight")
    out_features, in_features = weight.shape
    positions = f.input_numel // in_features if in_features else 0
    return Counting(
        Role.LAYER,
        weights=f.trainable,
        frozen_params=f.frozen,
        bias_params=f.trainable_bias(),
        dense_candidate=positions == 1,
        out_features=out_features,
    )


def _conv_covers_input(in_spatial, kernel, padding, dilation) -> bool:
    """A conv with one output position is dense only if its kernel sees every (padded) input entry."""
    n = len(in_spatial)
    padding = ntuple(padding, n)
    if isinstance(padding, tuple) and len(padding) == 2 * n:  # F.pad-style (left, right) pairs
        padding = tuple(padding[2 * i] + padding[2 * i + 1] for i in range(n))
    else:
        padding = tuple(2 * p for p in padding)
    dilation = ntuple(dilation, n)
    return all((k - 1) * d + 1 >= s + p for s, k, p, d in zip(in_spatial, kernel, padding, dilation))


def count_conv(f: OpFacts) -> Counting:
    if f.module is not None:
        weight, padding, dilation = f.module.weight, f.module.padding, f.module.dilation
    else:
        weight, padding, dilation = f.arg(1, "weight"), f.arg(4, "padding", 0), f.arg(5, "dilation", 1)
    out_channels, kernel = weight.shape[0], tuple(weight.shape[2:])
    out_positions = f.output_numel // out_channels if out_channels else 0
    dense = False
    if out_positions == 1 and f.traced_inputs:
        in_spatial = tuple(f.traced_inputs[0][-len(kernel) :])
        if padding == "same":
            padding = 0  # a 1x1 'same' output means the input itself is 1x1
        elif padding == "valid":
            padding = 0
        dense = _conv_covers_input(in_spatial, kernel, padding, dilation)
    return Counting(
        Role.LAYER,
        weights=f.trainable,
        frozen_params=f.frozen,
        bias_params=f.trainable_bias(),
        dense_candidate=dense,
        out_features=out_channels,
    )


def count_conv_transpose(f: OpFacts) -> Counting:
    weight = f.module.weight if f.module is not None else f.arg(1, "weight")
    spatial_dims = weight.dim() - 2
    groups = f.module.groups if f.module is not None else f.arg(6, "groups", 1)
    out_channels = weight.shape[1] * groups
    in_positions = math.prod(f.traced_inputs[0][-spatial_dims:]) if f.traced_inputs else 0
    return Counting(
        Role.LAYER,
        weights=f.trainable,
        frozen_params=f.frozen,
        bias_params=f.trainable_bias(),
        dense_candidate=in_positions == 1,
        out_features=out_channels,
    )


def count_resampler(f: OpFacts) -> Counting:
    """Pooling, upsampling, pixel shuffle: linear maps without weights, |W| = 0."""
    return Counting(Role.LAYER, frozen_params=f.frozen)


def count_aten_conv_transpose(f: OpFacts) -> Counting:
    weight = f.arg(1, "weight")
    groups = f.arg(8, "groups", 1)
    spatial_dims = weight.dim() - 2
    in_positions = math.prod(f.traced_inputs[0][-spatial_dims:]) if f.traced_inputs else 0
    return Counting(
        Role.LAYER,
        weights=f.trainable,
        frozen_params=f.frozen,
        dense_candidate=in_positions == 1,
        out_features=weight.shape[1] * groups,
    )


# ---- ops that keep the count ----------------------------------------------------------------------


def count_transparent(f: OpFacts) -> Counting:
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen)


def count_non_injective(f: OpFacts) -> Counting:
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen, non_injective=True)


def count_slice(f: OpFacts) -> Counting:
    """Indexing a tensor: a strided or partial slice is a resampler; a full one keeps the count."""
    if not f.traced_inputs:
        return Counting(Role.TRANSPARENT, passes_unknowns=False)  # picking a tensor out of a tuple
    if f.output_numel == f.input_numel:
        return Counting(Role.TRANSPARENT)
    return Counting(Role.LAYER)


def count_add(f: OpFacts) -> Counting:
    """A sum of two traced tensors is a merge; adding a constant or a parameter is a shift."""
    if len(f.traced_inputs) >= 2:
        return Counting(Role.ADD)
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen)


_DIVISIONS = ("truediv", "itruediv", "div", "div_", "__truediv__", "__rtruediv__")


def count_scale(f: OpFacts) -> Counting:
    """Multiplying by a constant keeps the count; the product of two activations (gating) is not modelled.
    Dividing by a traced tensor (1 / x, c / x) is no scaling: its Jacobian depends on that tensor."""
    if (f.called or f.op) in _DIVISIONS and any(position in (1, "other") for position in f.traced_positions):
        counting = not_modelled(f, "division by a tensor that depends on the input is not modelled")
        return dataclasses.replace(counting, input_dependent_jacobian=True)
    if len(f.traced_inputs) >= 2:
        return not_modelled(f, "product of two activations (gating or attention) is not modelled")
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen)


def count_cat(f: OpFacts) -> Counting:
    return Counting(Role.CAT)


def not_modelled(f: OpFacts, why: str | None = None) -> Counting:
    """method.md: counting: same numel -> transparent, otherwise a parameter-free layer; always a caveat."""
    params = f.trainable + f.frozen
    message = why or f"{f.op} is not modelled by the rank analysis"
    if params:
        message += f"; its {params} parameters are not counted as layer weights"
    if f.trainable:
        message += " (their gradients enter the rank bound as reached by all its inputs)"
    if f.traced_inputs and f.output_numel == f.input_numel:
        return Counting(
            Role.TRANSPARENT, reported_params=params, caveat=message + "; counted as transparent (same size in and out)"
        )
    return Counting(
        Role.LAYER, reported_params=params, caveat=message + "; counted as a parameter-free layer (size changes)"
    )


def count_unmodelled(f: OpFacts) -> Counting:
    return not_modelled(f)


def count_script_module(f: OpFacts) -> Counting:
    """A TorchScript module (torch.jit.script or torch.jit.trace): its graph is compiled, not Python the tracer can
    follow, so nothing is known of its inside but its parameters. Counted as the worst case: an op of unknown
    structure whose every input direction can reach every parameter's gradient (method.md: counting)."""
    return not_modelled(
        f,
        f"{f.op} is compiled (torch.jit.script or torch.jit.trace) and its inside cannot be traced, so the worst "
        "case is assumed: every input direction may reach its parameters' gradients, and at a batch size above 1 "
        "it may mix the samples (a BatchNorm fixed in training mode when it was traced)",
    )


def count_attention(f: OpFacts) -> Counting:
    """softmax(q kᵀ) v: the output is the data v mixed by weights that q and k only set."""
    counting = not_modelled(f, "attention (softmax(q kᵀ) v) is not modelled")
    return dataclasses.replace(counting, gates=(0, 1))


def _with_parameter_operand(f: OpFacts) -> tuple[torch.Tensor | None, int]:
    """The weight matrix among a product's operands (x @ W, addmm(b, x, W), x @ W.t(), x @ (A @ B)): a parameter,
    or a 2-D operand computed from parameters alone; and its position among the tensor operands."""
    tensor_positions = [index for index, a in enumerate(f.args) if isinstance(a, torch.Tensor)]
    for position, index in enumerate(tensor_positions):
        operand = f.args[index]
        if operand.dim() != 2:
            continue
        if isinstance(operand, nn.Parameter):
            return operand, position
        if f.traced_positions and index not in f.traced_positions and f.params:
            return operand, position
    return None, -1


def count_matmul(f: OpFacts) -> Counting:
    """x @ W with W a parameter is a Linear (GPT-2's Conv1D is addmm(b, x, W)); two data tensors are a product."""
    weight, position = _with_parameter_operand(f)
    if weight is None or len(f.traced_inputs) != 1:
        return not_modelled(f, f"product of two activations ({f.op}) is not modelled")
    operands = [a for a in f.args if isinstance(a, torch.Tensor)]
    # x @ W contracts W's rows; W @ x its columns.
    weight_first = operands[-1] is not weight
    in_features = weight.shape[1] if weight_first else weight.shape[0]
    out_features = weight.shape[0] if weight_first else weight.shape[1]
    positions = f.input_numel // in_features if in_features else 0
    bias = sum(a.numel() for a in operands if isinstance(a, nn.Parameter) and a is not weight and a.requires_grad)
    return Counting(
        Role.LAYER,
        weights=f.trainable,
        frozen_params=f.frozen,
        bias_params=bias,
        dense_candidate=positions == 1,
        out_features=out_features,
    )


def count_reduction(f: OpFacts) -> Counting:
    """A mean or sum over some dimensions: a linear map without weights, like average pooling (|W| = 0)."""
    if f.traced_inputs and f.output_numel == f.input_numel:
        return Counting(Role.TRANSPARENT)
    return Counting(Role.LAYER, frozen_params=f.frozen)


def count_convolution(f: OpFacts) -> Counting:
    """aten's one convolution op for both directions: its `transposed` argument says which."""
    return count_aten_conv_transpose(f) if f.arg(6, "transposed", False) else count_conv(f)
