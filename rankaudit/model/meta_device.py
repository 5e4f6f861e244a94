"""Building a model without weights: the meta-device contexts a model file runs in, its tensors moved to meta."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# In-place ops that nn.init and reset_parameters() use. On meta tensors they change no value, yet the first
# call of several (normal_ above all) imports torch._dynamo: a second or two for nothing. Shapes never change.
_INITIALISERS = frozenset(
    {
        "normal_",
        "uniform_",
        "zero_",
        "fill_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
        "erfinv_",
        "clamp_",
        "clamp_min_",
        "clamp_max_",
        "mul_",
        "add_",
        "sub_",
        "div_",
        "copy_",
        "fmod_",
        "abs_",
        "sqrt_",
        "exp_",
        "neg_",
    }
)
# Factories torch.nn's own layers call for their weights and buffers (torch.empty(out, in) in nn.Linear).
_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "rand", "randn", "tensor"})
_TORCH_NN_DIR = str(Path(nn.__file__).resolve().parent)

# How a model was built, as -v and the JSON's `build` say it.
BUILD_META_PARAMETERS = "meta-parameters"
BUILD_META = "meta"
BUILD_DEVICE = "device"
BUILD_SMALL_CPU = "small-cpu"  # real weights on the CPU, capped at SMALL_CPU_BYTES, then moved to meta

# The most a CPU build may allocate through tensor factories and parameters, counted as they are created: the
# build stops before a request would go past it. Reached only when torch's own code needs weight values while it
# builds (torch.nn.utils.parametrizations.orthogonal checks its weight is orthogonal), never for a model that
# builds on meta.
SMALL_CPU_BYTES = 256 * 1024**2


def _broadcast(*shapes) -> tuple | None:
    rank = max(len(shape) for shape in shapes)
    out = []
    for sizes in zip(*((1,) * (rank - len(shape)) + tuple(shape) for shape in shapes)):
        distinct = {size for size in sizes if size != 1}
        if len(distinct) > 1:
            return None
        out.append(distinct.pop() if distinct else 1)
    return tuple(out)


_BINARY = frozenset(
    {"add", "sub", "mul", "div", "true_divide", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__"}
    | {"__truediv__", "__rtruediv__", "__div__", "__rdiv__"}
)


def _shortcut_shape(name: str, args, kwargs):
    """The output shape and dtype of the torch functions that weight and spectral normalisation compute, or None."""
    first = args[0] if args else None
    if name in _BINARY and len(args) == 2:
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        shape = _broadcast(*shapes) if shapes else None
        return None if shape is None else (shape, torch.result_type(args[0], args[1]))
    if not isinstance(first, torch.Tensor):
        return None
    if name == "norm_except_dim":
        dim = args[2] if len(args) > 2 else kwargs.get("dim", 0)
        if dim == -1:
            return (), first.dtype
        return tuple(size if i == dim % first.dim() else 1 for i, size in enumerate(first.shape)), first.dtype
    if name in ("_weight_norm", "normalize", "clone"):
        return tuple(first.shape), first.dtype
    if name == "mv" and first.dim() == 2:
        return (first.shape[0],), first.dtype
    if name in ("vdot", "dot"):
        return (), first.dtype
    return None


def meta_shortcut(func, args, kwargs):
    """The result of `func` on meta tensors from its shapes alone, for the few functions torch's stock weight
    parametrizations call (weight_norm, spectral_norm), or None: their meta kernels are Python and import torch's
    compiler on first use, seconds for a shape known at once. Only when every tensor argument is on meta."""
    out = kwargs.get("out")
    tensors = [a for a in (*args, out) if isinstance(a, torch.Tensor)]
    if not tensors or not all(t.is_meta for t in tensors):
        return None
    answer = _shortcut_shape(getattr(func, "__name__", ""), args, kwargs)
    if answer is None:
        return None
    if out is not None:  # spectral_norm's power iteration normalises into its buffers (out=)
        return out if isinstance(out, torch.Tensor) and tuple(out.shape) == answer[0] else None
    return torch.empty(answer[0], dtype=answer[1], device="meta")


class MetaShortcuts(TorchFunctionMode):
    """Meta tensors from shapes for the functions meta_shortcut knows; every other call runs as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        shortcut = meta_shortcut(func, args, kwargs)
        return shortcut if shortcut is not None else func(*args, **kwargs)


# Tensor methods that move a tensor to a device: a model factory's `net.to(device)` or `net.cuda()` ends in these.
_MOVES = frozenset({"to", "cuda", "cpu"})


def _stay(func, args, kwargs):
    """A device move of a tensor while building without weights: the tensor stays where it is (meta stays meta,
    and a CPU tensor of the constructor's arithmetic does not need a GPU); a dtype it asks for still applies.
    None: not a device move."""
    name = getattr(func, "__name__", "")
    if name not in _MOVES or not args or not isinstance(args[0], torch.Tensor):
        return None
    tensor = args[0]
    if name != "to":
        return tensor
    try:
        _, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
    except (TypeError, RuntimeError):
        return None  # to(other_tensor) and other forms: as torch does it
    return tensor if dtype is None or dtype == tensor.dtype else func(tensor, dtype)


class _SkipMetaInitialisation(TorchFunctionMode):
    """While a model is built on meta, initialisers are no-ops (there are no values to initialise) and device
    moves (`.to(device)`, `.cuda()`) leave tensors where they are."""

    def __init__(self):
        super().__init__()
        self.failed: tuple[str, BaseException] | None = None  # the last torch function that raised, and how

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            getattr(func, "__name__", "") in _INITIALISERS
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].is_meta
        ):
            return args[0]
        stayed = _stay(func, args, kwargs or {})
        if stayed is not None:
            return stayed
        return self._call(func, args, kwargs or {})

    def _call(self, func, args, kwargs):
        shortcut = meta_shortcut(func, args, kwargs)
        if shortcut is not None:
            return shortcut
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            self.failed = (getattr(func, "__name__", None) or str(func), exc)
            raise


class _MetaParametersOnly(_SkipMetaInitialisation):
    """Parameters live on meta; every other tensor the constructor computes lives on the CPU, for real.

    Constructors compute with tensors (stage widths with torch arithmetic and .tolist(), relative-position
    tables, rotary frequencies) and need their values, which the meta device does not have. Only parameters
    are sure never to be read: they move to meta as they are registered (see _parameters_on_meta), and the
    factories of torch.nn's own layers (torch.empty(out, in) in nn.Linear) go straight to meta, so a
    10-billion-parameter model never allocates its weights even for a moment.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _INITIALISERS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        stayed = _stay(func, args, kwargs)
        if stayed is not None:
            return stayed
        if name in _FACTORIES and kwargs.get("device") is None and _called_from_torch_nn():
            kwargs = {**kwargs, "device": "meta"}
        return self._call(func, args, kwargs)


def _called_from_torch_nn() -> bool:
    # Frame 0 is _called_from_torch_nn, 1 the mode's __torch_function__, 2 whoever called the factory.
    caller = sys._getframe(2)
    return caller.f_code.co_filename.startswith(_TORCH_NN_DIR)


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered meanwhile is replaced by a meta copy (the technique of accelerate's
    init_empty_weights): nn.Module.__setattr__ and register_parameter both end here."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            try:
                moved = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            except TypeError:  # a Parameter subclass with other constructor arguments
                moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


class CPUBuildTooLarge(Exception):
    """A CPU build would allocate more than SMALL_CPU_BYTES."""


# Factories that take a size: (name -> how many leading positional arguments are not the size).
_SIZED_FACTORIES = {
    "empty": 0,
    "zeros": 0,
    "ones": 0,
    "rand": 0,
    "randn": 0,
    "full": 0,
    "new_empty": 1,
    "new_zeros": 1,
    "new_ones": 1,
    "new_full": 1,
}
_LIKE_FACTORIES = frozenset({"empty_like", "zeros_like", "ones_like", "rand_like", "randn_like", "full_like"})


def _requested_bytes(name: str, args, kwargs) -> int:
    """Bytes a factory call is about to allocate (0 when it is no factory the build caps)."""
    if name in _LIKE_FACTORIES and args and isinstance(args[0], torch.Tensor):
        return args[0].numel() * args[0].element_size()
    if name not in _SIZED_FACTORIES:
        return 0
    rest = args[_SIZED_FACTORIES[name] :]
    if "size" in kwargs:
        size = kwargs["size"]
    elif rest and isinstance(rest[0], (tuple, list, torch.Size)):
        size = rest[0]  # zeros((2, 3)), full((2, 3), value)
    else:
        size = rest  # zeros(2, 3)
    if isinstance(size, int):
        size = (size,)
    elements = 1
    for extent in size:
        elements *= int(extent)
    dtype = kwargs.get("dtype") or (args[0].dtype if name.startswith("new_") else torch.get_default_dtype())
    return elements * torch.empty((), dtype=dtype, device="meta").element_size()


class _CappedCPUBuild(_SkipMetaInitialisation):
    """A real build on the CPU that stops before its tensor factories and parameters exceed SMALL_CPU_BYTES."""

    def __init__(self):
        super().__init__()
        self.allocated = 0

    def charge(self, size: int) -> None:
        self.allocated += size
        if self.allocated > SMALL_CPU_BYTES:
            raise CPUBuildTooLarge(f"building it on the CPU would take over {SMALL_CPU_BYTES // 1024**2} MB of tensors")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is None or torch.device(device).type == "cpu":
            self.charge(_requested_bytes(getattr(func, "__name__", ""), args, kwargs))
        return self._call(func, args, kwargs)


@contextlib.contextmanager
def _parameters_charged(mode: _CappedCPUBuild):
    """Parameters registered meanwhile count against the CPU build's cap (those not made by a capped factory)."""
    register = nn.Module.register_parameter

    def register_charged(module, name, param):
        if param is not None and not param.is_meta and name not in module._parameters:
            mode.charge(param.numel() * param.element_size())
        register(module, name, param)

    nn.Module.register_parameter = register_charged
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def building_on(device: str, build: str = BUILD_DEVICE):
    """The context a model file runs in. On meta: either parameters only on meta (the constructor's own
    arithmetic on the CPU), or everything on meta; no initialisation work either way. The small CPU build: real
    tensors, capped at SMALL_CPU_BYTES (CPUBuildTooLarge past it)."""
    stack = contextlib.ExitStack()
    if build == BUILD_SMALL_CPU:
        stack.enter_context(torch.device("cpu"))
        mode = stack.enter_context(_CappedCPUBuild())
        stack.enter_context(_parameters_charged(mode))
        return stack, mode
    if device != "meta":
        stack.enter_context(torch.device(device))
        return stack, None
    if build == BUILD_META_PARAMETERS:
        stack.enter_context(_parameters_on_meta())
        mode = stack.enter_context(_MetaParametersOnly())
    else:
        stack.enter_context(torch.device("meta"))
        mode = stack.enter_context(_SkipMetaInitialisation())
    return stack, mode


def everything_to_meta(model: nn.Module) -> None:
    """After construction, buffers and tensor attributes join the parameters on meta: the trace runs on meta
    and an op cannot mix devices. Nothing reads their values any more (the constructor has finished)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = buffer.to("meta")
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not value.is_meta:
                setattr(module, name, value.to("meta"))
    if any(not p.is_meta for p in model.parameters()):
        # The file loaded real weights (torch.load at import, say); drop them: analysis needs shapes only.
        model.to("meta")


def failing_op(mode, exc: BaseException) -> str | None:
    """The torch function that raised `exc`, when one did (not a ValueError of the user's own)."""
    if mode is None or mode.failed is None:
        return None
    name, raised = mode.failed
    chain, current = set(), exc
    while current is not None and id(current) not in chain:
        chain.add(id(current))
        if current is raised:
            return name
        current = current.__cause__ or current.__context__
    return None
