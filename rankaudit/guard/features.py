"""What a hidden layer's features determine of the sample they were computed from, at the received weights
(docs/method.md, "The client-side guard").

A server that reads sample s's features h(x_s) exactly knows, to first order, x_s's component in the row space of
J = ∂h/∂x at x_s; the component of x_s − μ outside it (μ the batch's mean) stays unknown, and an attacker that fills
it with μ makes an error of exactly that size. The PSNR of μ + P_row(J)(x_s − μ) against x_s is the figure: at or
above the guard's threshold the features are as good as the sample.

J is formed, only for the samples whose features some readout read, from one forward pass to the layer and its
vector-Jacobian products batched; when it would not fit in memory the sample counts as read and the note says so.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rankaudit.guard.pairs import IDENTICAL_PSNR
from rankaudit.verify.attacks.bias import sample_vectors

# Rows of J per batched backward pass: 64 was the fastest of 32 to 256 on a CPU for Flower's quickstart CNN.
ROWS_PER_PASS = 64
# The most entries of J held at once (float32): 1 GB.
MAX_JACOBIAN_VALUES = 1 << 28
# An eigenvalue of J·Jᵀ counts in J's rank above this share of the largest (float32 rows are exact to about 1e-7,
# so their squares to 1e-14): erring towards a larger row space, which errs towards a higher figure.
RANK_SHARE = 1e-12


class _Reached(Exception):
    """Raised by the hook at the layer: what comes after it does not change its input, so it does not run."""


def _layer_input(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's input for a batch ``x``, the forward pass stopped there."""
    seen = []

    def reached(mod, args):
        seen.append(args[0])
        raise _Reached

    hook = module.register_forward_pre_hook(reached)
    try:
        net(x)
    except _Reached:
        pass
    finally:
        hook.remove()
    if not seen:
        raise RuntimeError("the layer did not run in the model's forward pass")
    return seen[0]


def _features(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's (batch, d) input vectors for a batch ``x``."""
    return sample_vectors(module, _layer_input(net, module, x))


def _one_hots(chosen: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    picks = torch.zeros(len(chosen), width, dtype=dtype)
    picks[torch.arange(len(chosen)), chosen] = 1
    return picks


def jacobian(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows of ∂(the layer's input vector)/∂x at one sample x that can be non-zero, (rows, x.numel()): one
    forward pass to the layer, then its vector-Jacobian products batched, ROWS_PER_PASS rows at a time.
    Features that are exactly zero (a ReLU off) are left out when one backward of a random mix of them gives an
    exactly zero gradient: their rows are then all zero (a random mix of non-zero rows is not)."""
    sample = x.detach()
    try:
        with torch.enable_grad():
            values, pull = torch.func.vjp(lambda one: _features(net, module, one[None])[0], sample)
        wanted = _wanted_rows(values, lambda mix: pull(mix)[0])
        if not len(wanted):
            return torch.zeros(0, x.numel(), dtype=x.dtype)
        rows = torch.func.vmap(pull, chunk_size=ROWS_PER_PASS)(_one_hots(wanted, len(values), values.dtype))[0]
        return rows.reshape(len(wanted), -1)
    except (RuntimeError, NotImplementedError):
        # An operation vmap cannot batch (a custom autograd function, a data-dependent branch): the same rows,
        # each batch of them from one backward over as many copies of the sample (eval mode: copies do not mix).
        return _jacobian_by_copies(net, module, sample)


def _wanted_rows(values: torch.Tensor, gradient_of) -> torch.Tensor:
    """The features whose rows can be non-zero: all, or only the non-zero ones when a random mix of the zero ones
    has an exactly zero gradient."""
    silent = values == 0
    if bool(silent.any()):
        mix = torch.randn(values.shape, generator=torch.Generator().manual_seed(0), dtype=values.dtype) * silent
        grads = gradient_of(mix)
        if grads is None or not bool(grads.any()):
            return torch.nonzero(~silent).flatten()
    return torch.arange(len(values))


def _jacobian_by_copies(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        copy = x[None].clone().requires_grad_(True)
        values = _features(net, module, copy)[0]

        def gradient_of(mix):
            (grads,) = torch.autograd.grad((values * mix).sum(), copy, allow_unused=True, retain_graph=True)
            return grads

        wanted = _wanted_rows(values.detach(), gradient_of)
        rows = []
        for start in range(0, len(wanted), ROWS_PER_PASS):
            chosen = wanted[start : start + ROWS_PER_PASS]
            copies = x.expand(len(chosen), *x.shape).clone().requires_grad_(True)
            h = _features(net, module, copies)
            (grads,) = torch.autograd.grad(h[torch.arange(len(chosen)), chosen].sum(), copies, allow_unused=True)
            rows.append(torch.zeros(len(chosen), x.numel(), dtype=x.dtype) if grads is None else grads.flatten(1))
    return torch.cat(rows) if rows else torch.zeros(0, x.numel(), dtype=x.dtype)


def determined_psnr(
    net: nn.Module, module: nn.Module, samples: torch.Tensor, indices: list[int], min_psnr: float | None = None
) -> tuple[dict[int, float], list[str]]:
    """({sample: PSNR of what the layer's features determine of it}, notes); ``net`` holds the received weights,
    ``module`` is the layer whose input the features are. With ``min_psnr``, a sample whose upper bound
    (rankaudit.guard.features.first_linear_bounds) is under it gets the bound, and no Jacobian."""
    dtype = next((p.dtype for p in net.parameters() if p.is_floating_point()), torch.float32)
    x_all = samples.detach().to(dtype)
    mean = x_all.to(torch.float64).mean(0).flatten()
    found, notes = {}, []
    if min_psnr is not None and indices:
        bounds = first_linear_bounds(net, module, x_all, mean, indices)
        found.update({index: bound for index, bound in bounds.items() if bound < min_psnr})
    with torch.no_grad():
        width = _features(net, module, x_all[:1]).shape[1]
    for index in indices:
        if index in found:
            continue
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


def _reads_through(net: nn.Module, module: nn.Module, linear: nn.Linear, x: torch.Tensor) -> bool:
    """Whether, at each sample of the batch ``x``, ``linear`` reads the sample itself (its input's Jacobian in the
    sample is the identity) and every path from the sample to ``module``'s input goes through it. Two backward
    passes of random mixes: the gradient around the layer is exactly zero, and the one into its input is the mix
    itself (a random mix passes both only when the Jacobians are zero and the identity)."""
    inputs = []

    def cut(mod, args, out):
        inputs.append(args[0])
        return nn.functional.linear(args[0].detach(), mod.weight, mod.bias)

    generator = torch.Generator().manual_seed(0)
    hook = linear.register_forward_hook(cut)
    try:
        with torch.enable_grad():
            sample = x.detach().clone().requires_grad_(True)
            features = _features(net, module, sample)
    finally:
        hook.remove()
    if len(inputs) != 1 or features is None or not inputs[0].requires_grad:
        return False
    with torch.enable_grad():
        if features.requires_grad:
            mix = torch.randn(features.shape, generator=generator, dtype=features.dtype)
            (around,) = torch.autograd.grad((features * mix).sum(), sample, allow_unused=True, retain_graph=True)
            if around is not None and bool(around.any()):
                return False
        mix = torch.randn(inputs[0].shape, generator=generator, dtype=inputs[0].dtype)
        (into,) = torch.autograd.grad((inputs[0] * mix).sum(), sample, allow_unused=True)
    return into is not None and bool(torch.equal(into.reshape(mix.shape), mix))


def first_linear_bounds(
    net: nn.Module, module: nn.Module, x_all: torch.Tensor, mean: torch.Tensor, indices: list[int]
) -> dict[int, float]:
    """{sample: an upper bound on the PSNR of what the layer's features determine of it}, without its Jacobian,
    when a Linear with fewer outputs than inputs reads the sample itself and every path from the sample to the
    features goes through it: then J = (∂h/∂u)·W, so J's row space lies in W's, the same for every sample, and
    the part of x − μ in W's row space bounds the part in J's. {} when no such layer is found."""
    size = x_all[0].numel()
    chosen = x_all[indices]
    for linear in net.modules():
        if not isinstance(linear, nn.Linear) or linear is module or linear.in_features != size:
            continue
        if linear.out_features >= linear.in_features or not _reads_through(net, module, linear, chosen):
            continue
        weight = linear.weight.detach().to(torch.float64).reshape(linear.out_features, -1)
        space = _row_space(weight)
        if space is None:
            return {}
        xs = chosen.to(torch.float64).reshape(len(indices), -1)
        return dict(zip(indices, _psnr_outside(weight, *space, xs - mean, xs)))
    return {}


def _psnr_of_determined(jacobian: torch.Tensor, deviation: torch.Tensor, x: torch.Tensor) -> float:
    """PSNR of μ + P_row(J)(x − μ) against x: the error is the part of the deviation outside J's row space,
    |P v|² = (Jv)ᵀ (J Jᵀ)⁺ (Jv)."""
    space = _row_space(jacobian)
    if space is None:
        return IDENTICAL_PSNR  # a Jacobian that cannot be read: assume the features determine the sample
    return _psnr_outside(jacobian, *space, deviation[None], x[None])[0]


def _row_space(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(eigenvectors, eigenvalues) of rows·rowsᵀ that count in the rows' rank; None when a row is not finite."""
    gram = rows @ rows.T
    # A row with an infinity or a NaN has one on the diagonal (the squares of float32 values cannot overflow).
    if not bool(torch.isfinite(gram.diagonal()).all()):
        return None
    # A few hundred rows gain nothing from LAPACK's threads, and lose seconds to them on shared cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values, vectors = torch.linalg.eigh(gram)
    finally:
        torch.set_num_threads(threads)
    kept = values > RANK_SHARE * values.max() if len(values) and values.max() > 0 else values > math.inf
    return vectors[:, kept], values[kept]


def _psnr_outside(
    rows: torch.Tensor, vectors: torch.Tensor, values: torch.Tensor, deviations: torch.Tensor, xs: torch.Tensor
) -> list[float]:
    """For each (deviation, sample) row pair: the PSNR of the mean plus the deviation's part in the rows' row
    space, against the sample."""
    seen = ((vectors.T @ (rows @ deviations.T)) ** 2 / values[:, None]).sum(0)
    figures = []
    for deviation, x, part in zip(deviations, xs, seen.tolist()):
        unknown = max(float(deviation @ deviation) - part, 0.0)
        spread = float(x.max() - x.min()) or 1.0
        mse = unknown / x.numel()
        figures.append(IDENTICAL_PSNR if mse <= 0 else min(IDENTICAL_PSNR, 10 * math.log10(spread**2 / mse)))
    return figures
