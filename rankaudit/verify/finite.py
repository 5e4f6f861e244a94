"""Finite numbers or none: every verifier checks the model's output and shared gradient, and names the op that broke.

An SVD of a sketch with a NaN fails to converge, and an attack matched to a NaN gradient still reports an MSE; neither
is a figure. So each verifier calls :func:`require_finite` on the output and the gradient it computed at its inputs.
When something is not finite, the model is run once more under :class:`_Locator`, which watches every torch call of
the forward pass (a ``TorchFunctionMode``, with module hooks naming the module that made the call) and every node of
the backward pass (a post-hook per autograd node), and the first op whose inputs were finite and whose output was not
is named in a one-line :class:`NonFiniteError` (exit 3). Found by re-running with checks, never by guessing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rankaudit.errors import ModelLoadError

FIX = (
    "make the model finite at these inputs (guard sqrt/log/division at 0, e.g. add an eps), or check the weights "
    "the model file loads"
)


class NonFiniteError(ModelLoadError):
    """The model's output or shared gradient holds NaN or Inf at the verifier's inputs (exit 3)."""


def tensors_in(value: Any) -> list[torch.Tensor]:
    """Every floating-point tensor in a value: a tensor, a dict, a list/tuple, a model output with .logits."""
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() or value.is_complex() else []
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_in(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in tensors_in(item)]
    if hasattr(value, "logits"):
        return tensors_in(value.logits)
    return []


def all_finite(*values: Any) -> bool:
    """True when every floating-point tensor in ``values`` is finite (one reduction per tensor, one host sync)."""
    checks = [torch.isfinite(t.detach()).all() for value in values for t in tensors_in(value)]
    if not checks:
        return True
    return bool(torch.stack([c.to("cpu") for c in checks]).all()) if len(checks) > 1 else bool(checks[0])


def require_finite(
    verifier: str,
    output: Any,
    gradients: Any,
    *,
    model: nn.Module,
    rerun: Callable[[], tuple[Any, torch.Tensor]],
    parameters: Sequence[torch.Tensor],
    inputs: Any = None,
) -> None:
    """Raise NonFiniteError unless ``output`` and ``gradients`` are finite.

    ``rerun()`` repeats the verifier's forward pass and loss at the same inputs, returning (output, loss);
    ``parameters`` are the tensors the shared gradient is taken with respect to. Both are used only when something
    is not finite, to find the first op that produced it.
    """
    if all_finite(output, gradients):
        return
    raise locate(verifier, model, rerun, parameters, inputs=inputs)


def locate(
    verifier: str,
    model: nn.Module,
    rerun: Callable[[], tuple[Any, torch.Tensor]],
    parameters: Sequence[torch.Tensor],
    *,
    inputs: Any = None,
) -> NonFiniteError:
    """Re-run the forward and backward pass with checks; the error naming the first non-finite value's source."""
    if inputs is not None and not all_finite(inputs):
        return NonFiniteError(f"{verifier}: the inputs hold NaN or Inf", "give finite inputs (--data)")
    names = {id(p): name for name, p in model.named_parameters()}
    for parameter in parameters:
        if not all_finite(parameter):
            name = names.get(id(parameter), "a shared parameter")
            return NonFiniteError(f"{verifier}: the weight {name} holds NaN or Inf before any op runs", FIX)
    locator = _Locator(model)
    with torch.enable_grad():
        with locator:
            output, loss = rerun()
        culprit = locator.forward_culprit
        if culprit is None and not all_finite(output, loss):
            culprit = "an op the checks could not see (not a torch call from Python)"
        if culprit is not None:
            return NonFiniteError(
                f"{verifier}: the forward pass is not finite at the inputs: first NaN/Inf from {culprit}", FIX
            )
        hooks = locator.watch_backward(loss)
        try:
            wanted = [p for p in parameters if p.requires_grad]
            torch.autograd.grad(loss, wanted, allow_unused=True)
        finally:
            for hook in hooks:
                hook.remove()
    if locator.backward_culprit is not None:
        return NonFiniteError(
            f"{verifier}: the shared gradient is not finite at the inputs (the forward pass is): "
            f"first NaN/Inf from {locator.backward_culprit}",
            FIX,
        )
    return NonFiniteError(
        f"{verifier}: the model's output or shared gradient is not finite at the inputs, but a "
        "second run with checks produced finite values (the model is not deterministic)",
        FIX,
    )


def _op_name(func) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    name = (
        name.replace("_VariableFunctionsClass.", "")
        .replace("_TensorBase.", "Tensor.")
        .replace("TensorBase.", "Tensor.")
    )
    module = getattr(func, "__module__", None) or ""
    if module.startswith("torch.nn.functional"):
        return f"F.{name}"
    if "." not in name and (module.startswith("torch") or module == ""):
        return f"torch.{name}"
    return name


class _Locator(TorchFunctionMode):
    """Records, for one forward pass, the first torch call that turned finite inputs into a non-finite output, and
    which call (and module) created each autograd node, so a backward hook can name the node that broke."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.module_names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self.stack: list[str] = []
        self.forward_culprit: str | None = None
        self.backward_culprit: str | None = None
        self.made_by: dict[int, str] = {}  # id(autograd node) -> "torch.sqrt in module act"
        self.nodes: list = []  # kept alive so their ids stay unique
        self._handles: list = []

    def __enter__(self):
        self._handles = [
            nn.modules.module.register_module_forward_pre_hook(self._enter_module),
            nn.modules.module.register_module_forward_hook(self._leave_module),
        ]
        return super().__enter__()

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        return super().__exit__(*exc)

    def _enter_module(self, module, args):
        self.stack.append(self.module_names.get(id(module), type(module).__name__))

    def _leave_module(self, module, args, output):
        if self.stack:
            self.stack.pop()

    def _where(self, func) -> str:
        place = f" in module {self.stack[-1]}" if self.stack else " (outside any module: the loss)"
        return f"{_op_name(func)}{place}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        produced = tensors_in(result)
        if not produced:
            return result
        where = None
        for tensor in produced:
            node = tensor.grad_fn
            if node is not None and id(node) not in self.made_by:
                where = where or self._where(func)
                self.made_by[id(node)] = where
                self.nodes.append(node)
        if self.forward_culprit is None and not all_finite(result) and all_finite(list(args), kwargs):
            self.forward_culprit = where or self._where(func)
        return result

    def watch_backward(self, loss: torch.Tensor) -> list:
        """A post-hook on every node of loss's backward graph: the first node whose incoming gradients are finite
        and whose outgoing ones are not is the culprit (hooks run in execution order)."""
        hooks, seen, stack = [], set(), [loss.grad_fn]
        while stack:
            node = stack.pop()
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            hooks.append(node.register_hook(self._backward_check(node)))
            stack.extend(next_node for next_node, _ in node.next_functions)
        return hooks

    def _backward_check(self, node):
        def hook(grad_inputs, grad_outputs):
            if self.backward_culprit is not None:
                return
            incoming = [g for g in grad_outputs if g is not None]
            outgoing = [g for g in grad_inputs if g is not None]
            if all_finite(incoming) and not all_finite(outgoing):
                made = self.made_by.get(id(node))
                self.backward_culprit = (
                    f"the backward of {made} ({node.name()})" if made else f"the backward node {node.name()}"
                )

        return hook


def sketch_error(verifier: str) -> NonFiniteError:
    """The first-order gradient is finite but its derivative (a row of the rank sketch) is not."""
    return NonFiniteError(
        f"{verifier}: the derivative of the shared gradient is not finite at the inputs (the "
        "output and the gradient are): an op's second derivative overflows there, so no rank is "
        "reported",
        FIX,
    )
