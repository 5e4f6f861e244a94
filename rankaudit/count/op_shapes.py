"""Output-shape formulas per op family: microseconds where running an op's meta kernel first imports half of torch."""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def ntuple(value, n: int) -> tuple:
    if isinstance(value, (tuple, list)):
        return tuple(value) if len(value) == n else tuple(value) * n if len(value) == 1 else tuple(value)
    return (value,) * n


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


def linear_shape(target, args, kwargs):
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


def conv_shape(target, args, kwargs):
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
    stride, padding, dilation = ntuple(stride, n), ntuple(padding, n), ntuple(dilation, n)
    kernel = tuple(weight.shape[2:])
    out = tuple(
        _sliding_window(s, k, st, p, d, False) for s, k, st, p, d in zip(spatial, kernel, stride, padding, dilation)
    )
    _require(all(o > 0 for o in out), f"conv kernel {kernel} is larger than its padded input {spatial}")
    return tuple(x.shape[: -n - 1]) + (weight.shape[0],) + out


def conv_transpose_shape(target, args, kwargs):
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
    kernel = ntuple(kernel, n)
    stride = ntuple(stride if stride not in (None, ()) else kernel, n)
    padding, dilation = ntuple(padding, n), ntuple(dilation, n)
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
    sizes = ntuple(output_size, n)
    return tuple(x.shape[:-n]) + tuple(s if s is not None else d for s, d in zip(sizes, x.shape[-n:]))


def _upsample_shape(x, size, scale_factor):
    n = x.dim() - 2
    if size is not None:
        return tuple(x.shape[:2]) + ntuple(size, n)
    if scale_factor is None:
        return None
    scales = ntuple(scale_factor, n)
    return tuple(x.shape[:2]) + tuple(math.floor(d * float(s)) for d, s in zip(x.shape[2:], scales))


def resampler_shape(target, args, kwargs):
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


def cat_shape(target, args, kwargs):
    tensors = _arg(args, kwargs, 0, "tensors")
    dim = _arg(args, kwargs, 1, "dim", 0)
    if not isinstance(tensors, (tuple, list)) or not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        return None
    first = tuple(tensors[0].shape)
    if any(t.dim() != len(first) for t in tensors):
        return None
    dim = dim % len(first)
    return first[:dim] + (sum(t.shape[dim] for t in tensors),) + first[dim + 1 :]


def reduction_shape(target, args, kwargs):
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


def attention_shape(target, args, kwargs):
    """softmax(q kᵀ) v: q's positions, v's features."""
    return tuple(args[0].shape[:-1]) + (args[2].shape[-1],)


def addmm_shape(target, args, kwargs):
    """addmm(input, mat1, mat2) and input.addmm(mat1, mat2): mat1's rows by mat2's columns."""
    mat1, mat2 = _arg(args, kwargs, 1, "mat1"), _arg(args, kwargs, 2, "mat2")
    if not (isinstance(mat1, torch.Tensor) and isinstance(mat2, torch.Tensor)) or mat1.dim() != 2 or mat2.dim() != 2:
        return None
    _require(mat1.shape[1] == mat2.shape[0], f"addmm: {tuple(mat1.shape)} @ {tuple(mat2.shape)} do not chain")
    return (mat1.shape[0], mat2.shape[1])


_LP_POOL_DIMS = {nn.LPPool1d: 1, nn.LPPool2d: 2, F.lp_pool1d: 1, F.lp_pool2d: 2}
if hasattr(nn, "LPPool3d"):
    _LP_POOL_DIMS[nn.LPPool3d] = 3
if hasattr(F, "lp_pool3d"):
    _LP_POOL_DIMS[F.lp_pool3d] = 3


def lp_pool_shape(target, args, kwargs):
    """An average pool of x^p without padding (torch's lp_pool is avg_pool of the powers)."""
    module = _module(target)
    n = _LP_POOL_DIMS.get(type(module) if module is not None else target)
    if n is None:
        return None
    x = args[0]
    if module is not None:
        kernel, stride, ceil_mode = module.kernel_size, module.stride, module.ceil_mode
    else:
        kernel, stride = _arg(args, kwargs, 2, "kernel_size"), _arg(args, kwargs, 3, "stride")
        ceil_mode = _arg(args, kwargs, 4, "ceil_mode", False)
    kernel = ntuple(kernel, n)
    stride = ntuple(stride if stride not in (None, ()) else kernel, n)
    _require(x.dim() > n, f"pooling over {n} spatial dims needs more dims than shape {tuple(x.shape)}")
    out = tuple(_sliding_window(s, k, st, 0, 1, ceil_mode) for s, k, st in zip(x.shape[-n:], kernel, stride))
    _require(all(o > 0 for o in out), f"pooling window {kernel} is larger than its input {tuple(x.shape[-n:])}")
    return tuple(x.shape[:-n]) + out


def _recurrent_shapes(module: nn.RNNBase, args, kwargs):
    x = args[0]
    if not isinstance(x, torch.Tensor):
        return None  # a PackedSequence: run the module
    batched = x.dim() == 3
    _require(
        x.dim() in (2, 3) and x.shape[-1] == module.input_size,
        f"{type(module).__name__} expects {module.input_size} input features, got shape {tuple(x.shape)}",
    )
    directions = 2 if module.bidirectional else 1
    out_size = getattr(module, "proj_size", 0) or module.hidden_size
    if batched and module.batch_first:
        batch, out = (x.shape[0],), (x.shape[0], x.shape[1])
    elif batched:
        batch, out = (x.shape[1],), (x.shape[0], x.shape[1])
    else:
        batch, out = (), (x.shape[0],)
    hidden = (directions * module.num_layers, *batch, out_size)
    if isinstance(module, nn.LSTM):
        return (*out, directions * out_size), (hidden, (directions * module.num_layers, *batch, module.hidden_size))
    return (*out, directions * out_size), hidden


def _cell_shapes(module: nn.RNNCellBase, args, kwargs):
    x = args[0]
    _require(
        x.dim() in (1, 2) and x.shape[-1] == module.input_size,
        f"{type(module).__name__} expects {module.input_size} input features, got shape {tuple(x.shape)}",
    )
    state = tuple(x.shape[:-1]) + (module.hidden_size,)
    return (state, state) if isinstance(module, nn.LSTMCell) else state


def _attention_module_shapes(module: nn.MultiheadAttention, args, kwargs):
    query, key = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    need_weights = _arg(args, kwargs, 4, "need_weights", True)
    average = _arg(args, kwargs, 6, "average_attn_weights", True)
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor)) or query.dim() not in (2, 3):
        return None
    _require(query.shape[-1] == module.embed_dim, f"attention expects {module.embed_dim} features")
    batched = query.dim() == 3
    out = tuple(query.shape)
    if not need_weights:
        return out, None
    if not batched:
        targets, sources, batch = query.shape[0], key.shape[0], ()
    elif module.batch_first:
        targets, sources, batch = query.shape[1], key.shape[1], (query.shape[0],)
    else:
        targets, sources, batch = query.shape[0], key.shape[0], (query.shape[1],)
    heads = () if average else (module.num_heads,)
    return out, (*batch, *heads, targets, sources)


def _unfold_shape(x, kernel, dilation, padding, stride):
    _require(x.dim() in (3, 4), f"unfold expects a (N,) C, H, W input, got shape {tuple(x.shape)}")
    kernel, dilation, padding, stride = (ntuple(v, 2) for v in (kernel, dilation, padding, stride))
    blocks = [
        _sliding_window(s, k, st, p, d, False)
        for s, k, st, p, d in zip(x.shape[-2:], kernel, stride, padding, dilation)
    ]
    _require(all(b > 0 for b in blocks), f"unfold's window {kernel} is larger than its input {tuple(x.shape[-2:])}")
    return tuple(x.shape[:-3]) + (x.shape[-3] * kernel[0] * kernel[1], blocks[0] * blocks[1])


# Containers that keep their input's shape: a transformer layer maps (…, L, d) to (…, L, d).
_SHAPE_KEEPING = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder, nn.TransformerDecoder)


def unmodelled_shape(target, args, kwargs):
    """Output shapes (a structure of them for tuple outputs) of torch.nn modules the counting does not model,
    from their settings: running their meta kernels would first import torch's compiler (seconds)."""
    module = _module(target)
    if isinstance(module, nn.RNNBase) and type(module).forward in (nn.RNN.forward, nn.LSTM.forward, nn.GRU.forward):
        return _recurrent_shapes(module, args, kwargs)
    if isinstance(module, nn.RNNCellBase) and type(module).forward in (
        nn.RNNCell.forward,
        nn.LSTMCell.forward,
        nn.GRUCell.forward,
    ):
        return _cell_shapes(module, args, kwargs)
    if type(module) is nn.MultiheadAttention:
        return _attention_module_shapes(module, args, kwargs)
    if type(module) in _SHAPE_KEEPING:
        encoder = isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerEncoder))
        first = _arg(args, kwargs, 0, "src" if encoder else "tgt")
        return tuple(first.shape) if isinstance(first, torch.Tensor) else None
    if type(module) is nn.Bilinear:
        return tuple(args[0].shape[:-1]) + (module.out_features,)
    if type(module) is nn.Unfold:
        return _unfold_shape(args[0], module.kernel_size, module.dilation, module.padding, module.stride)
    if target is F.unfold:
        return _unfold_shape(
            args[0],
            _arg(args, kwargs, 1, "kernel_size"),
            _arg(args, kwargs, 2, "dilation", 1),
            _arg(args, kwargs, 3, "padding", 0),
            _arg(args, kwargs, 4, "stride", 1),
        )
    return None


def _broadcast(first: tuple, second: tuple) -> tuple | None:
    rank = max(len(first), len(second))
    out = []
    for sizes in zip((1,) * (rank - len(first)) + first, (1,) * (rank - len(second)) + second):
        distinct = {d for d in sizes if d != 1}
        if len(distinct) > 1:
            return None
        out.append(distinct.pop() if distinct else 1)
    return tuple(out)


def matmul_shape(target, args, kwargs):
    """torch.matmul's shapes (a @ b, mm, bmm): the contraction of a's last dim with b's, batch dims broadcast.
    None (run the op) for einsum, baddbmm and anything that does not chain."""
    if target not in (torch.matmul, operator.matmul, torch.mm, torch.bmm, "matmul", "mm", "bmm", "__matmul__"):
        return None
    a, b = args[0] if args else None, args[1] if len(args) > 1 else None
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dim() == 0 or b.dim() == 0:
        return None
    if a.shape[-1] != b.shape[-2 if b.dim() > 1 else -1]:
        return None  # let the op raise its own error
    if a.dim() == 1 and b.dim() == 1:
        return ()
    if b.dim() == 1:
        return tuple(a.shape[:-1])
    if a.dim() == 1:
        return tuple(b.shape[:-2]) + (b.shape[-1],)
    batch = _broadcast(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    return None if batch is None else batch + (a.shape[-2], b.shape[-1])
