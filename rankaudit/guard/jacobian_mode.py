"""The mode a hidden layer's features' Jacobian is formed under (docs/method.md, "The client-side guard"): every
ReLU's kink counted as on, and every path from the sample to the features that autograd does not see noticed.

The features' figure is the part of the sample in their Jacobian's row space. A value computed from the sample
that reaches the features around autograd (detached, under no_grad, rounded, turned into integers or Python
numbers) tells the server more than that Jacobian shows, so the forward pass that forms it is watched, and such a
path makes the features count as the sample.
"""

from __future__ import annotations

import sys

import torch


class _OnAtZero(torch.autograd.Function):
    """max(x, 0) whose derivative at exactly 0 is 1, not 0. A ReLU whose input sits exactly at its kink (a pixel of
    0 passed through a filter without a bias, as digits' backgrounds are) tells the server that input is not above
    0, and a sample that never goes below 0 is then known there; counting that unit as on keeps what it tells in
    the features' row space, so the figure errs towards a higher value, never a lower one."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return x.clamp_min(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (x >= 0).to(grad.dtype)


class KinksCountOn(torch.overrides.TorchFunctionMode):
    """While the features' Jacobian is formed: every ReLU (torch.relu, F.relu, nn.ReLU, in place or not, clamp at a
    minimum of 0, a threshold of 0 to 0, and torch.where(h > 0, h, 0)) as _OnAtZero. A ReLU spelled as a product
    with its own mask (h * (h > 0)) is not seen. While ``watching``, ``hidden`` says how the forward pass first hid a
    value computed from the sample from autograd, if it did."""

    RELUS = (torch.relu, torch.nn.functional.relu, torch.Tensor.relu)
    IN_PLACE = (torch.relu_, torch.nn.functional.relu_, torch.Tensor.relu_)
    CLAMPS = (torch.clamp, torch.Tensor.clamp, torch.clamp_min, torch.Tensor.clamp_min)
    THRESHOLDS = (torch.threshold, torch.nn.functional.threshold)
    WHERES = (torch.where,)

    def __init__(self):
        super().__init__()
        # Only while ``watching``: a backward's own operations run without grad, and they are not the model's.
        self.hidden: str | None = None
        self.watching = True

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        watching = self.watching and self.hidden is None
        if watching:
            self.hidden = hidden_before(func, args)
        result = self._run(func, args, kwargs)
        if watching and self.hidden is None:
            self.hidden = hidden_after(func, args, result)
        return result

    def _run(self, func, args, kwargs):
        if func in self.RELUS and len(args) in (1, 2) and isinstance(args[0], torch.Tensor):
            if kwargs.get("inplace") or (len(args) == 2 and args[1] is True):
                return self._in_place(args[0])
            return _OnAtZero.apply(args[0])
        if func in self.IN_PLACE and len(args) == 1 and isinstance(args[0], torch.Tensor):
            return self._in_place(args[0])
        if func in self.WHERES and len(args) == 3 and isinstance(args[1], torch.Tensor) and _zero(args[2]):
            # torch.where(h > 0, h, 0): where h is exactly 0 both branches give 0, and the gradient goes to h.
            condition, kept, other = args
            if kept.is_floating_point() and isinstance(condition, torch.Tensor):
                return func(condition | (kept == 0), kept, other)
        if func in self.THRESHOLDS and len(args) >= 3 and isinstance(args[0], torch.Tensor):
            if args[1] == 0 and args[2] == 0 and not kwargs.get("inplace") and not (len(args) > 3 and args[3]):
                return _OnAtZero.apply(args[0])  # nn.Threshold(0, 0): a ReLU
        if func in self.CLAMPS and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            low = args[1] if len(args) > 1 else kwargs.get("min")
            high = args[2] if len(args) > 2 else kwargs.get("max")
            if isinstance(low, (int, float)) and low == 0 and high is None:
                return _OnAtZero.apply(args[0])
        return func(*args, **kwargs)

    @staticmethod
    def _in_place(x):
        x.copy_(_OnAtZero.apply(x.clone()))
        return x


class HiddenPath(Exception):
    """The model hides a path from the sample to the features from autograd: their Jacobian would not see it."""


_DETACHES = (torch.Tensor.detach, torch.Tensor.detach_, torch.detach)
_DATA = torch._C.TensorBase.data.__get__
# What a tensor is, not what it holds: asked under no_grad (rotary embeddings ask their input's device and dtype),
# it carries nothing of the sample.
_METADATA = frozenset(
    ["size", "dim", "ndimension", "numel", "nelement", "is_floating_point", "is_complex", "__len__", "stride"]
    + ["element_size", "is_contiguous", "get_device", "data_ptr", "storage_offset", "__get__"]
)
# Operations whose value follows their input in steps and whose gradient is zero wherever it exists: the value
# tells where the sample lies, the gradient nothing. (Comparisons are not here: a mask that gates the values it was
# taken from is a ReLU's kink, and it is counted as one.)
_STEPS = frozenset(
    ["round", "floor", "ceil", "trunc", "fix", "sign", "sgn", "signbit", "heaviside", "floor_divide", "bucketize"]
    + ["searchsorted", "histc", "__floordiv__", "__rfloordiv__", "__ifloordiv__"]
)
# Python numbers: once out of a tensor, nothing follows where they go.
_NUMBERS = frozenset(["item", "tolist", "__int__", "__float__", "__index__", "__complex__"])
# Conversions that can turn the values into integers (the result's dtype says whether they did).
_CONVERSIONS = frozenset(["to", "type", "type_as", "long", "int", "short", "char", "byte", "new_tensor"])


def _from_sample(value) -> bool:
    """A tensor whose values autograd follows back to the sample (the guard's copy of the model holds its weights
    without gradients, so only the sample's own path has them)."""
    return isinstance(value, torch.Tensor) and value.requires_grad


def _tensors(args) -> list[torch.Tensor]:
    """The tensors among ``args``, and in lists and tuples among them (torch.cat's first argument)."""
    found = []
    for value in args:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found


def hidden_before(func, args) -> str | None:
    """How an operation about to run hides a value computed from the sample from autograd (its result still
    depends on the sample, its gradient does not), or None."""
    first = args[0] if args else None
    if _from_sample(first) and func in _DETACHES:
        return "detaches a value computed from the sample (detach)"
    if _from_sample(first) and func == _DATA:
        return "reads a value computed from the sample through .data"
    name = getattr(func, "__name__", "")
    sampled = any(_from_sample(value) for value in _tensors(args))
    stepped = name in _STEPS or name.rstrip("_") in _STEPS
    numbers = name in _NUMBERS and _from_sample(first)
    blind = not torch.is_grad_enabled() and name not in _METADATA
    # A custom autograd.Function's forward runs without grad, and its own backward gives the gradient.
    if not (sampled and (stepped or numbers or blind)) or _in_custom_function():
        return None
    if numbers:
        return f"takes a Python number from a value computed from the sample (.{name}())"
    if stepped:
        return f"rounds a value computed from the sample ({name}, whose gradient is zero)"
    return "computes with a value from the sample under torch.no_grad"


def hidden_after(func, args, result) -> str | None:
    """How an operation that ran turned a value computed from the sample into integers (which carry no gradient),
    or None."""
    name = getattr(func, "__name__", "")
    if name.rstrip("_") not in _CONVERSIONS or not isinstance(result, torch.Tensor):
        return None
    integers = not (result.is_floating_point() or result.is_complex() or result.dtype == torch.bool)
    if integers and any(_from_sample(value) for value in _tensors(args)) and not _in_custom_function():
        return f"turns a value computed from the sample into integers (.{name}(): no gradient)"
    return None


def _in_custom_function() -> bool:
    """Whether a custom autograd.Function's forward is running (autograd runs it without grad, and its own backward
    gives the gradient): a frame of torch's Function.apply is on the stack."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "apply" and code.co_filename.endswith(("autograd/function.py", "autograd\\function.py")):
            return True
        frame = frame.f_back
    return False


def _zero(value) -> bool:
    """A scalar 0, or a tensor of zeros."""
    if isinstance(value, torch.Tensor):
        return value.numel() > 0 and not bool(value.any())
    return isinstance(value, (int, float)) and value == 0
