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


def building_on(device: str, build: str = BUILD_DEVICE):
    """The context a model file runs in. On meta: either parameters only on meta (the constructor's own
    arithmetic on the CPU), or everything on meta; no initialisation work either way."""
    stack = contextlib.ExitStack()
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
