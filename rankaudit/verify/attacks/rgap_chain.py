"""R-GAP's reading of the model: the chain of layers, activations and reshapes it inverts, and its arithmetic."""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx.passes.shape_prop import ShapeProp, TensorMetadata

from rankaudit.verify import AttackUnsupported


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
