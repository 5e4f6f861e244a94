"""The mode a hidden layer's features' Jacobian is formed under (docs/method.md, "The client-side guard"): every
ReLU's kink counted as on, and every path from the sample to the features that autograd would not follow made
visible or noticed.

The features' figure is the part of the sample in their Jacobian's row space, the Jacobian of the values the
forward pass computes. A stop-gradient is not part of those values: detach(), .data and work under no_grad are
followed as if they were not there, the model's gradient hooks are not registered, and its module backward hooks
are set aside while the Jacobian is formed. A value computed from the sample that still escapes autograd (a step
whose gradient is zero, a copy without its gradient, integers, lists of Python numbers) counts only if it reaches
the features: then they count as the sample.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn
from torch.nn.modules import module as module_hooks


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

    def __init__(self, probe: bool = False):
        super().__init__()
        # Only while ``watching``: a backward's own operations run without grad, and they are not the model's.
        self.hidden: str | None = None
        self.watching = True
        # With ``probe``: each value computed from the sample that escapes autograd is replaced by a leaf holding
        # the same values, (leaf, what the model did), so that a backward from the features says whether it
        # reaches them (reaching()).
        self.probe = probe
        self.leaves: list[tuple[torch.Tensor, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.watching:
            return self._run(func, args, kwargs)
        followed = _followed(func, args)
        if followed is not None:
            return followed
        name = getattr(func, "__name__", "")
        if name in _GRADIENT_HOOKS and _from_sample(args[0] if args else None):
            return _NotRegistered()  # the gradient is the forward pass's own, not what a hook makes of it
        if self.hidden is None:
            self.hidden = hidden_before(func, args)
        unstopped = _under_no_grad(func, args)
        if unstopped:
            with torch.enable_grad():  # no_grad is a stop-gradient: the values still follow the sample
                result = self._run(func, args, kwargs)
        else:
            result = self._run(func, args, kwargs)
        if self.hidden is None:
            self.hidden = hidden_after(func, args, result)
        escaped = _escaped(func, args, result, unstopped or torch.is_grad_enabled(), kwargs)
        if escaped is not None and name.endswith("_") and not name.endswith("__") and self.hidden is None:
            self.hidden = escaped  # done in place: the model keeps the tensor, so no leaf can stand in for it
        if escaped is not None and self.probe:
            leaf = result.detach().requires_grad_(True)
            self.leaves.append((leaf, escaped))
            return leaf
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
    + ["element_size", "is_contiguous", "get_device", "data_ptr", "storage_offset"]
)
# New tensors shaped like one computed from the sample that hold none of its values.
_SHAPED_LIKE = frozenset(
    ["zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "new_zeros"]
    + ["new_ones", "new_empty", "new_full", "new_empty_strided", "empty_strided"]
)
# Operations whose value follows their input in steps and whose gradient is zero wherever it exists: the value
# tells where the sample lies, the gradient nothing. (Comparisons are not here: a mask that gates the values it was
# taken from is a ReLU's kink, and it is counted as one.)
_STEPS = frozenset(
    ["round", "floor", "ceil", "trunc", "fix", "sign", "sgn", "signbit", "heaviside", "floor_divide", "bucketize"]
    + ["searchsorted", "histc", "__floordiv__", "__rfloordiv__", "__ifloordiv__"]
)


def _is_step(name: str) -> bool:
    """Whether an operation's name (in place or not) is one of the steps."""
    return name in _STEPS or name.rstrip("_") in _STEPS


# Many Python numbers at once: once out of a tensor, nothing follows where they go. (A single number, a check or a
# logged statistic, cannot show a sample.)
_NUMBERS = frozenset(["tolist"])
# Conversions that can turn the values into integers (the result's dtype says whether they did).
_CONVERSIONS = frozenset(
    ["to", "type", "type_as", "long", "int", "short", "char", "byte", "view", "view_as", "frexp"]
    + ["quantize_per_tensor", "quantize_per_channel"]
)
# Divisions that round their quotient (rounding_mode "floor" or "trunc"): steps too.
_DIVISIONS = frozenset(["div", "divide"])
_GRADIENT_HOOKS = frozenset(["register_hook", "register_post_accumulate_grad_hook"])


class _NotRegistered:
    """What a gradient hook the model asked for returns instead of its handle: there is nothing to remove."""

    def remove(self):
        return None


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


def _followed(func, args) -> torch.Tensor | None:
    """A stop-gradient on a value computed from the sample (detach(), detach_(), .data) as the value it stops,
    still followed by autograd; None for any other operation."""
    first = args[0] if args else None
    if not _from_sample(first):
        return None
    if func in _DETACHES and getattr(func, "__name__", "") == "detach_":
        return first
    if func in _DETACHES or func == _DATA:
        return first.view_as(first)
    return None


def _under_no_grad(func, args) -> bool:
    """An operation on a value computed from the sample, run under no_grad by the model (not by a custom autograd
    Function's forward, whose own backward gives the gradient, and not a question about the tensor's metadata)."""
    return (
        not torch.is_grad_enabled()
        and getattr(func, "__name__", "") not in _METADATA
        and any(_from_sample(value) for value in _tensors(args))
        and not _in_custom_function()
    )


def hidden_before(func, args) -> str | None:
    """How an operation about to run takes values computed from the sample out of tensors altogether, or None."""
    name = getattr(func, "__name__", "")
    if name in _NUMBERS and _from_sample(args[0] if args else None) and not _in_custom_function():
        return f"takes Python numbers from a value computed from the sample (.{name}())"
    return None


def hidden_after(func, args, result) -> str | None:
    """How an operation that ran turned a value computed from the sample into integers (which carry no gradient),
    or None."""
    name = getattr(func, "__name__", "")
    stepped = _is_step(name)
    if not (stepped or name.rstrip("_") in _CONVERSIONS):
        return None
    results = _tensors(result if isinstance(result, (tuple, list)) else (result,))
    integers = any(
        value.is_quantized or not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
        for value in results
    )
    if integers and any(_from_sample(value) for value in _tensors(args)) and not _in_custom_function():
        return f"turns a value computed from the sample into integers ({name}: no gradient)"
    return None


def _escaped(func, args, result, with_grad: bool, kwargs=None) -> str | None:
    """What an operation that ran (``with_grad``: with grad enabled) did when its floating result holds values
    computed from the sample that autograd does not follow to it (a step whose gradient is zero, or a result without
    a gradient at all), or None."""
    if not (isinstance(result, torch.Tensor) and result.is_floating_point()):
        return None
    name = getattr(func, "__name__", "")
    # new_tensor's data is its argument; the tensor it is called on gives only the dtype and device.
    sources = args[1:2] if name == "new_tensor" else args
    if not any(_from_sample(value) and value.is_floating_point() for value in _tensors(sources)):
        return None
    rounded = name.rstrip("_") in _DIVISIONS and (kwargs or {}).get("rounding_mode") in ("floor", "trunc")
    if _is_step(name) or rounded:
        if _in_custom_function():
            return None
        return f"rounds a value computed from the sample ({name}, whose gradient is zero)"
    if not result.requires_grad and with_grad and name not in _SHAPED_LIKE and not _in_custom_function():
        return f"copies a value computed from the sample without its gradient ({name})"
    return None


def reaching(mode: KinksCountOn, features: torch.Tensor) -> str | None:
    """What the model did to the first value that escaped autograd (mode.leaves) and reaches ``features``, or None:
    a backward of a random mix of the features gives that leaf a non-zero gradient exactly when it reaches them."""
    if not mode.leaves or not features.requires_grad:
        return None
    mix = torch.randn(features.shape, generator=torch.Generator().manual_seed(0), dtype=features.dtype)
    leaves = [leaf for leaf, _ in mode.leaves]
    grads = torch.autograd.grad((features * mix).sum(), leaves, allow_unused=True, retain_graph=True)
    for (_, what), grad in zip(mode.leaves, grads):
        if grad is not None and bool(grad.any()):
            return what
    return None


@contextlib.contextmanager
def without_backward_hooks(net: nn.Module):
    """The model's module backward hooks, and any registered for every module, set aside: the features' Jacobian is
    their forward pass's, not what a hook makes of its gradient. Saved-tensor hooks the model would register raise,
    and the Jacobian is then not formed."""
    kept = [(module, module._backward_hooks.copy(), module._backward_pre_hooks.copy()) for module in net.modules()]
    everywhere = (module_hooks._global_backward_hooks.copy(), module_hooks._global_backward_pre_hooks.copy())
    try:
        for module, _, _ in kept:
            module._backward_hooks.clear()
            module._backward_pre_hooks.clear()
        module_hooks._global_backward_hooks.clear()
        module_hooks._global_backward_pre_hooks.clear()
        with torch.autograd.graph.disable_saved_tensors_hooks(
            "saved-tensor hooks change what autograd computes from the sample"
        ):
            yield
    finally:
        for module, hooks, pre_hooks in kept:
            module._backward_hooks.update(hooks)
            module._backward_pre_hooks.update(pre_hooks)
        module_hooks._global_backward_hooks.update(everywhere[0])
        module_hooks._global_backward_pre_hooks.update(everywhere[1])


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
