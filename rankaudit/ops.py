"""Registry: op kind -> how it counts (one small handler per op family)."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Role(str, Enum):
    LAYER = "layer"  # a row of its own: |x|, |W|, |z|
    TRANSPARENT = "transparent"  # keeps the count: V and the unknowns pass through
    ADD = "add"  # a merge by sum: residual rules (spec §5)
    CAT = "cat"  # a merge by concatenation: V adds up


@dataclass
class OpFacts:
    """What the tracer knows about one call, with graph values already resolved to (meta) tensors."""

    op: str  # display name: "Conv2d", "conv2d", "relu", "add"
    module: nn.Module | None  # the leaf module for module calls
    args: tuple  # positional arguments, values resolved
    kwargs: dict  # keyword arguments, values resolved
    traced_inputs: list[torch.Size]  # shapes of the operands that depend on the model's input
    output_shape: torch.Size | None  # None when the call returns no single tensor
    output_numel: int
    params: list[nn.Parameter] = field(default_factory=list)  # parameters the call reads

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def trainable(self) -> int:
        return sum(p.numel() for p in self.params if p.requires_grad)

    @property
    def frozen(self) -> int:
        return sum(p.numel() for p in self.params if not p.requires_grad)

    def trainable_bias(self, position: int = 2) -> int:
        bias = self.module.bias if self.module is not None else self.arg(position, "bias")
        return bias.numel() if isinstance(bias, torch.Tensor) and bias.requires_grad else 0

    @property
    def input_numel(self) -> int:
        return math.prod(self.traced_inputs[0]) if self.traced_inputs else 0


@dataclass(frozen=True)
class Counting:
    """How one call counts in the rank analysis."""

    role: Role
    weights: int = 0  # trainable parameters: gradient constraints |W|
    reported_params: int = 0  # parameters shown but not counted (norms, not-modelled ops)
    frozen_params: int = 0  # parameters without requires_grad: no gradient is shared for them
    bias_params: int = 0  # the trainable bias among `weights` (for the remove-bias edit)
    dense_candidate: bool = False  # weights applied at exactly one position per sample (spec §3)
    out_features: int | None = None  # the B <= out_features condition of spec §3 and §6
    non_injective: bool = False  # ReLU-like: a zero output removes a weight constraint
    passes_unknowns: bool = True  # transparent ops: the unknowns of the input flow through
    caveat: str | None = None  # set for ops the spec does not model
    # Positions, among the traced operands, that only weight the others (attention's q and k): a layer that
    # reaches the loss only through them is a side branch (spec §5). None: decided from the shapes.
    gates: tuple[int, ...] | None = None


@dataclass(frozen=True)
class OpFamily:
    key: str
    handler: Callable[[OpFacts], Counting]
    # (target, args, kwargs) -> output shape, or None to let the tracer run the op on meta; target is the
    # module, function or method name called. Meta kernels of many ops are Python and import half of torch
    # on first use (about a second); a formula costs microseconds.
    shape: Callable[[Any, tuple, dict], tuple | None] | None = None
    # Spec §9: does the op's local Jacobian depend (smoothly) on its forward input? Then the backward pass
    # through it reads the forward tensor, and the bound's flow network gets an edge t -> δ(in). Linear maps
    # with fixed weights and piecewise-linear maps (ReLU, max-pool) do not; unknown ops are assumed to (sound).
    input_dependent_jacobian: bool = False


FAMILIES: dict[str, OpFamily] = {}  # key -> family: what a NodeRecord's `family` names
MODULES: dict[type, OpFamily] = {}
FUNCTIONS: dict[Any, OpFamily] = {}
METHODS: dict[str, OpFamily] = {}
ATEN: dict[str, OpFamily] = {}


def register(
    key: str,
    handler: Callable[[OpFacts], Counting],
    *,
    shape=None,
    input_dependent_jacobian=False,
    modules=(),
    functions=(),
    methods=(),
    aten=(),
):
    """Declare one op family with every spelling it has in fx (modules, functions, methods) and export (aten)."""
    family = OpFamily(key, handler, shape, input_dependent_jacobian)
    FAMILIES[key] = family
    for module_type in modules:
        MODULES[module_type] = family
    for function in functions:
        FUNCTIONS[function] = family
    for method in methods:
        METHODS[method] = family
    for packet in aten:
        ATEN[packet] = family
    return family


def _ntuple(value, n: int) -> tuple:
    if isinstance(value, (tuple, list)):
        return tuple(value) if len(value) == n else tuple(value) * n if len(value) == 1 else tuple(value)
    return (value,) * n


# ---- layers -----------------------------------------------------------------------------------------


def _linear(f: OpFacts) -> Counting:
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
    padding = _ntuple(padding, n)
    if isinstance(padding, tuple) and len(padding) == 2 * n:  # F.pad-style (left, right) pairs
        padding = tuple(padding[2 * i] + padding[2 * i + 1] for i in range(n))
    else:
        padding = tuple(2 * p for p in padding)
    dilation = _ntuple(dilation, n)
    return all((k - 1) * d + 1 >= s + p for s, k, p, d in zip(in_spatial, kernel, padding, dilation))


def _conv(f: OpFacts) -> Counting:
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


def _conv_transpose(f: OpFacts) -> Counting:
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


def _resampler(f: OpFacts) -> Counting:
    """Pooling, upsampling, pixel shuffle: linear maps without weights, |W| = 0."""
    return Counting(Role.LAYER, frozen_params=f.frozen)


def _aten_conv_transpose(f: OpFacts) -> Counting:
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


def _transparent(f: OpFacts) -> Counting:
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen)


def _non_injective(f: OpFacts) -> Counting:
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen, non_injective=True)


def _slice(f: OpFacts) -> Counting:
    """Indexing a tensor: a strided or partial slice is a resampler; a full one keeps the count."""
    if not f.traced_inputs:
        return Counting(Role.TRANSPARENT, passes_unknowns=False)  # picking a tensor out of a tuple
    if f.output_numel == f.input_numel:
        return Counting(Role.TRANSPARENT)
    return Counting(Role.LAYER)


def _add(f: OpFacts) -> Counting:
    """A sum of two traced tensors is a merge; adding a constant or a parameter is a shift."""
    if len(f.traced_inputs) >= 2:
        return Counting(Role.ADD)
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen)


def _scale(f: OpFacts) -> Counting:
    """Multiplying by a constant keeps the count; the product of two activations (gating) is not modelled."""
    if len(f.traced_inputs) >= 2:
        return not_modelled(f, "product of two activations (gating or attention) is not modelled")
    return Counting(Role.TRANSPARENT, reported_params=f.trainable + f.frozen)


def _cat(f: OpFacts) -> Counting:
    return Counting(Role.CAT)


def not_modelled(f: OpFacts, why: str | None = None) -> Counting:
    """Spec §1: same numel -> transparent, otherwise a parameter-free layer; always a caveat."""
    params = f.trainable + f.frozen
    message = why or f"{f.op} is not modelled by the rank analysis"
    if params:
        message += f"; its {params} parameters are not counted"
    if f.traced_inputs and f.output_numel == f.input_numel:
        return Counting(
            Role.TRANSPARENT, reported_params=params, caveat=message + "; counted as transparent (same size in and out)"
        )
    return Counting(
        Role.LAYER, reported_params=params, caveat=message + "; counted as a parameter-free layer (size changes)"
    )


def _unmodelled(f: OpFacts) -> Counting:
    return not_modelled(f)


def _attention(f: OpFacts) -> Counting:
    """softmax(q kᵀ) v: the output is the data v mixed by weights that q and k only set."""
    counting = not_modelled(f, "attention (softmax(q kᵀ) v) is not modelled")
    return dataclasses.replace(counting, gates=(0, 1))


def _with_parameter_operand(f: OpFacts) -> tuple[torch.Tensor | None, int]:
    """The parameter among a product's operands (x @ W, addmm(b, x, W)), and its position among them."""
    operands = [a for a in f.args if isinstance(a, torch.Tensor)]
    for position, operand in enumerate(operands):
        if isinstance(operand, nn.Parameter) and operand.dim() == 2:
            return operand, position
    return None, -1


def _matmul(f: OpFacts) -> Counting:
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


def _reduction(f: OpFacts) -> Counting:
    """A mean or sum over some dimensions: a linear map without weights, like average pooling (|W| = 0)."""
    if f.traced_inputs and f.output_numel == f.input_numel:
        return Counting(Role.TRANSPARENT)
    return Counting(Role.LAYER, frozen_params=f.frozen)


# ---- shape rules ---------------------------------------------------------------------------------------


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


def same_shape(target, args, kwargs):
    first = args[0] if args else next(iter(kwargs.values()), None)
    return tuple(first.shape) if isinstance(first, torch.Tensor) else None


def broadcast_shape(target, args, kwargs):
    shapes = [tuple(a.shape) for a in args[:2] if isinstance(a, torch.Tensor)]
    if not shapes:
        return None
    rank = max(len(s) for s in shapes)
    padded = [(1,) * (rank - len(s)) + s for s in shapes]
    out = []
    for sizes in zip(*padded):
        distinct = {d for d in sizes if d != 1}
        if len(distinct) > 1:
            return None  # let the real op raise its own error
        out.append(distinct.pop() if distinct else 1)
    return tuple(out)


class ShapeMismatch(ValueError):
    """A shape rule found the input incompatible, as the op itself would have."""


def _require(condition: bool, message: str):
    if not condition:
        raise ShapeMismatch(message)


def _module(target) -> nn.Module | None:
    return target if isinstance(target, nn.Module) else None


def _linear_shape(target, args, kwargs):
    module = _module(target)
    weight = module.weight if module is not None else _arg(args, kwargs, 1, "weight")
    x = args[0]
    _require(
        x.dim() >= 1 and x.shape[-1] == weight.shape[1],
        f"Linear expects {weight.shape[1]} input features, got shape {tuple(x.shape)}",
    )
    return tuple(x.shape[:-1]) + (weight.shape[0],)


def _sliding_window(size, kernel, stride, padding, dilation, ceil_mode):
    span = size + 2 * padding - dilation * (kernel - 1) - 1
    out = (-(-span // stride) if ceil_mode else span // stride) + 1
    if ceil_mode and (out - 1) * stride >= size + padding:
        out -= 1  # the last window may not start inside the right padding
    return out


def _conv_shape(target, args, kwargs):
    x, module = args[0], _module(target)
    if module is not None:
        weight, stride, padding, dilation = module.weight, module.stride, module.padding, module.dilation
    else:
        weight = _arg(args, kwargs, 1, "weight")
        stride, padding = _arg(args, kwargs, 3, "stride", 1), _arg(args, kwargs, 4, "padding", 0)
        dilation = _arg(args, kwargs, 5, "dilation", 1)
    n = weight.dim() - 2
    groups = module.groups if module is not None else _arg(args, kwargs, 6, "groups", 1)
    _require(
        x.dim() in (n + 1, n + 2) and x.shape[-n - 1] == weight.shape[1] * groups,
        f"conv expects {weight.shape[1] * groups} input channels and {n} spatial dims, got shape {tuple(x.shape)}",
    )
    spatial = tuple(x.shape[-n:])
    if padding == "same":
        return tuple(x.shape[: -n - 1]) + (weight.shape[0],) + spatial
    if padding == "valid":
        padding = 0
    stride, padding, dilation = _ntuple(stride, n), _ntuple(padding, n), _ntuple(dilation, n)
    kernel = tuple(weight.shape[2:])
    out = tuple(
        _sliding_window(s, k, st, p, d, False) for s, k, st, p, d in zip(spatial, kernel, stride, padding, dilation)
    )
    _require(all(o > 0 for o in out), f"conv kernel {kernel} is larger than its padded input {spatial}")
    return tuple(x.shape[: -n - 1]) + (weight.shape[0],) + out


def _conv_transpose_shape(target, args, kwargs):
    module = _module(target)
    if module is None or len(args) > 1 or kwargs:
        return None  # an explicit output_size: run the op
    x, n = args[0], module.weight.dim() - 2
    spatial = tuple(x.shape[-n:])
    out = tuple(
        (s - 1) * st - 2 * p + d * (k - 1) + op + 1
        for s, k, st, p, d, op in zip(
            spatial, module.kernel_size, module.stride, module.padding, module.dilation, module.output_padding
        )
    )
    return tuple(x.shape[: -n - 1]) + (module.out_channels,) + out


_POOL_DIMS = {
    nn.AvgPool1d: 1,
    nn.AvgPool2d: 2,
    nn.AvgPool3d: 3,
    nn.MaxPool1d: 1,
    nn.MaxPool2d: 2,
    nn.MaxPool3d: 3,
    F.avg_pool1d: 1,
    F.avg_pool2d: 2,
    F.avg_pool3d: 3,
    F.max_pool1d: 1,
    F.max_pool2d: 2,
    F.max_pool3d: 3,
}


def _pool_shape(target, args, kwargs):
    x, module = args[0], _module(target)
    n = _POOL_DIMS.get(type(module) if module is not None else target)
    if n is None:
        return None
    if module is not None:
        kernel, stride, padding = module.kernel_size, module.stride, module.padding
        dilation, ceil_mode = getattr(module, "dilation", 1), module.ceil_mode
        returns_indices = getattr(module, "return_indices", False)
    else:
        is_max = target in (F.max_pool1d, F.max_pool2d, F.max_pool3d)
        kernel, stride = _arg(args, kwargs, 1, "kernel_size"), _arg(args, kwargs, 2, "stride")
        padding = _arg(args, kwargs, 3, "padding", 0)
        dilation = _arg(args, kwargs, 4, "dilation", 1) if is_max else 1
        ceil_mode = _arg(args, kwargs, 5 if is_max else 4, "ceil_mode", False)
        returns_indices = is_max and _arg(args, kwargs, 6, "return_indices", False)
    if returns_indices:
        return None
    kernel = _ntuple(kernel, n)
    stride = _ntuple(stride if stride not in (None, ()) else kernel, n)
    padding, dilation = _ntuple(padding, n), _ntuple(dilation, n)
    _require(x.dim() > n, f"pooling over {n} spatial dims needs more dims than shape {tuple(x.shape)}")
    out = tuple(
        _sliding_window(s, k, st, p, d, ceil_mode)
        for s, k, st, p, d in zip(x.shape[-n:], kernel, stride, padding, dilation)
    )
    _require(all(o > 0 for o in out), f"pooling window {kernel} is larger than its input {tuple(x.shape[-n:])}")
    return tuple(x.shape[:-n]) + out


_ADAPTIVE_DIMS = {
    nn.AdaptiveAvgPool1d: 1,
    nn.AdaptiveAvgPool2d: 2,
    nn.AdaptiveAvgPool3d: 3,
    nn.AdaptiveMaxPool1d: 1,
    nn.AdaptiveMaxPool2d: 2,
    nn.AdaptiveMaxPool3d: 3,
}


_ADAPTIVE_FUNCTION_DIMS = {F.adaptive_avg_pool1d: 1, F.adaptive_avg_pool2d: 2, F.adaptive_avg_pool3d: 3}


def _adaptive_shape(target, args, kwargs):
    x, module = args[0], _module(target)
    if module is not None:
        n, output_size = _ADAPTIVE_DIMS.get(type(module)), module.output_size
        if getattr(module, "return_indices", False):
            return None
    else:
        n, output_size = _ADAPTIVE_FUNCTION_DIMS.get(target), _arg(args, kwargs, 1, "output_size")
    if n is None:
        return None
    sizes = _ntuple(output_size, n)
    return tuple(x.shape[:-n]) + tuple(s if s is not None else d for s, d in zip(sizes, x.shape[-n:]))


def _upsample_shape(x, size, scale_factor):
    n = x.dim() - 2
    if size is not None:
        return tuple(x.shape[:2]) + _ntuple(size, n)
    if scale_factor is None:
        return None
    scales = _ntuple(scale_factor, n)
    return tuple(x.shape[:2]) + tuple(math.floor(d * float(s)) for d, s in zip(x.shape[2:], scales))


def _resampler_shape(target, args, kwargs):
    module = _module(target)
    if isinstance(module, (nn.PixelShuffle, nn.PixelUnshuffle)):
        x, r = args[0], (module.upscale_factor if isinstance(module, nn.PixelShuffle) else module.downscale_factor)
        c, h, w = x.shape[-3:]
        if isinstance(module, nn.PixelShuffle):
            return tuple(x.shape[:-3]) + (c // (r * r), h * r, w * r)
        return tuple(x.shape[:-3]) + (c * r * r, h // r, w // r)
    if isinstance(module, nn.Upsample):
        return _upsample_shape(args[0], module.size, module.scale_factor)
    if target in (F.interpolate, F.upsample):
        return _upsample_shape(args[0], _arg(args, kwargs, 1, "size"), _arg(args, kwargs, 2, "scale_factor"))
    if (type(module) if module is not None else target) in {**_ADAPTIVE_DIMS, **_ADAPTIVE_FUNCTION_DIMS}:
        return _adaptive_shape(target, args, kwargs)
    return _pool_shape(target, args, kwargs)


def _cat_shape(target, args, kwargs):
    tensors = _arg(args, kwargs, 0, "tensors")
    dim = _arg(args, kwargs, 1, "dim", 0)
    if not isinstance(tensors, (tuple, list)) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    first = tuple(tensors[0].shape)
    if any(t.dim() != len(first) for t in tensors):
        return None
    dim = dim % len(first)
    return first[:dim] + (sum(t.shape[dim] for t in tensors),) + first[dim + 1 :]


def _reduction_shape(target, args, kwargs):
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor):
        return None
    dims = _arg(args, kwargs, 1, "dim")
    keepdim = _arg(args, kwargs, 2, "keepdim", False)
    if dims is None or (isinstance(dims, (list, tuple)) and not dims):
        return (1,) * x.dim() if keepdim else ()
    if not isinstance(dims, (list, tuple)):
        dims = (dims,)
    if not all(isinstance(d, int) for d in dims):
        return None
    reduced = {d % x.dim() for d in dims} if x.dim() else set()
    return tuple(1 if i in reduced else size for i, size in enumerate(x.shape) if keepdim or i not in reduced)


# ---- the families -------------------------------------------------------------------------------------

register(
    "linear", _linear, shape=_linear_shape, modules=(nn.Linear, nn.LazyLinear), functions=(F.linear,), aten=("linear",)
)
register(
    "conv",
    _conv,
    shape=_conv_shape,
    modules=(nn.Conv1d, nn.Conv2d, nn.Conv3d),
    functions=(F.conv1d, F.conv2d, F.conv3d, torch.conv1d, torch.conv2d, torch.conv3d),
    aten=("conv1d", "conv2d", "conv3d"),
)
register(
    "conv_transpose",
    _conv_transpose,
    shape=_conv_transpose_shape,
    modules=(nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d),
    functions=(F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d),
)
register("aten_conv_transpose", _aten_conv_transpose, aten=("conv_transpose1d", "conv_transpose2d", "conv_transpose3d"))
register(
    "convolution",
    lambda f: _aten_conv_transpose(f) if f.arg(6, "transposed", False) else _conv(f),
    aten=("convolution", "_convolution"),
)
register(
    "resampler",
    _resampler,
    shape=_resampler_shape,
    modules=(
        nn.AvgPool1d,
        nn.AvgPool2d,
        nn.AvgPool3d,
        nn.MaxPool1d,
        nn.MaxPool2d,
        nn.MaxPool3d,
        nn.AdaptiveAvgPool1d,
        nn.AdaptiveAvgPool2d,
        nn.AdaptiveAvgPool3d,
        nn.AdaptiveMaxPool1d,
        nn.AdaptiveMaxPool2d,
        nn.AdaptiveMaxPool3d,
        nn.LPPool1d,
        nn.LPPool2d,
        nn.Upsample,
        nn.UpsamplingNearest2d,
        nn.UpsamplingBilinear2d,
        nn.PixelShuffle,
        nn.PixelUnshuffle,
    ),
    functions=(
        F.avg_pool1d,
        F.avg_pool2d,
        F.avg_pool3d,
        F.max_pool1d,
        F.max_pool2d,
        F.max_pool3d,
        F.adaptive_avg_pool1d,
        F.adaptive_avg_pool2d,
        F.adaptive_avg_pool3d,
        F.adaptive_max_pool1d,
        F.adaptive_max_pool2d,
        F.adaptive_max_pool3d,
        F.interpolate,
        F.upsample,
        F.pixel_shuffle,
        F.pixel_unshuffle,
        torch.avg_pool1d,
        torch.max_pool1d,
        torch.max_pool2d,
        torch.max_pool3d,
        torch.pixel_shuffle,
        torch.pixel_unshuffle,
    ),
    aten=(
        "avg_pool1d",
        "avg_pool2d",
        "avg_pool3d",
        "max_pool1d",
        "max_pool2d",
        "max_pool3d",
        "max_pool2d_with_indices",
        "max_pool3d_with_indices",
        "adaptive_avg_pool1d",
        "adaptive_avg_pool2d",
        "adaptive_avg_pool3d",
        "_adaptive_avg_pool2d",
        "adaptive_max_pool1d",
        "adaptive_max_pool2d",
        "adaptive_max_pool3d",
        "upsample_nearest1d",
        "upsample_nearest2d",
        "upsample_nearest3d",
        "upsample_bilinear2d",
        "upsample_linear1d",
        "upsample_bicubic2d",
        "upsample_trilinear3d",
        "pixel_shuffle",
        "pixel_unshuffle",
    ),
)
register(
    "slice",
    _slice,
    functions=(operator.getitem,),
    methods=("narrow",),
    aten=("slice", "select", "narrow", "index", "getitem"),
)
register(
    "reshape",
    _transparent,
    modules=(
        nn.Flatten,
        nn.Unflatten,
        nn.Identity,
        nn.Dropout,
        nn.Dropout1d,
        nn.Dropout2d,
        nn.Dropout3d,
        nn.AlphaDropout,
        nn.FeatureAlphaDropout,
        nn.ZeroPad1d,
        nn.ZeroPad2d,
        nn.ZeroPad3d,
        nn.ConstantPad1d,
        nn.ConstantPad2d,
        nn.ConstantPad3d,
    ),
    functions=(
        torch.flatten,
        torch.reshape,
        torch.permute,
        torch.transpose,
        torch.squeeze,
        torch.unsqueeze,
        torch.t,
        torch.movedim,
        F.dropout,
        F.dropout1d,
        F.dropout2d,
        F.dropout3d,
        F.alpha_dropout,
        F.pad,
        torch.clone,
    ),
    methods=(
        "view",
        "reshape",
        "flatten",
        "permute",
        "transpose",
        "contiguous",
        "squeeze",
        "unsqueeze",
        "t",
        "movedim",
        "view_as",
        "reshape_as",
        "clone",
        "float",
        "double",
        "half",
        "bfloat16",
        "to",
        "type",
        "type_as",
        "unflatten",
    ),
    aten=(
        "view",
        "_unsafe_view",
        "reshape",
        "flatten",
        "unflatten",
        "permute",
        "transpose",
        "t",
        "squeeze",
        "unsqueeze",
        "contiguous",
        "clone",
        "dropout",
        "alias",
        "_to_copy",
        "to",
        "constant_pad_nd",
        "pad",
        "movedim",
        "lift_fresh_copy",
        "detach",
    ),
)
register(
    "monotonic",
    _transparent,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(nn.LeakyReLU, nn.PReLU, nn.ELU, nn.Sigmoid, nn.Tanh, nn.Softplus),
    functions=(F.leaky_relu, F.elu, F.softplus, torch.sigmoid, torch.tanh, F.sigmoid, F.tanh, F.prelu, torch.prelu),
    methods=("sigmoid", "tanh", "sigmoid_", "tanh_"),
    aten=(
        "leaky_relu",
        "leaky_relu_",
        "elu",
        "elu_",
        "softplus",
        "sigmoid",
        "sigmoid_",
        "tanh",
        "tanh_",
        "prelu",
        "_prelu_kernel",
    ),
)
# Hardsigmoid = relu6(x + 3) / 6: a clamp, piecewise linear (MobileNetV3's and LCNet's squeeze-excitation gate).
register(
    "relu_family",
    _non_injective,
    shape=same_shape,
    modules=(nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Hardsigmoid),
    functions=(F.relu, torch.relu, F.relu6, F.hardtanh, F.relu_, torch.relu_, torch.clamp, torch.clip, F.hardsigmoid),
    methods=("relu", "relu_", "clamp", "clamp_", "clip"),
    aten=(
        "relu",
        "relu_",
        "relu6",
        "hardtanh",
        "hardtanh_",
        "clamp",
        "clamp_",
        "clamp_min",
        "clip",
        "hardsigmoid",
        "hardsigmoid_",
    ),
)
register(
    "norm",
    _transparent,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(
        nn.BatchNorm1d,
        nn.BatchNorm2d,
        nn.BatchNorm3d,
        nn.SyncBatchNorm,
        nn.InstanceNorm1d,
        nn.InstanceNorm2d,
        nn.InstanceNorm3d,
        nn.GroupNorm,
    ),
    functions=(F.batch_norm, F.instance_norm, F.group_norm),
    aten=(
        "batch_norm",
        "_native_batch_norm_legit_no_training",
        "_native_batch_norm_legit",
        "native_batch_norm",
        "_batch_norm_with_update",
        "_batch_norm_no_update",
        "instance_norm",
        "group_norm",
        "native_group_norm",
    ),
)
register(
    "add",
    _add,
    shape=broadcast_shape,
    functions=(operator.add, operator.iadd, operator.sub, operator.isub, torch.add, torch.sub),
    methods=("add", "add_", "sub", "sub_"),
    aten=("add", "add_", "sub", "sub_"),
)
register(
    "scale",
    _scale,
    shape=broadcast_shape,
    functions=(
        operator.mul,
        operator.imul,
        operator.truediv,
        operator.itruediv,
        operator.neg,
        torch.mul,
        torch.div,
        torch.neg,
    ),
    methods=("mul", "mul_", "div", "div_", "neg"),
    aten=("mul", "mul_", "div", "div_", "neg"),
)
register("cat", _cat, shape=_cat_shape, functions=(torch.cat, torch.concat, torch.concatenate), aten=("cat", "concat"))
register("stack", _cat, functions=(torch.stack,), aten=("stack",))
register(
    "attention",
    _attention,
    shape=lambda target, args, kwargs: tuple(args[0].shape[:-1]) + (args[2].shape[-1],),
    input_dependent_jacobian=True,
    functions=(F.scaled_dot_product_attention,),
    aten=(
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention",
    ),
)

register(
    "embedding",
    _unmodelled,
    input_dependent_jacobian=False,
    modules=(nn.Embedding, nn.EmbeddingBag),
    functions=(F.embedding, F.embedding_bag),
    aten=("embedding", "embedding_bag", "_embedding_bag"),
)
register(
    "layer_norm",
    _unmodelled,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(nn.LayerNorm, nn.LocalResponseNorm, *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ())),
    functions=(
        F.layer_norm,
        torch.layer_norm,
        F.local_response_norm,
        *((F.rms_norm,) if hasattr(F, "rms_norm") else ()),
    ),
    aten=("layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"),
)
register(
    "smooth_activation",
    _unmodelled,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(
        nn.GELU,
        nn.SiLU,
        nn.Mish,
        nn.Hardswish,
        nn.Softmax,
        nn.LogSoftmax,
        nn.Softmin,
        nn.Softmax2d,
        nn.Tanhshrink,
        nn.Softshrink,
        nn.Hardshrink,
    ),
    functions=(
        F.gelu,
        F.silu,
        F.mish,
        F.hardswish,
        F.softmax,
        F.log_softmax,
        F.softmin,
        torch.softmax,
        torch.log_softmax,
        F.tanhshrink,
    ),
    methods=("softmax", "log_softmax"),
    aten=(
        "gelu",
        "gelu_",
        "silu",
        "silu_",
        "mish",
        "mish_",
        "hardswish",
        "hardswish_",
        "_softmax",
        "softmax",
        "_log_softmax",
        "log_softmax",
        "_safe_softmax",
    ),
)
register(
    "monotonic_smooth",
    _transparent,
    shape=same_shape,
    input_dependent_jacobian=True,
    modules=(nn.SELU, nn.CELU, nn.Softsign, nn.LogSigmoid),
    functions=(F.selu, F.celu, F.softsign, F.logsigmoid),
    aten=("selu", "selu_", "celu", "celu_", "log_sigmoid_forward"),
)
register(
    "matmul",
    _matmul,
    input_dependent_jacobian=True,
    functions=(torch.matmul, operator.matmul, torch.bmm, torch.mm, torch.einsum, torch.baddbmm),
    methods=("matmul", "bmm", "mm", "__matmul__"),
    aten=("matmul", "bmm", "mm", "einsum", "baddbmm"),
)
register("addmm", _matmul, functions=(torch.addmm,), methods=("addmm",), aten=("addmm",))
# x @ W with a parameter W: the matmul family's calls that turn out to be Linear layers (constant Jacobian).
register("matmul_param", _matmul)
# Copies of entries (broadcast, repeat_kv in grouped-query attention): no new unknowns, a constant Jacobian.
register(
    "replicate",
    _transparent,
    functions=(torch.broadcast_to, torch.tile, torch.repeat_interleave),
    methods=("expand", "expand_as", "repeat", "repeat_interleave", "tile", "broadcast_to"),
    aten=("expand", "expand_as", "repeat", "repeat_interleave", "tile", "broadcast_to"),
)
# Several views of one tensor; each piece picked from the tuple is a row-free view too.
register(
    "split",
    _transparent,
    functions=(torch.split, torch.chunk, torch.unbind, torch.tensor_split),
    methods=("split", "chunk", "unbind", "tensor_split"),
    aten=("split", "split_with_sizes", "chunk", "unbind", "tensor_split"),
)
register(
    "reduction",
    _reduction,
    shape=_reduction_shape,
    functions=(torch.mean, torch.sum),
    methods=("mean", "sum"),
    aten=("mean", "sum"),
)

UNMODELLED = OpFamily("not_modelled", _unmodelled, input_dependent_jacobian=True)
FAMILIES[UNMODELLED.key] = UNMODELLED


def family_of(kind: str, target: Any) -> OpFamily:
    """The family for a call: kind is "module" (target: the module), "function", "method" or "aten"."""
    if kind == "module":
        family = MODULES.get(type(target))
        if family is None:
            # A subclass of a registered module (timm's LayerNorm2d), else another library's norm or activation.
            family = next((MODULES[base] for base in type(target).__mro__[1:] if base in MODULES), None)
        if family is None:
            family = {"norm": FAMILIES["layer_norm"], "activation": FAMILIES["smooth_activation"]}.get(
                atomic_kind(target), UNMODELLED
            )
        return family
    if kind == "function":
        return FUNCTIONS.get(target, UNMODELLED)
    if kind == "method":
        return METHODS.get(target, UNMODELLED)
    if kind == "aten":
        return ATEN.get(target, UNMODELLED)
    return UNMODELLED


_ACTIVATION_SUFFIXES = ("activation", "gelu", "silu", "swish", "mish", "quickgelu")


def atomic_kind(module: nn.Module) -> str | None:
    """'norm' or 'activation' for another library's normalisation or activation module (LlamaRMSNorm,
    T5LayerNorm, NewGELUActivation), told by its class name: a module without submodules whose name ends in
    Norm, or a parameter-free one whose name ends in Activation, GELU, SiLU, Swish or Mish. The tracer treats
    it as one op: its pow/mean/rsqrt inside are the norm, not layers of their own."""
    if type(module).__module__.startswith("torch.nn.") or next(module.children(), None) is not None:
        return None
    name = type(module).__name__.lower()
    if name.endswith("norm"):
        return "norm"
    if name.endswith(_ACTIVATION_SUFFIXES) and next(module.parameters(), None) is None:
        return "activation"
    return None


def refine_family(family: OpFamily, counting: Counting) -> OpFamily:
    """A product that turned out to read a weight matrix (x @ W) is a Linear: its Jacobian does not depend on x."""
    reads_weights = counting.role is Role.LAYER and (counting.weights or counting.frozen_params)
    if family.key in ("matmul", "addmm") and reads_weights:
        return FAMILIES["matmul_param"]
    if family.key == "addmm":
        return FAMILIES["matmul"]
    return family
