"""R-GAP: recover one training input from its gradients in closed form, layer by layer (Zhu & Blaschko, ICLR 2021)."""

from __future__ import annotations

import copy
import math
import operator
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from rankaudit.verify import AttackUnsupported, finite

__all__ = [
    "RGapUnsupported",
    "Step",
    "LayerSolve",
    "Reconstruction",
    "RGapResult",
    "extract_chain",
    "chain_forward",
    "client_gradients",
    "reconstruct",
    "numerical_rank",
    "run_rgap",
]

LOSSES = ("logistic", "cross-entropy")

# Beyond these sizes the dense per-layer matrices (the weight block, and V of G's SVD, HW x HW) stop
# fitting comfortably in memory; R-GAP is meant for the small networks of the paper, so we refuse
# (the caller falls back to an optimisation attack) instead of thrashing.
_MAX_DENSE_ENTRIES = 80_000_000
_MAX_SPATIAL = 4_096


class RGapUnsupported(AttackUnsupported):
    """The model is outside what R-GAP can invert; the caller falls back to an optimisation attack."""


@dataclass(frozen=True)
class Step:
    """One link of the chain; shapes are per sample. Linear and Conv1d are solved in Conv2d geometry."""

    kind: str  # "linear" | "conv" | "act" | "reshape" ("pad" only transiently, merged into the next conv)
    name: str
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    weight: str | None = None
    bias: str | None = None
    stride: tuple[int, int] = (1, 1)
    dilation: tuple[int, int] = (1, 1)
    padding: tuple[int, int, int, int] = (0, 0, 0, 0)  # top, bottom, left, right
    act: str | None = None  # "leaky_relu" | "sigmoid" | "tanh" | "identity"
    slope: float = 0.0

    @property
    def is_layer(self) -> bool:
        return self.kind in ("linear", "conv")


@dataclass
class LayerSolve:
    """What solving A_i x_i = b_i told us about one layer."""

    name: str
    unknowns: int  # |x_i| counting zero-padding entries, as the spec does
    rank: int
    local_deficit: int  # unknowns - rank
    residual: float  # max of the relative residuals of weight and gradient constraints (nan: not solved)
    condition: float  # larger of the two solve stages' condition numbers (see _solve_layer); nan: unknown


@dataclass
class Reconstruction:
    """Result of one R-GAP run on one gradient."""

    x: torch.Tensor
    layers: list[LayerSolve]
    notes: list[str]
    label: int | None
    alternatives: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RGapResult:
    """R-GAP over a set of images: per-sample quality and timing, and the first sample's layer table."""

    reconstructions: torch.Tensor
    mse: list[float]
    psnr: list[float]
    seconds: list[float]
    median_mse: float
    median_psnr: float
    median_seconds: float
    layers: list[LayerSolve]
    notes: list[str]
    device: str
    labels: list[int]
    recovered_labels: list[int | None]


# --------------------------------------------------------------------------- chain extraction

_NOT_INJECTIVE = (nn.ReLU, nn.ReLU6, nn.Hardtanh, nn.Hardsigmoid, nn.Hardswish, nn.Threshold)
_NORMS = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.LayerNorm,
    nn.LocalResponseNorm,
)
_POOLS = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
)
_SUPPORTED = (
    "supported: Linear, Conv1d/Conv2d (groups=1, zero padding), LeakyReLU, Sigmoid, Tanh, "
    "Identity, flatten/reshape/view, zero padding before a conv"
)
_RESHAPE_METHODS = {"view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze"}
_SHAPE_QUERIES = {"size", "dim", "numel"}
_MERGE_NAMES = {
    operator.add: "residual add",
    operator.iadd: "residual add",
    torch.add: "residual add",
    operator.sub: "subtraction",
    torch.sub: "subtraction",
    operator.mul: "product",
    torch.mul: "product",
    operator.matmul: "matmul",
    torch.matmul: "matmul",
    torch.cat: "concatenation",
    torch.stack: "stack",
}


def _module_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack")
    if stack:
        return list(stack.keys())[-1]
    return node.name


def _not_injective(name: str, what: str) -> RGapUnsupported:
    return RGapUnsupported(name, f"{what} is not injective: R-GAP cannot invert it")


def _pair(v) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))


def _conv_padding(padding, kernel: tuple[int, int], dilation: tuple[int, int]) -> tuple[int, int, int, int]:
    if isinstance(padding, str):
        if padding == "valid":
            return (0, 0, 0, 0)
        # PyTorch's 'same' puts the odd extra pixel at the bottom/right.
        tot = [d * (k - 1) for d, k in zip(dilation, kernel)]
        return (tot[0] // 2, tot[0] - tot[0] // 2, tot[1] // 2, tot[1] - tot[1] // 2)
    ph, pw = _pair(padding)
    return (ph, ph, pw, pw)


def _conv_step(
    name, dims, weight_name, bias_name, w_shape, stride, padding, dilation, groups, in_shape, out_shape
) -> Step:
    if groups != 1:
        raise RGapUnsupported(name, f"grouped convolution (groups={groups}) is not supported by this R-GAP")
    if dims == 1:
        stride, dilation = (1, int(_first(stride))), (1, int(_first(dilation)))
        if isinstance(padding, str):
            pad = _conv_padding(padding, (1, w_shape[-1]), dilation)
        else:
            p = int(_first(padding))
            pad = (0, 0, p, p)
    else:
        stride, dilation = _pair(stride), _pair(dilation)
        pad = _conv_padding(padding, (w_shape[-2], w_shape[-1]), dilation)
    return Step(
        "conv",
        name,
        in_shape,
        out_shape,
        weight=weight_name,
        bias=bias_name,
        stride=stride,
        dilation=dilation,
        padding=pad,
    )


def _first(v):
    return v[0] if isinstance(v, (tuple, list)) else v


def _module_step(node, mod: nn.Module, in_shape, out_shape) -> Step:
    name = str(node.target)
    if isinstance(mod, nn.Linear):
        if len(in_shape) != 1:
            raise RGapUnsupported(
                name, f"Linear applied over several positions (input {in_shape}) is not supported by this R-GAP"
            )
        return Step(
            "linear",
            name,
            in_shape,
            out_shape,
            weight=f"{name}.weight",
            bias=f"{name}.bias" if mod.bias is not None else None,
        )
    if isinstance(mod, (nn.Conv1d, nn.Conv2d)):
        if mod.padding_mode != "zeros":
            raise RGapUnsupported(name, f"padding_mode={mod.padding_mode!r}: only zero padding is supported")
        dims = 1 if isinstance(mod, nn.Conv1d) else 2
        return _conv_step(
            name,
            dims,
            f"{name}.weight",
            f"{name}.bias" if mod.bias is not None else None,
            tuple(mod.weight.shape),
            mod.stride,
            mod.padding,
            mod.dilation,
            mod.groups,
            in_shape,
            out_shape,
        )
    if isinstance(mod, nn.LeakyReLU):
        if mod.negative_slope <= 0:
            raise _not_injective(name, f"LeakyReLU with negative_slope={mod.negative_slope}")
        return Step("act", name, in_shape, out_shape, act="leaky_relu", slope=float(mod.negative_slope))
    if isinstance(mod, nn.Sigmoid):
        return Step("act", name, in_shape, out_shape, act="sigmoid")
    if isinstance(mod, nn.Tanh):
        return Step("act", name, in_shape, out_shape, act="tanh")
    if isinstance(mod, nn.Identity) or (isinstance(mod, nn.Dropout) and mod.p == 0):
        return Step("act", name, in_shape, out_shape, act="identity")
    if isinstance(mod, nn.Dropout):
        raise RGapUnsupported(name, f"Dropout(p={mod.p}) makes the client's forward random; R-GAP needs p=0")
    if isinstance(mod, (nn.Flatten, nn.Unflatten)):
        return Step("reshape", name, in_shape, out_shape)
    if isinstance(mod, (nn.ZeroPad2d, nn.ZeroPad1d, nn.ConstantPad1d, nn.ConstantPad2d)):
        if getattr(mod, "value", 0.0) != 0.0:
            raise RGapUnsupported(name, f"constant padding with value {mod.value}: only zero padding is supported")
        return _pad_step(name, mod.padding, in_shape, out_shape)
    if isinstance(mod, _NOT_INJECTIVE):
        raise _not_injective(name, type(mod).__name__)
    if isinstance(mod, _NORMS):
        raise RGapUnsupported(
            name,
            f"{type(mod).__name__} is not supported: R-GAP inverts chains of "
            "Linear/Conv layers and invertible activations only",
        )
    if isinstance(mod, _POOLS):
        raise RGapUnsupported(name, f"{type(mod).__name__}: R-GAP has no inverse for pooling")
    raise RGapUnsupported(name, f"{type(mod).__name__} is not supported by R-GAP ({_SUPPORTED})")


def _pad_step(name, pad, in_shape, out_shape) -> Step:
    pad = tuple(int(p) for p in (pad if isinstance(pad, (tuple, list)) else (pad,) * (2 * (len(in_shape) - 1))))
    if any(p < 0 for p in pad):
        raise RGapUnsupported(name, "negative padding (cropping) is not supported by R-GAP")
    if len(pad) == 2:
        left, right, top, bottom = pad[0], pad[1], 0, 0
    elif len(pad) == 4:
        left, right, top, bottom = pad
    else:
        raise RGapUnsupported(name, "padding of more than the two spatial dimensions is not supported")
    return Step("pad", name, in_shape, out_shape, padding=(top, bottom, left, right))


def _get_attr_name(node, arg, what: str) -> str | None:
    if arg is None:
        return None
    if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
        return str(arg.target)
    raise RGapUnsupported(node.name, f"{what} of a functional layer must be a model parameter")


def _function_step(node, in_shape, out_shape) -> Step:
    fn, args, kw = node.target, node.args, node.kwargs
    name = node.name
    where = _module_path(node)

    def arg(i, key, default=None):
        if len(args) > i:
            return args[i]
        return kw.get(key, default)

    if fn is F.linear:
        if len(in_shape) != 1:
            raise RGapUnsupported(name, "Linear applied over several positions is not supported by this R-GAP")
        return Step(
            "linear",
            name,
            in_shape,
            out_shape,
            weight=_get_attr_name(node, arg(1, "weight"), "weight"),
            bias=_get_attr_name(node, arg(2, "bias"), "bias"),
        )
    if fn in (F.conv1d, F.conv2d):
        w = _get_attr_name(node, arg(1, "weight"), "weight")
        wnode = arg(1, "weight")
        w_shape = tuple(wnode.meta["tensor_meta"].shape) if "tensor_meta" in wnode.meta else None
        if w_shape is None:
            raise RGapUnsupported(name, "cannot read the convolution's weight shape")
        dims = 1 if fn is F.conv1d else 2
        return _conv_step(
            name,
            dims,
            w,
            _get_attr_name(node, arg(2, "bias"), "bias"),
            w_shape,
            arg(3, "stride", 1),
            arg(4, "padding", 0),
            arg(5, "dilation", 1),
            arg(6, "groups", 1),
            in_shape,
            out_shape,
        )
    if fn is F.leaky_relu:
        slope = float(arg(1, "negative_slope", 0.01))
        if slope <= 0:
            raise _not_injective(where, f"leaky_relu with negative_slope={slope}")
        return Step("act", name, in_shape, out_shape, act="leaky_relu", slope=slope)
    if fn in (torch.sigmoid, F.sigmoid):
        return Step("act", name, in_shape, out_shape, act="sigmoid")
    if fn in (torch.tanh, F.tanh):
        return Step("act", name, in_shape, out_shape, act="tanh")
    if fn in (torch.flatten, torch.reshape, torch.squeeze, torch.unsqueeze):
        return Step("reshape", name, in_shape, out_shape)
    if fn is F.pad:
        mode = arg(2, "mode", "constant")
        value = arg(3, "value", None)
        if mode != "constant" or (value not in (None, 0, 0.0)):
            raise RGapUnsupported(where, f"F.pad with mode={mode!r}, value={value!r}: only zero padding is supported")
        return _pad_step(name, arg(1, "pad"), in_shape, out_shape)
    if fn in (F.relu, torch.relu, F.relu6, F.hardtanh):
        raise _not_injective(where, "ReLU")
    if fn is F.dropout and float(arg(1, "p", 0.5)) == 0.0:
        return Step("act", name, in_shape, out_shape, act="identity")
    if fn is operator.getitem:
        raise RGapUnsupported(where, "slicing/indexing a tensor is not supported by R-GAP")
    fname = getattr(fn, "__name__", str(fn))
    raise RGapUnsupported(where, f"function {fname} is not supported by R-GAP ({_SUPPORTED})")


def _method_step(node, in_shape, out_shape) -> Step:
    m = node.target
    where = _module_path(node)
    if m in _RESHAPE_METHODS:
        return Step("reshape", node.name, in_shape, out_shape)
    if m in ("sigmoid",):
        return Step("act", node.name, in_shape, out_shape, act="sigmoid")
    if m in ("tanh",):
        return Step("act", node.name, in_shape, out_shape, act="tanh")
    if m in ("relu", "relu_"):
        raise _not_injective(where, "ReLU")
    raise RGapUnsupported(where, f"tensor method .{m}() is not supported by R-GAP ({_SUPPORTED})")


def _is_tensor_node(node) -> bool:
    return isinstance(node.meta.get("tensor_meta"), TensorMetadata)


def extract_chain(model: nn.Module, input_shape: tuple) -> list[Step]:
    """Trace `model` with torch.fx and return its linear chain of steps, or raise RGapUnsupported."""
    input_shape = tuple(int(s) for s in input_shape)
    try:
        gm = torch.fx.symbolic_trace(model)
    except Exception as exc:  # fx raises many types for dynamic control flow
        reason = f"torch.fx cannot trace the model ({type(exc).__name__}): R-GAP needs a static chain"
        raise RGapUnsupported(type(model).__name__, reason) from exc
    try:
        p = next(iter(model.parameters()))
        dtype, device = p.dtype, p.device
    except StopIteration:
        dtype, device = torch.float32, torch.device("cpu")
    # A batch of 2 exposes reshapes that would mix samples (their first dim would not stay 2).
    batch = 2
    try:
        with torch.no_grad():
            ShapeProp(gm).propagate(torch.zeros((batch,) + input_shape, dtype=dtype, device=device))
    except Exception as exc:
        root = exc
        while root.__cause__ is not None:
            root = root.__cause__
        first = str(root).splitlines()[0] if str(root) else type(root).__name__
        raise RGapUnsupported(type(model).__name__, f"the model does not run on input {input_shape}: {first}") from exc

    nodes = list(gm.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != 1:
        raise RGapUnsupported(type(model).__name__, "R-GAP needs a model with exactly one input")
    data = {placeholders[0]}
    for n in nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        inputs = [a for a in n.all_input_nodes if a in data]
        if not inputs:
            continue
        if not _is_tensor_node(n):
            if (n.op == "call_method" and n.target in _SHAPE_QUERIES) or (
                n.op == "call_function" and n.target in (getattr, operator.getitem, len)
            ):
                continue  # only reads the shape, not the values
            raise RGapUnsupported(_module_path(n), f"{n.op} {n.target} produces a non-tensor from the data")
        data.add(n)
        tensor_inputs = [a for a in inputs if _is_tensor_node(a) or a.op == "placeholder"]
        if len(tensor_inputs) >= 2:
            what = _MERGE_NAMES.get(n.target, f"{getattr(n.target, '__name__', n.target)} of two tensors")
            where = _module_path(n)
            raise RGapUnsupported(where, f"{what} at {where}: R-GAP handles chains only")

    steps: list[Step] = []
    for n in nodes:
        if n not in data or n.op == "placeholder":
            continue
        src = [a for a in n.all_input_nodes if a in data][0]
        if n.op == "output":
            continue
        in_meta, out_meta = src.meta["tensor_meta"], n.meta["tensor_meta"]
        if in_meta.shape[0] != batch or out_meta.shape[0] != batch:
            raise RGapUnsupported(_module_path(n), "a reshape mixes the batch dimension")
        in_shape, out_shape = tuple(in_meta.shape[1:]), tuple(out_meta.shape[1:])
        if n.op == "call_module":
            steps.append(_module_step(n, gm.get_submodule(n.target), in_shape, out_shape))
        elif n.op == "call_function":
            steps.append(_function_step(n, in_shape, out_shape))
        elif n.op == "call_method":
            steps.append(_method_step(n, in_shape, out_shape))
        else:
            raise RGapUnsupported(n.name, f"graph op {n.op} is not supported")

    for n in data:
        users = [u for u in n.users if u in data or u.op == "output"]
        if len(users) > 1:
            raise RGapUnsupported(
                _module_path(n),
                f"branch at {_module_path(n)}: its output feeds {len(users)} ops; R-GAP handles chains only",
            )
    out_node = [n for n in nodes if n.op == "output"][0]
    if not isinstance(out_node.args[0], torch.fx.Node):
        raise RGapUnsupported(type(model).__name__, "the model must return a single tensor")

    steps = _merge_padding(steps)
    layers = [s for s in steps if s.is_layer]
    if not layers:
        raise RGapUnsupported(type(model).__name__, "the model has no Linear or Conv layer")
    seen: dict[str, str] = {}
    for s in layers:
        if s.weight in seen:
            # The shared gradient would then be a sum over both uses, which Algorithm 1 does not model.
            raise RGapUnsupported(
                s.name,
                f"weight {s.weight} is used by two layers ({seen[s.weight]} and {s.name}): "
                "R-GAP needs each layer's parameters used once",
            )
        seen[s.weight] = s.name
    top = max(i for i, s in enumerate(steps) if s.is_layer)
    if steps[top].kind != "linear":
        raise RGapUnsupported(steps[top].name, "the output layer must be a Linear layer")
    for s in steps[top + 1 :]:
        if not (s.kind == "reshape" or (s.kind == "act" and s.act == "identity")):
            raise RGapUnsupported(
                s.name,
                "an activation after the output layer is not supported: the model's "
                "output must be the logit(s) the loss is applied to",
            )
    return steps


def _merge_padding(steps: list[Step]) -> list[Step]:
    out: list[Step] = []
    pending: Step | None = None
    for s in steps:
        if s.kind == "pad":
            if pending is None:
                pending = s
            else:
                pending = replace(
                    pending, out_shape=s.out_shape, padding=tuple(a + b for a, b in zip(pending.padding, s.padding))
                )
            continue
        if pending is not None:
            if s.kind != "conv":
                raise RGapUnsupported(
                    pending.name,
                    "zero padding that is not directly followed by a convolution is not supported by R-GAP",
                )
            s = replace(s, in_shape=pending.in_shape, padding=tuple(a + b for a, b in zip(s.padding, pending.padding)))
            pending = None
        out.append(s)
    if pending is not None:
        raise RGapUnsupported(pending.name, "zero padding at the end of the model is not supported")
    return out


# --------------------------------------------------------------------------- chain arithmetic


def _kernel4(step: Step, weights: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    w = weights[step.weight]
    if step.kind == "linear":
        w4 = w.reshape(w.shape[0], w.shape[1], 1, 1)
    elif w.dim() == 3:
        w4 = w.unsqueeze(2)
    else:
        w4 = w
    b = weights[step.bias] if step.bias else None
    return w4, b


def _as_image(step: Step, x: torch.Tensor) -> torch.Tensor:
    """Per-sample input of a layer as (C, H, W)."""
    if step.kind == "linear":
        return x.reshape(-1, 1, 1)
    if len(step.in_shape) == 2:
        return x.reshape(step.in_shape[0], 1, step.in_shape[1])
    return x.reshape(step.in_shape)


def _layer_forward(step: Step, w4, b, x: torch.Tensor) -> torch.Tensor:
    top, bottom, left, right = step.padding
    xp = F.pad(_as_image(step, x)[None], (left, right, top, bottom))
    z = F.conv2d(xp, w4, b, stride=step.stride, dilation=step.dilation)[0]
    return z.reshape(step.out_shape)


def _layer_backward(step: Step, w4, g_out: torch.Tensor) -> torch.Tensor:
    """dL/d(input) of a layer from dL/d(output): W^T applied to g, padding cropped."""
    c, h, w = _as_image(step, torch.empty(step.in_shape, device="meta")).shape
    top, bottom, left, right = step.padding
    o = w4.shape[0]
    g = g_out.reshape(o, -1)
    ho = (h + top + bottom - step.dilation[0] * (w4.shape[2] - 1) - 1) // step.stride[0] + 1
    g = g.reshape(1, o, ho, -1)
    gp = torch.nn.grad.conv2d_input(
        (1, c, h + top + bottom, w + left + right), w4, g, stride=step.stride, dilation=step.dilation
    )
    return gp[0, :, top : top + h, left : left + w].reshape(step.in_shape)


def _act_forward(step: Step, x):
    if step.act == "leaky_relu":
        return F.leaky_relu(x, step.slope)
    if step.act == "sigmoid":
        return torch.sigmoid(x)
    if step.act == "tanh":
        return torch.tanh(x)
    return x


def _act_inverse(step: Step, y):
    """Pre-activation from post-activation, and the activation's derivative there."""
    if step.act == "leaky_relu":
        pos = y > 0
        return torch.where(pos, y, y / step.slope), torch.where(pos, torch.ones_like(y), torch.full_like(y, step.slope))
    if step.act == "sigmoid":
        # Reconstruction noise can push values onto/over the asymptotes; clamp to stay finite.
        eps = torch.finfo(y.dtype).eps
        yc = y.clamp(eps, 1 - eps)
        return torch.log(yc) - torch.log1p(-yc), yc * (1 - yc)
    if step.act == "tanh":
        eps = torch.finfo(y.dtype).eps
        yc = y.clamp(-1 + eps, 1 - eps)
        return torch.atanh(yc), 1 - yc * yc
    return y, torch.ones_like(y)


def _act_range_ok(step: Step, y) -> bool:
    if step.act == "sigmoid":
        return bool(((y > 0) & (y < 1)).all())
    if step.act == "tanh":
        return bool((y.abs() < 1).all())
    return True


def chain_forward(chain: list[Step], weights: dict, x: torch.Tensor) -> list[torch.Tensor]:
    """Run one sample through the chain; returns the tensor after every step (index i = output of step i)."""
    outs = []
    for s in chain:
        if s.is_layer:
            w4, b = _kernel4(s, weights)
            x = _layer_forward(s, w4, b, x)
        elif s.kind == "act":
            x = _act_forward(s, x)
        else:
            x = x.reshape(s.out_shape)
        outs.append(x)
    return outs


# --------------------------------------------------------------------------- client side


def client_gradients(model: nn.Module, x: torch.Tensor, y: int, loss: str = "logistic") -> dict[str, torch.Tensor]:
    """The gradient one client shares for one unbatched sample x (parameter name -> gradient).

    logistic: single logit mu, y in {-1, +1}, l = log(1 + exp(-y mu)); cross-entropy: y a class index.
    """
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    p0 = next(iter(model.parameters()))
    x = x.to(device=p0.device, dtype=p0.dtype)

    def output_and_loss():
        out = model(x[None])
        if loss == "logistic":
            if out.numel() != 1:
                raise ValueError(f"logistic loss needs a single logit, the model returns {tuple(out.shape)}")
            if y not in (-1, 1):
                raise ValueError("logistic loss needs y in {-1, +1}")
            return out, F.softplus(-y * out.reshape(()))
        return out, F.cross_entropy(out.reshape(1, -1), torch.tensor([int(y)], device=out.device))

    out, ell = output_and_loss()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(ell, [p for _, p in named], allow_unused=True)
    # No reconstruction (and no MSE) from a NaN gradient: name the op that made it.
    finite.require_finite(
        "--verify rgap (R-GAP)",
        (out, ell),
        grads,
        model=model,
        rerun=output_and_loss,
        parameters=[p for _, p in named],
        inputs=x,
    )
    return {n: (torch.zeros_like(p) if g is None else g.detach()) for (n, p), g in zip(named, grads)}


# --------------------------------------------------------------------------- one layer's linear system


def _rank_tol(m: int, n: int, dtype) -> float:
    # NumPy/LAPACK convention: singular values below max(m, n) * eps * sigma_max cannot be told
    # apart from rounding of entries of that magnitude. A_i's structural dependencies (stride
    # overlaps, the C_out^2 GDBR identities) are exact, so their singular values sit at this
    # rounding level while genuine ones are many orders above it (see tests: CNN6-d conv2).
    return max(m, n) * torch.finfo(dtype).eps


class _LayerSystem:
    """A_i = [W_i; K_i; P] of one layer, held in the structured form the solver exploits.

    With x padded to (C, Hp, Wp), the gradient constraints are dW[o,c,q] = sum_p k[o,p] xpad[c, idx[q,p]]
    (idx = unfold's index map). Their coefficient matrix G, rows (o,q), columns = padded pixels, is the
    same for every input channel c, so K_i = I_C (x) G. The padding rows P pin the padded pixels to 0,
    which is the same as deleting those columns (rank(A) = #padded + rank of the interior system).
    """

    def __init__(self, step: Step, w4: torch.Tensor, k_out: torch.Tensor):
        self.step, self.w4 = step, w4
        o, c, kh, kw = w4.shape
        _, h, w = _as_image(step, torch.empty(step.in_shape, device="meta")).shape
        top, bottom, left, right = step.padding
        hp, wp = h + top + bottom, w + left + right
        self.o, self.c, self.h, self.w, self.hp, self.wp, self.kk = o, c, h, w, hp, wp, kh * kw
        if h * w > _MAX_SPATIAL:
            raise RGapUnsupported(
                step.name,
                f"input of {h}x{w} pixels per channel is too large for the dense R-GAP solve (limit {_MAX_SPATIAL})",
            )
        dev, dt = w4.device, w4.dtype
        grid = torch.arange(hp * wp, device=dev, dtype=torch.float64).reshape(1, 1, hp, wp)
        idx = F.unfold(grid, (kh, kw), dilation=step.dilation, stride=step.stride)[0].round().long()  # (K, L)
        self.n_out = idx.shape[1]
        interior = torch.full((hp * wp,), -1, dtype=torch.long, device=dev)
        rows = torch.arange(top, top + h, device=dev)[:, None] * wp + torch.arange(left, left + w, device=dev)[None, :]
        interior[rows.reshape(-1)] = torch.arange(h * w, device=dev)
        col = interior[idx]  # (K, L), -1 where the kernel reads padding
        kmat = k_out.reshape(o, self.n_out).to(dt)
        g = torch.zeros(o * self.kk, h * w, dtype=dt, device=dev)
        row_ids = (
            torch.arange(o, device=dev)[:, None, None] * self.kk + torch.arange(self.kk, device=dev)[None, :, None]
        ).expand(o, self.kk, self.n_out)
        cols = col[None].expand(o, -1, -1)
        vals = kmat[:, None, :].expand(o, self.kk, self.n_out)
        keep = cols >= 0
        g.index_put_((row_ids[keep], cols[keep]), vals[keep], accumulate=True)
        self.G = g
        self.unknowns = c * hp * wp
        self.n_pad = c * (hp * wp - h * w)

    def grad_rhs(self, grad_w: torch.Tensor) -> torch.Tensor:
        return grad_w.reshape(self.o, self.c, self.kk).permute(0, 2, 1).reshape(self.o * self.kk, self.c)

    def apply_w(self, x_int: torch.Tensor) -> torch.Tensor:
        """W_i applied to a batch of interior inputs (B, C, H, W) -> (B, O*L), bias excluded."""
        top, bottom, left, right = self.step.padding
        xp = F.pad(x_int, (left, right, top, bottom))
        return F.conv2d(xp, self.w4, None, stride=self.step.stride, dilation=self.step.dilation).reshape(
            x_int.shape[0], -1
        )

    def null_block(self, n_basis: torch.Tensor) -> torch.Tensor:
        """W_i (I_C (x) N): each null-space basis image of G placed in each channel and convolved.

        Convolving basis images gives W_i N exactly without materialising the (sparse) W_i.
        """
        nn_ = n_basis.shape[1]
        imgs = n_basis.T.reshape(nn_, 1, self.h, self.w)
        top, bottom, left, right = self.step.padding
        imgs = F.pad(imgs, (left, right, top, bottom))
        blocks = []
        for ch in range(self.c):
            out = F.conv2d(imgs, self.w4[:, ch : ch + 1], None, stride=self.step.stride, dilation=self.step.dilation)
            blocks.append(out.reshape(nn_, -1).T)
        return torch.cat(blocks, dim=1)


def _svd_g(system: _LayerSystem):
    g = system.G
    # The full V is needed for null(G); when G is tall the reduced SVD already holds all of V.
    u, s, vh = torch.linalg.svd(g, full_matrices=g.shape[0] < g.shape[1])
    tol = _rank_tol(*g.shape, g.dtype)
    r = int((s > tol * s[0]).sum()) if s.numel() and s[0] > 0 else 0
    return u, s, vh, r


def _singular_values(a: torch.Tensor) -> torch.Tensor:
    # LAPACK's direct SVD of these structured, not-quite-tall blocks ran 5-10x slower here than a
    # Householder QR followed by the SVD of the square R, which has the same singular values.
    tall = a if a.shape[0] >= a.shape[1] else a.T
    return torch.linalg.svdvals(torch.linalg.qr(tall, mode="r")[1])


def _rank_of(sv: torch.Tensor, shape) -> tuple[int, float]:
    if not sv.numel() or sv[0] <= 0:
        return 0, math.inf
    rank = int((sv > _rank_tol(*shape, sv.dtype) * sv[0]).sum())
    return rank, float(sv[0] / sv[rank - 1])


# Cholesky of the Gram matrix certifies full column rank when its smallest eigenvalue sits far above
# the Gram's own rounding level (~ n eps lambda_max, 1e-12 lambda_max for n ~ 2500). We ask for
# lambda_min / lambda_max > 1e-8, i.e. sigma_min / sigma_max > 1e-4: eight orders above the SVD
# tolerance, so the rank is the one the SVD would report. Anything less certain goes to the SVD.
# Why not always the SVD: on a shared 2-core box an SVD of a 2500-column block took 20-50 s under
# load (bidiagonalisation is memory-bound), while Gram + Cholesky are BLAS-3 and took ~1.5 s.
_GRAM_CERTIFY = 1e-8


def _gram_solve(a: torch.Tensor, rhs: torch.Tensor):
    """Least squares through Cholesky of a^T a when a has certainly full column rank, else None."""
    n = a.shape[1]
    if a.shape[0] < n:
        return None
    m = a.T @ a
    chol, info = torch.linalg.cholesky_ex(m)
    if int(info) != 0:
        return None
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(n, min(4, n), generator=gen, dtype=a.dtype).to(a.device)
    w = v.clone()
    # Block power and inverse iteration; their Rayleigh-Ritz values bracket the spectrum from inside.
    # A dozen steps give the extreme Ritz values to a few digits, enough for the certificate's
    # four-orders margin and for the reported condition.
    for _ in range(12):
        v = torch.linalg.qr(m @ v)[0]
        w = torch.linalg.qr(torch.cholesky_solve(w, chol))[0]
    lam_max = float(torch.linalg.eigvalsh(v.T @ m @ v)[-1])
    lam_min = float(torch.linalg.eigvalsh(w.T @ m @ w)[0])
    if lam_min <= 0 or lam_min < _GRAM_CERTIFY * lam_max:
        return None
    x = torch.cholesky_solve((a.T @ rhs)[:, None], chol)
    for _ in range(2):  # refinement: semi-normal equations then reach ~cond*eps instead of cond^2*eps
        x = x + torch.cholesky_solve(a.T @ (rhs[:, None] - a @ x), chol)
    return x[:, 0], n, math.sqrt(lam_max / lam_min)


def _least_squares(a: torch.Tensor, rhs: torch.Tensor, use_svd: bool | None = None) -> tuple[torch.Tensor, int, float]:
    """Minimum-norm least-squares a x = rhs (Algorithm 1's pseudo-inverse), its rank, its condition."""
    tol = _rank_tol(*a.shape, a.dtype)
    if use_svd if use_svd is not None else a.device.type == "cuda":
        # cuSOLVER's lstsq assumes full rank; the truncated SVD is exactly the pseudo-inverse.
        u, sv, vh = torch.linalg.svd(a, full_matrices=False)
        rank, cond = _rank_of(sv, a.shape)
        return vh[:rank].T @ ((u[:, :rank].T @ rhs) / sv[:rank]), rank, cond
    certified = _gram_solve(a, rhs)
    if certified is not None:
        return certified
    # Not gelsy: torch's gelsy returned wrong solutions for rank-deficient blocks here (residual 0.13
    # on a consistent system; pytorch issues #71222/#92537, its pivot array is not reset). gelsd is
    # SVD-based: it gives the min-norm solution, the rank at our tolerance and the singular values.
    res = torch.linalg.lstsq(a, rhs[:, None], rcond=tol, driver="gelsd")
    rank = int(res.rank)
    sv = res.singular_values
    cond = float(sv[0] / sv[rank - 1]) if rank else math.inf
    return res.solution[:, 0], rank, cond


def _solve_layer(step: Step, w4, b, grad_w, z_out, k_out):
    """Solve A_i x_i = b_i for one layer, in two exact stages.

    Stage 1: G (same for every channel) is inverted on its row space: the gradient constraints fix
    x_c's component there, x_c = V_r S_r^-1 U_r^T g_c. Stage 2: the rest of x lies in null(G) per
    channel, x_c = x_c^r + N y_c, and the weight constraints W x = z - b decide y by least squares.
    Under the orthogonal change of variables x_c -> V^T x_c, A_i becomes block-triangular, so
    rank(A_i) = #padded + C*rank(G) + rank(W (I (x) N)) exactly; no equilibration between gradient
    and weight rows is needed.
    """
    sysm = _LayerSystem(step, w4, k_out)
    dt = w4.dtype
    c, h, w = sysm.c, sysm.h, sysm.w
    g_rhs = sysm.grad_rhs(grad_w.to(dt))
    u, s, vh, r = _svd_g(sysm)
    coef = (u[:, :r].T @ g_rhs) / s[:r, None]
    x_cols = vh[:r].T @ coef  # (HW, C)
    cond_g = float(s[0] / s[r - 1]) if r else math.nan
    nnull = h * w - r
    z_flat = z_out.reshape(-1).to(dt)
    zb = z_flat - (b.to(dt).repeat_interleave(sysm.n_out) if b is not None else 0)
    rank_y, cond_y = 0, math.nan
    if nnull:
        if sysm.o * sysm.n_out * c * nnull > _MAX_DENSE_ENTRIES:
            raise RGapUnsupported(
                step.name,
                f"the weight-constraint block ({sysm.o * sysm.n_out} x {c * nnull}) "
                "is too large for the dense R-GAP solve",
            )
        n_basis = vh[r:].T  # (HW, nnull)
        y_mat = sysm.null_block(n_basis)
        rhs = zb - sysm.apply_w(x_cols.T.reshape(1, c, h, w))[0]
        sol, rank_y, cond_y = _least_squares(y_mat, rhs)
        x_cols = x_cols + n_basis @ sol.reshape(c, nnull).T
    x_img = x_cols.T.reshape(c, h, w)
    rank = sysm.n_pad + c * r + rank_y

    w_fit = sysm.apply_w(x_img[None])[0]
    w_res = float((w_fit - zb).norm() / zb.norm().clamp_min(1e-300))
    g_res = float((sysm.G @ x_cols - g_rhs).norm() / g_rhs.norm().clamp_min(1e-300))
    conds = [v for v in (cond_g, cond_y) if not math.isnan(v)]
    condition = math.nan if (nnull and math.isnan(cond_y)) or not conds else max(conds)
    solve = LayerSolve(step.name, sysm.unknowns, rank, sysm.unknowns - rank, max(w_res, g_res), condition)
    return x_img.reshape(step.in_shape), solve


def _layer_rank(step: Step, w4, k_out) -> LayerSolve:
    sysm = _LayerSystem(step, w4, k_out)
    _, s, vh, r = _svd_g(sysm)
    nnull = sysm.h * sysm.w - r
    rank_y, cond_y = 0, math.nan
    if nnull:
        if sysm.o * sysm.n_out * sysm.c * nnull > _MAX_DENSE_ENTRIES:
            raise RGapUnsupported(step.name, "layer too large for the dense rank computation")
        y_mat = sysm.null_block(vh[r:].T)
        certified = _gram_solve(y_mat, torch.zeros(y_mat.shape[0], dtype=y_mat.dtype, device=y_mat.device))
        if certified is not None:
            _, rank_y, cond_y = certified
        else:
            rank_y, cond_y = _rank_of(_singular_values(y_mat), y_mat.shape)
    cond_g = float(s[0] / s[r - 1]) if r else math.nan
    rank = sysm.n_pad + sysm.c * r + rank_y
    conds = [v for v in (cond_g, cond_y) if not math.isnan(v)]
    return LayerSolve(step.name, sysm.unknowns, rank, sysm.unknowns - rank, math.nan, max(conds) if conds else math.nan)


# --------------------------------------------------------------------------- the top layer


def _logistic_value(m: float) -> float:
    """<dL/dW, W> = (dl/dmu) mu as a function of the margin m = y*mu, for l = log(1 + e^-m)."""
    if m >= 0:
        e = math.exp(-m)
        return -m * e / (1 + e)
    return -m / (1 + math.exp(m))


_M_STAR = 1.2784645427610738  # argmin of the function above: 1 + e^m (1 - m) = 0


def _bisect(f, lo, hi, target):
    flo = f(lo) - target
    for _ in range(300):
        mid = 0.5 * (lo + hi)
        fm = f(mid) - target
        if (fm > 0) == (flo > 0):
            lo, flo = mid, fm
        else:
            hi = mid
        if hi - lo <= 1e-16 * max(1.0, abs(mid)):
            break
    return 0.5 * (lo + hi)


def _margin_roots(v: float) -> tuple[list[float], str | None]:
    """All margins m with (dl/dmu) mu = v for the logistic loss (Fig. 1 of the paper)."""
    if v > 0:
        return [_bisect(_logistic_value, -v - 60.0, 0.0, v)], None
    if v == 0:
        return [0.0], None
    vmin = _logistic_value(_M_STAR)
    if v <= vmin:
        return [_M_STAR], (
            f"<dL/dW, W> = {v:.4g} is below the logistic loss's minimum {vmin:.4g}: "
            "gradients are inconsistent (noise?); using the extremum"
        )
    return [_bisect(_logistic_value, 0.0, _M_STAR, v), _bisect(_logistic_value, _M_STAR, 800.0, v)], None


@dataclass
class _Candidate:
    k: torch.Tensor  # dL/dz at the top layer's output
    z: torch.Tensor  # the top layer's output (logits)
    label: int
    margin: float | None
    what: str


def _top_candidates(step: Step, w4, b, grads: dict, loss: str) -> tuple[list[_Candidate], list[str]]:
    """Every (label, dL/dz, z) at the output layer that its gradient allows; later steps pick one."""
    gw = grads[step.weight].reshape(w4.shape[0], -1).to(w4.dtype)
    w = w4.reshape(w4.shape[0], -1)
    dev, dt = w4.device, w4.dtype
    notes: list[str] = []
    n_out = w.shape[0]
    if loss == "logistic":
        if n_out != 1:
            raise RGapUnsupported(
                step.name,
                f"logistic loss needs a single logit; {step.name} has {n_out} outputs (use loss='cross-entropy')",
            )
        if b is not None:
            # dL/db = dl/dmu = -y / (1 + e^m): its sign gives y, its size gives m uniquely (no twin).
            d = float(grads[step.bias].reshape(()))
            if d == 0 or abs(d) >= 1:
                raise RGapUnsupported(step.name, "the output bias gradient is 0 or not a logistic derivative")
            y = -1 if d > 0 else 1
            m = math.log(1 / abs(d) - 1)
            mu = y * m
            k = torch.tensor([d], dtype=dt, device=dev)
            z = torch.tensor([mu], dtype=dt, device=dev)
            return [_Candidate(k, z, y, m, "from the output bias gradient")], notes
        v = float((gw * w).sum())
        roots, warn = _margin_roots(v)
        if warn:
            notes.append(warn)
        cands = []
        for m in roots:
            for y in (1, -1):
                d = -y / (1 + math.exp(m)) if m < 700 else -y * math.exp(-m)
                cands.append(
                    _Candidate(
                        torch.tensor([d], dtype=dt, device=dev),
                        torch.tensor([y * m], dtype=dt, device=dev),
                        y,
                        m,
                        f"y={y:+d}, margin={m:.6g}",
                    )
                )
        return cands, notes
    # cross-entropy: dL/dz = softmax(z) - e_y has exactly one negative entry, at the label (iDLG).
    if b is not None:
        k = grads[step.bias].reshape(-1).to(dt)
        label = int(torch.argmin(k))
        p = (k + F.one_hot(torch.tensor(label, device=dev), n_out).to(dt)).clamp_min(1e-300)
        # logits are fixed by softmax only up to a constant; W x + b pins it, so fit it there.
        x = (k @ gw) / (k @ k)
        zc = torch.log(p)
        shift = ((w @ x + b.to(dt)) - zc).mean()
        return [_Candidate(k, zc + shift, label, None, f"label {label} from the output bias gradient")], notes
    # No bias: dL/dW = k x^T is rank one, k = a*u and x = (s/a)*v up to the scale a. With p = k + e_y =
    # softmax(t W v), t = s/a, every pair of classes j, l != y gives log u_j - log u_l = t (Wv_j - Wv_l):
    # a linear regression for t. With two classes only the label's entry is left, fitted in 1-D.
    uu, ss, vvh = torch.linalg.svd(gw, full_matrices=False)
    u, s1, v = uu[:, 0], float(ss[0]), vvh[0]
    cands = []
    for sign in (1.0, -1.0):
        us, vs = sign * u, sign * v
        if int((us < 0).sum()) != 1:
            continue
        label = int(torch.argmin(us))
        wv = w @ vs
        e_y = F.one_hot(torch.tensor(label, device=dev), n_out).to(dt)
        others = torch.arange(n_out, device=dev) != label
        t = None
        if n_out >= 3:
            a_, b_ = wv[others], torch.log(us[others])
            a_c, b_c = a_ - a_.mean(), b_ - b_.mean()
            if float(a_c @ a_c) > 0:
                t = float((a_c @ b_c) / (a_c @ a_c))
        if t is None or t <= 0:
            t = _fit_softmax_scale(us, vs, wv, e_y, s1)
        a = s1 / t
        resid = float(((a * us + e_y) - torch.softmax(t * wv, 0)).norm())
        cands.append(_Candidate(a * us, t * wv, label, None, f"label {label} (softmax fit residual {resid:.1e})"))
    if not cands:
        raise RGapUnsupported(step.name, "the output gradient is not a cross-entropy gradient of one sample")
    return cands, notes


def _fit_softmax_scale(us, vs, wv, e_y, s1) -> float:
    """t > 0 minimising ||(s1/t) us + e_y - softmax(t wv)|| by a log grid and golden section."""

    def resid(log_t):
        t = math.exp(log_t)
        return float((((s1 / t) * us + e_y) - torch.softmax(t * wv, 0)).norm())

    grid = [i / 20 for i in range(-200, 401)]
    vals = [resid(g) for g in grid]
    i0 = min(range(len(grid)), key=vals.__getitem__)
    lo, hi = grid[max(i0 - 1, 0)], grid[min(i0 + 1, len(grid) - 1)]
    for _ in range(120):
        m1, m2 = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
        if resid(m1) < resid(m2):
            hi = m2
        else:
            lo = m1
    return math.exp(0.5 * (lo + hi))


# --------------------------------------------------------------------------- the recursion


@dataclass(eq=False)
class _State:
    pos: int  # index in the chain of the layer whose input we hold
    x: torch.Tensor  # that layer's input
    g: torch.Tensor  # dL/d(that input)
    solves: list[LayerSolve]
    cand: _Candidate


def _walk_down(chain, st: _State):
    """Through the activations/reshapes below chain[st.pos]: (index of the next layer or -1, its output z,
    dL/dz) from the layer input we hold and its gradient."""
    x, g = st.x, st.g
    i = st.pos - 1
    while i >= 0 and not chain[i].is_layer:
        s = chain[i]
        x, g = x.reshape(s.in_shape), g.reshape(s.in_shape)
        if s.kind == "act":
            x, d = _act_inverse(s, x)
            g = g * d
        i -= 1
    return i, x, g


def _step_down(chain, weights, grads, st: _State) -> _State:
    """From the input of layer chain[st.pos], walk down to the next layer and solve it."""
    i, z, g = _walk_down(chain, st)
    if i < 0:
        return _State(-1, z, g, st.solves, st.cand)
    s = chain[i]
    w4, b = _kernel4(s, weights)
    k = g.reshape(s.out_shape)
    if s.kind == "linear" and s.bias is not None:
        # Phong et al.: dL/db = k exactly, so the recursion's accumulated error does not enter here.
        k = grads[s.bias].to(w4.dtype).reshape(s.out_shape)
    x_in, solve = _solve_layer(s, w4, b, grads[s.weight], z.reshape(s.out_shape), k)
    g_in = _layer_backward(s, w4, k)
    return _State(i, x_in, g_in, st.solves + [solve], st.cand)


def _identity_misfit(chain, weights, grads, st: _State) -> float:
    """How badly a candidate's (z, k) at the next layer down break <dW_o, W_o'> = sum_p k[o,p] (z-b)[o',p].

    The identity (GDBR Lemma 3 generalised) holds for every pair of output channels whatever the
    unknown input is, so it tests a top-layer candidate without solving the layer: a wrong label sign
    or a non-scaling twin breaks it, an exact twin of a homogeneous net does not.
    """
    i, z, g = _walk_down(chain, st)
    if i < 0:
        return 0.0
    s = chain[i]
    w4, b = _kernel4(s, weights)
    o = w4.shape[0]
    k = g.reshape(o, -1)
    if s.kind == "linear" and s.bias is not None:
        k = grads[s.bias].reshape(o, -1)
    zb = z.reshape(o, -1) - (b.reshape(o, 1) if b is not None else 0)
    rhs = k @ zb.T
    lhs = grads[s.weight].reshape(o, -1) @ w4.reshape(o, -1).T
    return float((lhs - rhs).norm() / rhs.norm().clamp_min(1e-300))


def _descend(chain, weights, grads, st: _State) -> _State:
    while st.pos > 0:
        st = _step_down(chain, weights, grads, st)
    return st


def _final_input(chain, st: _State, input_shape) -> torch.Tensor:
    x = st.x
    if st.pos > 0:
        for s in reversed(chain[: st.pos]):
            x = x.reshape(s.in_shape)
            if s.kind == "act":
                x, _ = _act_inverse(s, x)
    return x.reshape(input_shape)


def _worst_residual(st: _State) -> float:
    vals = [s.residual for s in st.solves if not math.isnan(s.residual)]
    return max(vals) if vals else 0.0


def _box_distance(x: torch.Tensor) -> float:
    return float(((x - x.clamp(0, 1)) ** 2).mean())


def _homogeneous(chain: list[Step]) -> bool:
    return all((s.kind != "act" or s.act in ("leaky_relu", "identity")) and not (s.is_layer and s.bias) for s in chain)


def reconstruct(
    chain: list[Step],
    weights: dict,
    gradients: dict,
    loss: str = "logistic",
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float64,
) -> Reconstruction:
    """Algorithm 1: recover the input from one sample's gradients, top layer first; layers come back bottom-up."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    device = torch.device(device)
    weights = {k: v.detach().to(device=device, dtype=dtype) for k, v in weights.items()}
    grads = {k: v.detach().to(device=device, dtype=dtype) for k, v in gradients.items()}
    top = max(i for i, s in enumerate(chain) if s.is_layer)
    ts = chain[top]
    w4, b = _kernel4(ts, weights)
    cands, notes = _top_candidates(ts, w4, b, grads, loss)
    input_shape = chain[0].in_shape

    states = []
    for cand in cands:
        x_top, solve = _solve_layer(ts, w4, b, grads[ts.weight], cand.z, cand.k)
        states.append(_State(top, x_top, _layer_backward(ts, w4, cand.k), [solve], cand))

    # Activations just below the top bound its input (Sigmoid: (0,1)); that alone often fixes y.
    def range_ok(st):
        x, i = st.x, top - 1
        while i >= 0 and not chain[i].is_layer:
            x = x.reshape(chain[i].in_shape)
            if chain[i].kind == "act":
                if not _act_range_ok(chain[i], x.reshape(chain[i].out_shape)):
                    return False
                x, _ = _act_inverse(chain[i], x)
            i -= 1
        return True

    why_rejected: dict[int, str] = {}
    kept = [st for st in states if range_ok(st)]
    if len(kept) < len(states) and kept:
        for st in states:
            if all(st is not k_ for k_ in kept):
                why_rejected[id(st.cand)] = "its top-layer input leaves the activation's range"
        states = kept
    if len(states) > 1 and top > 0:
        misfit = {id(st): _identity_misfit(chain, weights, grads, st) for st in states}
        least = min(misfit.values())
        survivors = [st for st in states if misfit[id(st)] <= 10 * least + 1e-9]
        for st in states:
            if all(st is not k_ for k_ in survivors):
                why_rejected[id(st.cand)] = (
                    f"it breaks the <dW, W> channel identities of the layer below "
                    f"(relative misfit {misfit[id(st)]:.2g} vs {least:.2g})"
                )
        states = survivors

    finals: list[tuple[_State, torch.Tensor]] = []
    homog = _homogeneous(chain) and loss == "logistic"
    done_twins: dict[int, tuple[_State, torch.Tensor]] = {}
    for st in states:
        twin = done_twins.get(st.cand.label) if homog else None
        if twin is not None:
            # Positively homogeneous net without bias: the twin is exactly the other input scaled by
            # the ratio of margins (Appendix B), so we need not solve again.
            base_st, base_x = twin
            scale = st.cand.margin / base_st.cand.margin
            fin = _State(0, base_x * scale, base_st.g, [replace(l_) for l_ in base_st.solves], st.cand)
            finals.append((fin, base_x * scale))
            continue
        fin = _descend(chain, weights, grads, st)
        x = _final_input(chain, fin, input_shape)
        finals.append((fin, x))
        if homog and st.cand.margin:
            done_twins[st.cand.label] = (fin, x)

    best = min(_worst_residual(f) for f, _ in finals)
    plausible = [(f, x) for f, x in finals if _worst_residual(f) <= 10 * best + 1e-9]
    for f, _ in finals:
        if all(f is not p for p, _ in plausible):
            why_rejected[id(f.cand)] = (
                f"its reconstruction misfits the layer constraints (relative residual "
                f"{_worst_residual(f):.2g} vs {best:.2g})"
            )
    # Exact twins give identical gradients, so only a prior can choose: pixel values lie in [0, 1];
    # among candidates inside the box take the larger one, since the twin of a natural image is
    # usually a faint scaled copy.
    plausible.sort(key=lambda fx: (round(_box_distance(fx[1]), 12), -float(fx[1].abs().max())))
    chosen, x = plausible[0]
    others = [xx for f, xx in plausible[1:]]
    margins = sorted({c.margin for c in cands if c.margin is not None})
    if loss == "logistic" and len(margins) > 1:
        alive = {f.cand.margin for f, _ in plausible}
        head = (
            f"twin data (Appendix B): margins {margins[0]:.4g} and {margins[1]:.4g} both fit "
            f"<dL/dW, W> = {-margins[0] / (1 + math.exp(margins[0])):.4g}; "
        )
        if len(alive) > 1:
            notes.append(
                head + "both reconstructions explain the gradients exactly (the twin is the input "
                f"rescaled); chose margin {chosen.cand.margin:.4g} by the [0,1] pixel-range prior, "
                "the other is in Reconstruction.alternatives"
            )
        else:
            reasons = sorted(
                {why_rejected[id(c)] for c in cands if c.margin != chosen.cand.margin and id(c) in why_rejected}
            )
            notes.append(head + f"the twin was rejected: {'; '.join(reasons) or 'it fits worse'}")
    if float(grads[ts.weight].abs().max()) == 0.0:
        notes.append(
            "the output layer's gradient is exactly zero (saturated loss): it carries no information "
            "about this sample, the reconstruction is meaningless"
        )
    # Report layers bottom-up, the order the user reads a model in.
    return Reconstruction(
        x=x, layers=list(reversed(chosen.solves)), notes=notes, label=chosen.cand.label, alternatives=others
    )


# --------------------------------------------------------------------------- numerical rank on its own


def numerical_rank(
    chain: list[Step],
    weights: dict,
    gradients: dict | None = None,
    *,
    loss: str = "logistic",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
    only: set[str] | None = None,
) -> list[LayerSolve]:
    """|x_i| - rank(A_i) per layer (spec §7 numerical mode), bottom layer first.

    Without gradients, the k_i come from a seeded uniform [0,1] input pushed through the given weights
    (pass random weights for the generic rank); with gradients, R-GAP runs and its solves are returned.
    `only` restricts the (costly) rank computation to the named layers.
    """
    if gradients is not None:
        return reconstruct(chain, weights, gradients, loss, device, dtype).layers
    device = torch.device(device)
    weights = {k: v.detach().to(device=device, dtype=dtype) for k, v in weights.items()}
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(chain[0].in_shape, generator=gen, dtype=dtype).to(device)
    outs = chain_forward(chain, weights, x)
    top = max(i for i, s in enumerate(chain) if s.is_layer)
    logits = outs[top].reshape(-1)
    if loss == "logistic":
        y = 1 if torch.rand((), generator=gen) < 0.5 else -1
        g = (-y * torch.sigmoid(-y * logits)).reshape(chain[top].out_shape)
    else:
        label = int(torch.randint(logits.numel(), (), generator=gen))
        g = torch.softmax(logits, 0) - F.one_hot(torch.tensor(label), logits.numel()).to(dtype).to(device)
    g = g.reshape(chain[top].out_shape)
    result = []
    for i in range(top, -1, -1):
        s = chain[i]
        if s.is_layer:
            w4, _ = _kernel4(s, weights)
            if only is None or s.name in only:
                result.append(_layer_rank(s, w4, g))
            g = _layer_backward(s, w4, g)
        elif s.kind == "act":
            _, d = _act_inverse(s, outs[i])
            g = g.reshape(s.out_shape) * d
        g = g.reshape(s.in_shape)
    return list(reversed(result))


# --------------------------------------------------------------------------- the attack on a set of images


def _reconstruct_defended(chain, weights, grads, loss, dev, dtype, shape) -> Reconstruction:
    """reconstruct() on a defended gradient, which need not be a gradient at all: where the algebra breaks
    (no valid top-layer candidate, a singular or non-finite system), the attacker has nothing, scored as zeros."""
    try:
        rec = reconstruct(chain, weights, grads, loss, dev, dtype)
    except (RGapUnsupported, RuntimeError, ValueError, ZeroDivisionError, OverflowError) as exc:
        reason = exc.reason if isinstance(exc, RGapUnsupported) else f"{type(exc).__name__}: {exc}"
        return Reconstruction(
            x=torch.zeros(shape, dtype=dtype, device=dev),
            layers=[],
            notes=[f"R-GAP failed on the defended gradient ({reason}); scored as an all-zero image"],
            label=None,
        )
    if not bool(torch.isfinite(rec.x).all()):
        rec.notes.append("the reconstruction from the defended gradient is not finite; non-finite pixels scored as 0")
        rec.x = torch.nan_to_num(rec.x, nan=0.0, posinf=0.0, neginf=0.0)
    return rec


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def run_rgap(
    model: nn.Module,
    images: torch.Tensor,
    device: str = "auto",
    seed: int = 0,
    loss: str = "logistic",
    progress: Callable[[int, int], None] | None = None,
    *,
    defense: Callable[[dict], dict] | None = None,
) -> RGapResult:
    """Attack each image's single-sample gradient with R-GAP and score the reconstruction.

    MSE is on the raw reconstruction (what the algebra recovered); PSNR is on the reconstruction
    clipped to [0, 1], the image a person would look at, with a 1e-30 MSE floor (300 dB) to stay finite.
    Everything runs in float64: the client's gradient is computed in float64 too, so the MSE measures
    the attack, not float32 rounding of the gradient. Labels are drawn from `seed` (logistic: y = +-1;
    cross-entropy: a class). Seconds time reconstruct() alone. progress(done, total) runs after each sample.

    ``defense`` (grads -> grads, e.g. ``rankaudit.verify.defenses.Defense.client()``) is what the client applies
    before sharing: the attack sees only its output. The attack is not told about the defense. Where the defended
    gradient is no gradient R-GAP can invert at all, the sample's reconstruction is all zeros and a note says why.
    """
    dev = _resolve_device(device)
    dtype = torch.float64
    net = copy.deepcopy(model).to(device=dev, dtype=dtype)
    net.train()
    if images.dim() < 2:
        raise ValueError("images must be a batch N x C x H x W")
    input_shape = tuple(images.shape[1:])
    chain = extract_chain(net, input_shape)
    weights = {n: p.detach() for n, p in net.named_parameters()}
    gen = torch.Generator().manual_seed(seed)
    n = images.shape[0]
    recs, mses, psnrs, secs, labels, rlabels = [], [], [], [], [], []
    layers: list[LayerSolve] = []
    notes: list[str] = []
    n_classes = None
    for i in range(n):
        x = images[i].to(device=dev, dtype=dtype)
        if loss == "logistic":
            y = 1 if torch.rand((), generator=gen) < 0.5 else -1
        else:
            if n_classes is None:
                with torch.no_grad():
                    n_classes = net(x[None]).numel()
            y = int(torch.randint(n_classes, (), generator=gen))
        grads = client_gradients(net, x, y, loss)
        if defense is not None:
            grads = {name: g.to(device=dev, dtype=dtype) for name, g in defense(grads).items()}
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if defense is None:
            rec = reconstruct(chain, weights, grads, loss, dev, dtype)
        else:
            rec = _reconstruct_defended(chain, weights, grads, loss, dev, dtype, x.shape)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
        xr = rec.x.reshape(x.shape)
        mse = float(((xr - x) ** 2).mean())
        mse_clip = float(((xr.clamp(0, 1) - x) ** 2).mean())
        mses.append(mse)
        psnrs.append(10 * math.log10(1.0 / max(mse_clip, 1e-30)))
        recs.append(xr.detach().cpu())
        labels.append(y)
        rlabels.append(rec.label)
        if i == 0:
            layers = rec.layers
        notes.extend(f"sample {i}: {note}" for note in rec.notes)
        if progress is not None:
            progress(i + 1, n)
    return RGapResult(
        reconstructions=torch.stack(recs) if recs else torch.empty(0),
        mse=mses,
        psnr=psnrs,
        seconds=secs,
        median_mse=statistics.median(mses) if mses else math.nan,
        median_psnr=statistics.median(psnrs) if psnrs else math.nan,
        median_seconds=statistics.median(secs) if secs else math.nan,
        layers=layers,
        notes=notes,
        device=str(dev),
        labels=labels,
        recovered_labels=rlabels,
    )
