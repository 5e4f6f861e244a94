"""What a hidden layer's features determine of the sample they were computed from, at the received weights
(docs/method.md, "The client-side guard").

A server that reads sample s's features h(x_s) exactly knows, to first order, x_s's component in the row space of
J = ∂h/∂x at x_s; the component of x_s − μ outside it (μ the batch's mean) stays unknown, and an attacker that fills
it with μ makes an error of exactly that size. The PSNR of μ + P_row(J)(x_s − μ) against x_s is the figure: at or
above the guard's threshold the features are as good as the sample.

J is formed row by row (one batched vector-Jacobian product per chunk of features), only for the samples whose
features some readout read; when it would not fit in memory the sample counts as read and the note says so.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rankaudit.guard.pairs import IDENTICAL_PSNR
from rankaudit.verify.attacks.bias import sample_vectors

# Rows of J per batched backward pass.
ROWS_PER_PASS = 64
# The most entries of J held at once (float32): 1 GB.
MAX_JACOBIAN_VALUES = 1 << 28
# A singular value of J counts in its rank above this share of the largest (float32 rows are exact to about
# 1e-7): erring towards a larger row space, which errs towards a higher figure.
RANK_SHARE = 1e-6


def _features(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    seen = []
    hook = module.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    try:
        net(x[None])
    finally:
        hook.remove()
    return sample_vectors(module, seen[0])[0]


def determined_psnr(
    net: nn.Module, module: nn.Module, samples: torch.Tensor, indices: list[int]
) -> tuple[dict[int, float], list[str]]:
    """({sample: PSNR of what the layer's features determine of it}, notes); ``net`` holds the received weights,
    ``module`` is the layer whose input the features are."""
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    x_all = samples.detach().to(dtype)
    mean = x_all.to(torch.float64).mean(0).flatten()
    found, notes = {}, []
    for index in indices:
        x = x_all[index].clone().requires_grad_(True)
        with torch.enable_grad():
            h = _features(net, module, x)
            if h.numel() * x.numel() > MAX_JACOBIAN_VALUES:
                found[index] = IDENTICAL_PSNR
                notes.append(
                    f"sample {index}: the Jacobian of {h.numel()} features in {x.numel()} inputs does not fit in "
                    "memory; its features count as the sample"
                )
                continue
            rows = []
            eye = torch.eye(h.numel(), dtype=h.dtype)
            for start in range(0, h.numel(), ROWS_PER_PASS):
                chunk = eye[start : start + ROWS_PER_PASS]
                (grads,) = torch.autograd.grad(h, x, chunk, retain_graph=True, is_grads_batched=True, allow_unused=True)
                rows.append(torch.zeros(len(chunk), x.numel(), dtype=dtype) if grads is None else grads.flatten(1))
        jacobian = torch.cat(rows).to(torch.float64)
        deviation = x.detach().to(torch.float64).flatten() - mean
        found[index] = _psnr_of_determined(jacobian, deviation, x.detach().to(torch.float64).flatten())
    return found, notes


def _psnr_of_determined(jacobian: torch.Tensor, deviation: torch.Tensor, x: torch.Tensor) -> float:
    """PSNR of μ + P_row(J)(x − μ) against x: the error is the part of the deviation outside J's row space."""
    if not bool(torch.isfinite(jacobian).all()):
        return IDENTICAL_PSNR  # a Jacobian that cannot be read: assume the features determine the sample
    _, singular, right = torch.linalg.svd(jacobian, full_matrices=False)
    kept = right[singular > RANK_SHARE * singular.max()] if len(singular) and singular.max() > 0 else right[:0]
    seen = kept @ deviation
    unknown = max(float(deviation @ deviation - seen @ seen), 0.0)
    spread = float(x.max() - x.min()) or 1.0
    mse = unknown / x.numel()
    return IDENTICAL_PSNR if mse <= 0 else min(IDENTICAL_PSNR, 10 * math.log10(spread**2 / mse))
