"""What a hidden layer's features determine of the sample they were computed from, at the received weights
(docs/method.md, "The client-side guard").

A server that reads sample s's features h(x_s) exactly knows, to first order, x_s's component in the row space of
J = ∂h/∂x at x_s; the component of x_s − μ outside it (μ the batch's mean) stays unknown, and an attacker that fills
it with μ makes an error of exactly that size. The PSNR of μ + P_row(J)(x_s − μ) against x_s is the figure: at or
above the guard's threshold the features are as good as the sample.

J is formed by backward passes over a batch of copies of the sample, only for the samples whose features some
readout read; when it would not fit in memory the sample counts as read and the note says so.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rankaudit.guard.pairs import IDENTICAL_PSNR
from rankaudit.verify.attacks.bias import sample_vectors

# Rows of J per backward pass: the sample is repeated this many times in one batch, copy k giving row k.
ROWS_PER_PASS = 128
# The most entries of J held at once (float32): 1 GB.
MAX_JACOBIAN_VALUES = 1 << 28
# An eigenvalue of J·Jᵀ counts in J's rank above this share of the largest (float32 rows are exact to about 1e-7,
# so their squares to 1e-14): erring towards a larger row space, which errs towards a higher figure.
RANK_SHARE = 1e-12


def _features(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's (batch, d) input vectors for a batch ``x``."""
    seen = []
    hook = module.register_forward_hook(lambda mod, args, out: seen.append(args[0]))
    try:
        net(x)
    finally:
        hook.remove()
    return sample_vectors(module, seen[0])


def jacobian(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows of ∂(the layer's input vector)/∂x at one sample x that can be non-zero, (rows, x.numel()): one
    backward per ROWS_PER_PASS rows, over a batch of copies of x (eval mode: the copies do not see each other).
    Features that are exactly zero (a ReLU off) are left out when one backward of a random mix of them gives an
    exactly zero gradient: their rows are then all zero (a random mix of non-zero rows is not)."""
    with torch.no_grad():
        values = _features(net, module, x[None])[0]
    wanted = torch.arange(len(values))
    silent = torch.nonzero(values == 0).flatten()
    with torch.enable_grad():
        if len(silent):
            copy = x.detach()[None].clone().requires_grad_(True)
            mix = torch.randn(len(silent), generator=torch.Generator().manual_seed(0), dtype=values.dtype)
            (grads,) = torch.autograd.grad(
                (_features(net, module, copy)[0, silent] * mix).sum(), copy, allow_unused=True
            )
            if grads is None or not bool(grads.any()):
                wanted = torch.nonzero(values != 0).flatten()
        rows = []
        for start in range(0, len(wanted), ROWS_PER_PASS):
            chosen = wanted[start : start + ROWS_PER_PASS]
            copies = x.detach().expand(len(chosen), *x.shape).clone().requires_grad_(True)
            h = _features(net, module, copies)
            picked = h[torch.arange(len(chosen)), chosen].sum()
            (grads,) = torch.autograd.grad(picked, copies, allow_unused=True)
            rows.append(torch.zeros(len(chosen), x.numel(), dtype=x.dtype) if grads is None else grads.flatten(1))
    return torch.cat(rows) if rows else torch.zeros(0, x.numel(), dtype=x.dtype)


def determined_psnr(
    net: nn.Module, module: nn.Module, samples: torch.Tensor, indices: list[int]
) -> tuple[dict[int, float], list[str]]:
    """({sample: PSNR of what the layer's features determine of it}, notes); ``net`` holds the received weights,
    ``module`` is the layer whose input the features are."""
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    x_all = samples.detach().to(dtype)
    mean = x_all.to(torch.float64).mean(0).flatten()
    found, notes = {}, []
    with torch.no_grad():
        width = _features(net, module, x_all[:1]).shape[1]
    for index in indices:
        if width * x_all[0].numel() > MAX_JACOBIAN_VALUES:
            found[index] = IDENTICAL_PSNR
            notes.append(
                f"sample {index}: the Jacobian of {width} features in {x_all[0].numel()} inputs does not fit in "
                "memory; its features count as the sample"
            )
            continue
        rows = jacobian(net, module, x_all[index]).to(torch.float64)
        x = x_all[index].to(torch.float64).flatten()
        found[index] = _psnr_of_determined(rows, x - mean, x)
    return found, notes


def _psnr_of_determined(jacobian: torch.Tensor, deviation: torch.Tensor, x: torch.Tensor) -> float:
    """PSNR of μ + P_row(J)(x − μ) against x: the error is the part of the deviation outside J's row space,
    |P v|² = (Jv)ᵀ (J Jᵀ)⁺ (Jv)."""
    if not bool(torch.isfinite(jacobian).all()):
        return IDENTICAL_PSNR  # a Jacobian that cannot be read: assume the features determine the sample
    # A few hundred rows gain nothing from LAPACK's threads, and lose seconds to them on shared cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values, vectors = torch.linalg.eigh(jacobian @ jacobian.T)
    finally:
        torch.set_num_threads(threads)
    kept = values > RANK_SHARE * values.max() if len(values) and values.max() > 0 else values > math.inf
    projected = vectors[:, kept].T @ (jacobian @ deviation)
    seen = float((projected**2 / values[kept]).sum())
    unknown = max(float(deviation @ deviation) - seen, 0.0)
    spread = float(x.max() - x.min()) or 1.0
    mse = unknown / x.numel()
    return IDENTICAL_PSNR if mse <= 0 else min(IDENTICAL_PSNR, 10 * math.log10(spread**2 / mse))
