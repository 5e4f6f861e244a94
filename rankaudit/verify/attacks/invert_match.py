"""What inverting gradients matches and scores: the client's loss and label, the gradient distance, TV, PSNR."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

CROSS_ENTROPY = "cross-entropy"
LOGISTIC = "logistic"
LOSS_KINDS = (CROSS_ENTROPY, LOGISTIC)


@dataclass(frozen=True)
class LossSpec:
    """The client's loss and, when the attacker knows it, the label.

    ``kind`` is ``"cross-entropy"`` (``label`` a class index) or ``"logistic"``
    (one logit ``mu``, ``label`` in {-1, +1}, loss ``log(1 + exp(-label * mu))``).
    ``label=None`` means the attacker infers it from the gradient.
    """

    kind: str = CROSS_ENTROPY
    label: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.kind!r}; expected one of {LOSS_KINDS}")
        if self.kind == LOGISTIC and self.label not in (None, -1, 1):
            raise ValueError(f"a logistic label must be -1 or +1, got {self.label!r}")
        if self.kind == CROSS_ENTROPY and self.label is not None and int(self.label) < 0:
            raise ValueError(f"a class index must be non-negative, got {self.label!r}")


def as_loss_spec(label_or_loss_spec: LossSpec | str | int) -> LossSpec:
    """A bare int is a cross-entropy class label; a bare string names a loss whose label is inferred."""
    if isinstance(label_or_loss_spec, LossSpec):
        return label_or_loss_spec
    if isinstance(label_or_loss_spec, str):
        return LossSpec(kind=label_or_loss_spec)
    if isinstance(label_or_loss_spec, bool):
        raise TypeError("a label must be an int, not a bool")
    if isinstance(label_or_loss_spec, int):
        return LossSpec(kind=CROSS_ENTROPY, label=label_or_loss_spec)
    raise TypeError(f"expected a LossSpec, a loss name or a class label, got {label_or_loss_spec!r}")


def client_loss(output: torch.Tensor, label: int, kind: str) -> torch.Tensor:
    """The loss of one sample, as the client computes it for its update."""
    if kind == CROSS_ENTROPY:
        logits = output.reshape(1, -1)
        target = torch.tensor([int(label)], device=output.device)
        return F.cross_entropy(logits, target)
    if kind == LOGISTIC:
        if output.numel() != 1:
            raise ValueError(f"the logistic loss needs a single logit, the model gave {output.numel()}")
        # softplus(-y*mu) is log(1 + exp(-y*mu)) without overflow for large margins.
        return F.softplus(-float(label) * output.reshape(()))
    raise ValueError(f"unknown loss {kind!r}; expected one of {LOSS_KINDS}")


def infer_label_idlg(last_weight_grad: torch.Tensor, last_bias_grad: torch.Tensor | None = None) -> int:
    """The true class of one sample from the gradient of the output Linear layer (the iDLG sign rule).

    With softmax cross-entropy the gradient of the output layer's row ``j`` is
    ``(p_j - [j == y]) * h`` for the layer's input ``h``: only the true class has a
    negative coefficient.  The bias gradient is that coefficient vector itself, so
    when it is given the answer is exact.  Without a bias, iDLG reads the sign off
    the row sums, which assumes ``h >= 0`` (a ReLU before the head).  Here the rows'
    pairwise inner products ``(p_i - [i == y])(p_j - [j == y]) |h|^2`` are used
    instead: the true row is the one anti-aligned with every other row, whatever
    the sign of ``h``.  Two classes make that symmetric, and then the row-sum rule
    (and its ``h >= 0`` assumption) decides.
    """
    if last_bias_grad is not None and last_bias_grad.numel() > 1 and bool(last_bias_grad.ne(0).any()):
        return int(torch.argmin(last_bias_grad.detach().reshape(-1)).item())
    rows = last_weight_grad.detach().reshape(last_weight_grad.shape[0], -1).double()
    if rows.shape[0] < 2:
        raise ValueError("cross-entropy label inference needs an output layer with at least two classes")
    if rows.shape[0] > 2:
        gram = rows @ rows.T
        alignment_with_others = gram.sum(dim=1) - gram.diagonal()
        return int(torch.argmin(alignment_with_others).item())
    return int(torch.argmin(rows.sum(dim=1)).item())


def infer_label_logistic(
    last_weight_grad: torch.Tensor | None = None, last_bias_grad: torch.Tensor | None = None
) -> int | None:
    """The label in {-1, +1} of one sample under the logistic loss, or None when the gradient cannot tell.

    ``d loss / d mu = -y * sigmoid(-y * mu)`` has the sign of ``-y``, and the bias
    gradient of the output layer equals it, so a bias gives the label exactly.
    The weight gradient is ``d loss / d mu * h``; its sign also depends on the
    unknown features ``h`` (negative entries are common after LeakyReLU), so
    without a bias no label is claimed and the caller must try both.
    ``last_weight_grad`` is accepted for symmetry with :func:`infer_label_idlg`.
    """
    del last_weight_grad  # see the docstring: on its own it does not determine the sign
    if last_bias_grad is None:
        return None
    value = float(last_bias_grad.detach().reshape(-1)[0])
    if value == 0.0:
        return None
    return -1 if value > 0 else 1


def find_output_linear(model: nn.Module, probe: torch.Tensor) -> tuple[str, str | None] | None:
    """Parameter names ``(weight, bias)`` of the nn.Linear whose output is the model's output, if any."""
    module_names = {id(module): name for name, module in model.named_modules()}
    calls: list[tuple[nn.Module, torch.Tensor]] = []

    def remember(module: nn.Module, _inputs, output) -> None:
        calls.append((module, output))

    handles = [m.register_forward_hook(remember) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model_output = model(probe)
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        return None
    module, linear_output = calls[-1]
    same_values = linear_output.shape == model_output.shape and torch.equal(linear_output, model_output)
    if linear_output is not model_output and not same_values:
        return None
    prefix = module_names[id(module)]
    prefix = f"{prefix}." if prefix else ""
    bias_name = f"{prefix}bias" if module.bias is not None else None
    return f"{prefix}weight", bias_name


def gradient_distances(dummy_grads: Sequence[torch.Tensor], unit_targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per candidate, 1 - cosine similarity of its gradient and its target, each taken as one vector over all layers.

    Every tensor carries the candidates along dimension 0; ``unit_targets`` are
    already scaled to unit length (:func:`unit_gradient`).  Computed as half the
    squared distance between the two unit vectors, which is the same number
    whenever both gradients are nonzero.  Written as ``1 - dot`` it cancels
    catastrophically near a match: in float32 it reads 0 once the gradients
    agree to about 3e-4, and the attack stops getting a signal long before the
    input is pinned down.
    """
    dummy_norm = torch.sqrt(sum(g.pow(2).flatten(1).sum(1) for g in dummy_grads))
    # The floor keeps the objective finite and differentiable at an all-zero gradient.
    dummy_scale = 1.0 / dummy_norm.clamp_min(1e-30)
    squared = sum(
        (g * dummy_scale.view((-1,) + (1,) * (g.dim() - 1)) - t).pow(2).flatten(1).sum(1)
        for g, t in zip(dummy_grads, unit_targets)
    )
    return 0.5 * squared


def unit_gradient(target_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One sample's gradient scaled to unit length over all its layers (left at zero when it is all zero)."""
    norm = torch.sqrt(sum(t.pow(2).sum() for t in target_grads))
    scale = 1.0 / norm.clamp_min(1e-30)
    return [t * scale for t in target_grads]


def total_variations(images: torch.Tensor) -> torch.Tensor:
    """Per image of a [K, C, H, W] batch, the mean absolute difference between vertically and horizontally adjacent pixels."""
    vertical = (images[..., 1:, :] - images[..., :-1, :]).abs().flatten(1).mean(1)
    horizontal = (images[..., :, 1:] - images[..., :, :-1]).abs().flatten(1).mean(1)
    return vertical + horizontal


def _coded_loss(output: torch.Tensor, code: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`client_loss` with the label given as data (see ``_BatchedInversion._codes``), so it can be vmapped."""
    if kind == CROSS_ENTROPY:
        return -(F.log_softmax(output.reshape(-1), dim=0) * code).sum()
    # softplus(-y*mu) is log(1 + exp(-y*mu)) without overflow for large margins.
    return F.softplus(-code * output.reshape(()))


def _shared_names(model: nn.Module, target_grads: dict[str, torch.Tensor]) -> list[str]:
    """The model's parameters that ``target_grads`` covers, in the model's order; shapes checked."""
    parameters = dict(model.named_parameters())
    unknown = sorted(set(target_grads) - set(parameters))
    if unknown:
        raise KeyError(f"target_grads names parameters the model does not have: {unknown[:5]}")
    names = [name for name in parameters if name in target_grads]
    if not names:
        raise ValueError("target_grads shares no parameter with the model")
    for name in names:
        if parameters[name].shape != target_grads[name].shape:
            raise ValueError(
                f"gradient for {name} has shape {tuple(target_grads[name].shape)}, "
                f"the parameter {tuple(parameters[name].shape)}"
            )
    return names


def _unit_targets(
    target_grads: dict[str, torch.Tensor], names: list[str], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    return unit_gradient([target_grads[name].detach().to(device=device, dtype=dtype) for name in names])


def _candidate_labels(
    model: nn.Module,
    target_grads: dict[str, torch.Tensor],
    spec: LossSpec,
    sample_shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> list[int]:
    if spec.label is not None:
        return [int(spec.label)]
    probe = torch.zeros((1,) + sample_shape, device=device, dtype=dtype)
    output_layer = find_output_linear(model, probe)
    weight_grad = bias_grad = None
    if output_layer is not None:
        weight_name, bias_name = output_layer
        weight_grad = target_grads.get(weight_name)
        bias_grad = target_grads.get(bias_name) if bias_name is not None else None
    if spec.kind == CROSS_ENTROPY:
        if weight_grad is None and bias_grad is None:
            raise ValueError(
                "cannot infer the class: the model's output is not produced by an nn.Linear whose "
                "gradient is in target_grads; pass the label explicitly"
            )
        if weight_grad is None:
            return [int(torch.argmin(bias_grad.reshape(-1)).item())]
        return [infer_label_idlg(weight_grad, bias_grad)]
    label = infer_label_logistic(weight_grad, bias_grad)
    return [label] if label is not None else [1, -1]


def psnr_from_mse(mse: float, peak: float = 1.0) -> float:
    return math.inf if mse <= 0 else 10.0 * math.log10(peak * peak / mse)
