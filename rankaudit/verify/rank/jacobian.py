"""--verify rank: the numerical rank of J = ∂g/∂x, the shared gradient's Jacobian in the input (spec §10).

The exact answer to "does one gradient determine the input?" for any differentiable model: rank(J) = n means it
does (to first order, up to isolated points); a deficit n - rank(J) counts input directions the gradient cannot
see. Computed in float64 from a Gaussian sketch S = R·J with min(m, n) + 16 rows (m shared gradient values), each
row rᵀJ = ∂/∂x ⟨r, g(x)⟩ a second derivative, batched over rows:

- forward-over-reverse (``torch.func``): rᵀJ is the directional derivative, along r in parameter space, of the
  input gradient ∂L/∂x; ``vmap`` carries a whole chunk of rows through one pass. Faster than
- reverse-over-reverse (plain autograd, ``is_grads_batched``; 128 rows of CNN6 on two CPU cores: 9 s against
  201 s, whose batched conv double backward runs row by row), the fallback for models ``torch.func`` rejects
  (an old-style custom ``autograd.Function``, which has no forward-mode rule).

Then the rank counts the singular values of S above σ_max · max(rows, n) · eps (LAPACK's rule, the one R-GAP's
layer check uses), and ``gap`` says how clear the cut is: σ_last_kept / σ_first_dropped, or at full rank
σ_min / tolerance. Full rank is shown from a QR factor when σ_min clears the tolerance by RELIABLE_GAP (a third of
an SVD's cost); every other case gets the full SVD.

For callers other than the CLI (benchmarks, notebooks)::

    from rankaudit.verify import rank
    m = rank.measure(model, images, labels, device="cuda", seed=0)   # images: B x C x H x W, labels: B
    m.rank, m.unknowns, m.deficit, m.gap, m.seconds

``shared`` (parameter names, default every trainable parameter) chooses what the client sends;
:func:`shared_parameter_names` turns --shared-layers / --withheld-layers into it.
"""

from __future__ import annotations

import copy
import math
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.verify import finite
from rankaudit.verify.rank.budget import CPU_CHUNK_BYTES, check_size, memory_budget, sketch_bytes
from rankaudit.verify.substitute import differentiable_ops

# Extra rows over min(m, n): a Gaussian sketch with that many rows plus p has rank(S) = rank(J) with probability 1
# for any p >= 0; p = 16 keeps the smallest kept singular value of S close to J's (a square Gaussian is
# ill-conditioned).
OVERSAMPLING = 16
# A rank whose last kept and first dropped singular values are less than three orders of magnitude apart
# depends on where the tolerance falls: flag it.
RELIABLE_GAP = 1e3
MAX_DIRECTIONS = 16
# --verify rank's precision choice (see _float32_attempt): a float32 sketch shows full rank when its σ_min clears
# float32's error floor this many times over; PRECISION_PROBE_ROWS rows recomputed in float64 measure that error.
PRECISIONS = ("auto", "float64", "float32")
FLOAT32_MARGIN = 10.0
PRECISION_PROBE_ROWS = 8
# On CUDA, a chunk may take this share of the memory that is free after a probe chunk.
CUDA_FREE_SHARE = 0.5
# Beyond this many rows per pass, a larger batch no longer makes the kernels more efficient.
MAX_CHUNK_ROWS = 1024
PROBE_ROWS = 8
TOLERANCE_RULE = "sigma_max * max(rows, n) * eps(float64)"
LOSSES = ("cross-entropy", "logistic")


@dataclass
class RankMeasurement:
    """One sketch: the rank of ∂g/∂x at one input (a batch of B samples counts as one input of B·|x| values)."""

    unknowns: int  # n = B·|x|
    rank: int
    deficit: int  # n - rank: input directions the shared gradient cannot see
    tolerance: float  # singular values of S at or below this are dropped
    gap: float | None  # σ_last_kept / σ_first_dropped; at full rank σ_min / tolerance; None at rank 0
    reliable: bool  # gap >= RELIABLE_GAP
    sigma_max: float
    sigma_min_kept: float | None
    singular_values: np.ndarray | None  # of S, descending, when a full SVD ran (not when QR showed full rank)
    spectrum: str  # how: svd | qr+inverse-iteration
    seconds: float  # sketch and SVD
    sketch_seconds: float
    spectrum_seconds: float
    device: str
    method: str  # forward-over-reverse | reverse-over-reverse
    loss: str
    sketch_rows: int
    chunk_rows: int
    shared_gradient_size: int  # m: entries of the shared gradient g
    shared_parameters: list[str] = field(default_factory=list)
    # Right singular vectors of the smallest dropped singular values, shaped like the input batch (up to
    # `directions` of them, smallest first), with their singular values; empty at full rank.
    directions: np.ndarray | None = None
    direction_singular_values: list[float] = field(default_factory=list)
    # With hidden=True: P c, the batch with each sample's mean removed, projected onto the whole measured
    # invisible subspace (all n - rank dropped directions), shaped like the batch; zeros at full rank.
    invisible: np.ndarray | None = None
    precision: str = "float64"  # the sketch whose spectrum gave the rank: float32 (accepted) | float64
    precision_note: str = ""  # why that precision
    # Spec §14: rank(J_i) of each sample of the batch from its column block of the same sketch (R·J_i), in order.
    sample_ranks: list[int] = field(default_factory=list)


def shared_parameter_names(
    model: nn.Module, shared_layers: Iterable[str] | None = None, withheld_layers: Iterable[str] | None = None
) -> list[str]:
    """The trainable parameters whose gradients the client sends.

    Default: all of them, the ones a layer applies and the ones an op reads directly (class token, position
    embedding, norm scales). ``shared_layers``: only the parameters of those layers (a name is a module's
    qualified name, or a parameter's own); ``withheld_layers``: every parameter except theirs. Frozen
    parameters (``requires_grad=False``) share nothing.
    """
    trainable = [name for name, parameter in model.named_parameters() if parameter.requires_grad]
    if shared_layers and withheld_layers:
        raise UsageError(
            "both --shared-layers and --withheld-layers given", "name either the shared or the withheld ones"
        )
    named = list(shared_layers or withheld_layers or [])

    def owned_by(parameter: str, layer: str) -> bool:
        return parameter == layer or parameter.startswith(layer + ".")

    unmatched = [layer for layer in named if not any(owned_by(p, layer) for p in trainable)]
    if unmatched:
        raise UsageError(
            f"no trainable parameter belongs to {', '.join(unmatched)} in the model with real weights",
            "name modules that own parameters (e.g. conv1) or parameters themselves (e.g. cls_token)",
        )
    if shared_layers:
        return [p for p in trainable if any(owned_by(p, layer) for layer in named)]
    if withheld_layers:
        return [p for p in trainable if not any(owned_by(p, layer) for layer in named)]
    return trainable


def loss_name_for(logits_per_sample: int) -> str:
    """The convention of the other attacks: one logit -> the logistic loss, several -> cross-entropy."""
    return "logistic" if logits_per_sample == 1 else "cross-entropy"


def draw_labels(count: int, loss: str, classes: int, seed: int) -> torch.Tensor:
    """Seeded labels as R-GAP draws them: ±1 for the logistic loss, a class index for cross-entropy."""
    generator = torch.Generator().manual_seed(seed)
    labels = []
    for _ in range(count):
        if loss == "logistic":
            labels.append(1 if torch.rand((), generator=generator) < 0.5 else -1)
        else:
            labels.append(int(torch.randint(classes, (), generator=generator)))
    return torch.tensor(labels, dtype=torch.long)


def logits_of(output) -> torch.Tensor:
    """The logits of a forward pass: the tensor itself, a model output's .logits, or a tuple's first element."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UsageError(
        f"the model returns {type(output).__name__}, not logits",
        "return the logits tensor (or an object with .logits) from forward()",
    )


def _loss(output, labels: torch.Tensor, loss: str) -> torch.Tensor:
    logits = logits_of(output).reshape(labels.shape[0], -1)
    if loss == "logistic":
        return F.softplus(-labels.to(logits.dtype) * logits[:, 0]).mean()
    return F.cross_entropy(logits, labels)


def measure(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    shared: Iterable[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    loss: str | None = None,
    directions: int = 0,
    chunk_rows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    hidden: bool = False,
    precision: str = "float64",
) -> RankMeasurement:
    """rank(∂g/∂x) for the batch ``images`` (B x ...) with ``labels`` (B), all in float64 on ``device``.

    g is the gradient of the mean loss over the batch with respect to the ``shared`` parameters (names; default
    every trainable one). ``loss``: "cross-entropy" or "logistic" (default: logistic for a single logit).
    The model is copied, moved to ``device`` in float64 and put in eval mode (BatchNorm uses its running
    statistics, as the other verifiers do); attention runs under the math SDPA backend, the only one with a
    double backward. ``directions``: also return up to that many right singular vectors of dropped singular
    values (a full SVD instead of singular values only). ``chunk_rows``: rows per batched pass (default: sized
    to the device's free memory). ``progress(done, total)`` runs after each chunk of rows. ``hidden``: also
    return P c, the batch's mean-removed input projected onto the whole invisible subspace (spec §11; a full SVD
    with vectors unless the rank is full), for :mod:`rankaudit.verify.rank.hidden`. ``precision``:
    "float64" (the reference), "auto" (a float32 sketch first, kept only when it shows full rank with σ_min at
    least FLOAT32_MARGIN times above both float32's tolerance and its measured error, else float64; see
    _float32_attempt) or "float32" (unchecked; for benchmarks).

    Raises UsageError when the sketch does not fit the device's memory (check_size) and ModelLoadError (exit 3)
    when an op has no double backward.
    """
    device = torch.device(device)
    unknowns = int(images.numel())
    if labels.shape[0] != images.shape[0]:
        raise UsageError(f"{images.shape[0]} images but {labels.shape[0]} labels", "give one label per image")
    started = time.perf_counter()
    net = copy.deepcopy(model).to(device=device, dtype=torch.float64).eval()
    x = images.detach().to(device=device, dtype=torch.float64)
    labels = labels.to(device)
    if loss is None:
        with torch.no_grad(), _math_attention():
            loss = loss_name_for(logits_of(net(x[:1])).numel())
    if loss not in LOSSES:
        raise UsageError(f"unknown loss {loss!r}", "use cross-entropy or logistic")
    trainable = {name: p for name, p in net.named_parameters() if p.requires_grad}
    names = list(trainable) if shared is None else list(dict.fromkeys(shared))
    missing = [name for name in names if name not in trainable]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} is not a trainable parameter of {type(model).__name__}",
            "name parameters from model.named_parameters() that require grad",
        )
    m = sum(trainable[name].numel() for name in names)
    # rank(J) <= min(m, n), and a Gaussian R keeps the rank of J once it has that many rows: with fewer shared
    # gradient values than unknowns, m + 16 rows are enough.
    rows = min(m, unknowns) + OVERSAMPLING
    check_size(unknowns, rows, tuple(images.shape[1:]), int(images.shape[0]), device=device, vectors=directions > 0)
    # The hidden-energy measurement needs the SVD's vectors; where they do not fit, the rank is still measured and
    # the hidden part is reported as unmeasured (invisible stays None below a full rank).
    want_vectors = directions > 0 or (hidden and sketch_bytes(rows, unknowns, vectors=True) <= memory_budget(device)[0])
    _require_finite_gradient(net, x, labels, loss, [trainable[name] for name in names])
    if precision not in PRECISIONS:
        raise UsageError(f"unknown precision {precision!r}", f"use one of {', '.join(PRECISIONS)}")
    accepted, precision_note = None, "float64 asked for"
    if names and precision != "float64":
        accepted, precision_note = _float32_attempt(
            net,
            x,
            labels,
            loss,
            names,
            rows,
            seed=seed,
            chunk_rows=chunk_rows,
            progress=progress,
            checked=precision == "auto",
        )
    if accepted is not None:
        method, used_chunk, spectrum, sketched = accepted
    else:
        sketch = torch.zeros(rows, unknowns, dtype=torch.float64, device=device)
        method, used_chunk = "none", 0
        if names:
            with _math_attention(), differentiable_ops():
                method, used_chunk = _fill_sketch(
                    net, x, labels, loss, names, sketch, seed=seed, chunk_rows=chunk_rows, progress=progress
                )
        if not finite.all_finite(sketch):
            raise finite.sketch_error("--verify rank")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        sketched = time.perf_counter()
        spectrum = _spectrum(sketch, want_vectors=want_vectors)
    if accepted is not None:
        # A checked float32 sketch is kept only at full rank, where every column block has full rank too; an
        # unchecked one (precision "float32") below full rank was not kept: its samples' ranks stay unmeasured.
        full = spectrum.rank >= unknowns
        per_sample = [unknowns // int(images.shape[0])] * int(images.shape[0]) if full else []
    else:
        per_sample = sample_ranks(sketch, int(images.shape[0]), spectrum.rank)
        del sketch
    rank, found, found_values = spectrum.rank, None, []
    if spectrum.right_vectors is not None and rank < unknowns:
        # Rows of Vh past the rank span the null space of S, which is the null space of J.
        take = min(directions, unknowns - rank)
        found = spectrum.right_vectors[unknowns - take :].flip(0).reshape(take, *images.shape).cpu().numpy()
        padded = np.concatenate([spectrum.values, np.zeros(max(0, unknowns - spectrum.values.size))])
        found_values = [float(v) for v in padded[unknowns - take :][::-1]]  # smallest first
    invisible = None
    if hidden:
        from rankaudit.verify.rank import hidden as hidden_part

        invisible = hidden_part.measured_invisible(x, spectrum.right_vectors, rank)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return RankMeasurement(
        unknowns=unknowns,
        rank=rank,
        deficit=unknowns - rank,
        tolerance=spectrum.tolerance,
        gap=spectrum.gap,
        # An empty gradient (no shared value, or all zero) has rank 0 exactly: no tolerance decides it (issue 23).
        reliable=(spectrum.gap is not None and spectrum.gap >= RELIABLE_GAP) or m == 0 or not spectrum.sigma_max,
        sigma_max=spectrum.sigma_max,
        sigma_min_kept=spectrum.sigma_min_kept,
        singular_values=spectrum.values,
        spectrum=spectrum.how,
        seconds=time.perf_counter() - started,
        sketch_seconds=sketched - started,
        spectrum_seconds=time.perf_counter() - sketched,
        device=str(device),
        method=method,
        loss=loss,
        sketch_rows=rows,
        chunk_rows=used_chunk,
        shared_gradient_size=m,
        shared_parameters=names,
        directions=found,
        direction_singular_values=found_values,
        invisible=invisible,
        precision="float32" if accepted is not None else "float64",
        precision_note=precision_note,
        sample_ranks=per_sample,
    )


def sample_ranks(sketch: torch.Tensor, samples: int, rank: int) -> list[int]:
    """rank(J_i) of each of ``samples`` equal column blocks of the sketch S = R·J (spec §14): S's columns of sample
    i are R·J_i, whose rank is rank(J_i) since R has at least min(m, |x|) + 16 rows. Each block by the same rule
    as the whole (QR when it clearly has full rank, else its singular values above LAPACK's tolerance); at full
    rank of S (``rank`` = its column count) every block has full rank and nothing is factorised again."""
    width = sketch.shape[1] // samples
    if samples == 1 or rank >= sketch.shape[1]:
        return [min(rank, width)] * samples if rank >= sketch.shape[1] else [rank]
    return [_spectrum(sketch[:, i * width : (i + 1) * width], want_vectors=False).rank for i in range(samples)]


def _float32_attempt(
    net: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    loss: str,
    names: list[str],
    rows: int,
    *,
    seed: int,
    chunk_rows: int | None,
    progress,
    checked: bool,
):
    """((method, chunk rows, spectrum, time sketched) when a float32 sketch settles the rank, else None; why).

    The rows (the double backward, where the time goes) run in float32; the factorisation runs in float64 on the
    widened sketch S32 = S + E, so the only float32 error is E. Such a sketch can only show full rank: by Weyl's
    inequality σ_min(S) >= σ_min(S32) - ‖E‖₂, so σ_min(S32) well above ‖E‖₂ means S (and J) has full rank too; a
    deficit seen in float32 proves nothing (float64 resolves directions twelve orders of magnitude below σ_max,
    float32 about six). ‖E‖₂ <= ‖E‖_F is estimated from PRECISION_PROBE_ROWS rows recomputed in float64 (the same
    Gaussian rows): the largest relative error of a row times ‖S32‖_F. Accepted when σ_min(S32) >= FLOAT32_MARGIN
    times that estimate (and above float64's tolerance); otherwise the caller recomputes in float64. The gap of an
    accepted sketch is σ_min(S)'s lower bound σ_min(S32) - ‖E‖ over float64's tolerance.
    """
    started = time.perf_counter()
    unknowns = x.numel()
    single = copy.deepcopy(net).float()
    sketch = torch.zeros(rows, unknowns, dtype=torch.float32, device=x.device)
    with _math_attention(), differentiable_ops():
        method, used_chunk = _fill_sketch(
            single, x.float(), labels, loss, names, sketch, seed=seed, chunk_rows=chunk_rows, progress=progress
        )
    del single
    if not finite.all_finite(sketch):
        return None, "the float32 sketch overflowed, so the rank was computed in float64"
    wide = sketch.double()
    del sketch
    if x.device.type == "cuda":
        torch.cuda.synchronize(x.device)
    sketched = time.perf_counter()
    spectrum = _spectrum(wide, want_vectors=False)
    if not checked:
        return (method, used_chunk, spectrum, sketched), "float32 rows asked for (not checked against float64)"
    seconds = f"{time.perf_counter() - started:.1f} s"
    if spectrum.rank < unknowns or spectrum.sigma_min_kept is None:
        return None, (
            f"the float32 sketch ({seconds}) showed rank {spectrum.rank} of {unknowns}; only float64 can "
            "settle a deficit, so the rank was computed in float64"
        )
    probe = min(PRECISION_PROBE_ROWS, rows)
    exact = torch.zeros(probe, unknowns, dtype=torch.float64, device=x.device)
    with _math_attention(), differentiable_ops():
        _fill_sketch(net, x, labels, loss, names, exact, seed=seed, chunk_rows=chunk_rows, progress=None)
    row_errors = (wide[:probe] - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-300)
    relative = float(row_errors.max())
    error = relative * float(wide.norm())
    clearance = spectrum.sigma_min_kept / error if error > 0 else math.inf
    if math.isfinite(relative) and clearance >= FLOAT32_MARGIN:
        lower = spectrum.sigma_min_kept - error
        spectrum = _Spectrum(
            spectrum.rank,
            spectrum.tolerance,
            lower / spectrum.tolerance if spectrum.tolerance else math.inf,
            spectrum.sigma_max,
            lower,
            spectrum.values,
            None,
            spectrum.how,
        )
        return (method, used_chunk, spectrum, sketched), (
            f"float32 rows: full rank with σ_min {spectrum.sigma_min_kept + error:.3g}, {clearance:.3g}x the "
            f"float32 error {error:.3g} (rows off by up to {relative:.2g} of their norm against {probe} rows "
            f"recomputed in float64, times the sketch's norm); margin {FLOAT32_MARGIN:g}"
        )
    return None, (
        f"the float32 sketch ({seconds}) showed full rank, but σ_min {spectrum.sigma_min_kept:.3g} is only "
        f"{clearance:.3g}x its float32 error {error:.3g} (margin {FLOAT32_MARGIN:g}), so the rank was "
        "computed in float64"
    )


def _require_finite_gradient(
    net: nn.Module, x: torch.Tensor, labels: torch.Tensor, loss: str, parameters: list[torch.Tensor]
):
    """The output and the shared gradient at x must be finite before anything is sketched (spec: no figure from
    non-finite numbers); finite.py names the op that broke them."""

    def rerun():
        output = net(x)
        return output, _loss(output, labels, loss)

    with torch.enable_grad(), _math_attention(), differentiable_ops():
        output, objective = rerun()
        gradients = torch.autograd.grad(objective, parameters, allow_unused=True) if parameters else ()
        finite.require_finite(
            "--verify rank", (output, objective), gradients, model=net, rerun=rerun, parameters=parameters, inputs=x
        )


@dataclass
class _Spectrum:
    rank: int
    tolerance: float
    gap: float | None
    sigma_max: float
    sigma_min_kept: float | None
    values: np.ndarray | None  # every singular value, when a full SVD ran
    right_vectors: torch.Tensor | None  # rows of Vh, when asked for
    how: str  # svd | qr+inverse-iteration


def _tolerance(sigma_max: float, sketch: torch.Tensor) -> float:
    return sigma_max * max(sketch.shape) * float(torch.finfo(sketch.dtype).eps)


def _spectrum(sketch: torch.Tensor, *, want_vectors: bool) -> _Spectrum:
    """Rank, tolerance and gap of the sketch.

    An SVD of an (n + 16) x n matrix costs about 8n³/3 flops, half of them memory-bound; a QR costs a
    third of that in matrix products and has the same singular values in its n x n factor R. So full rank is
    first tried cheaply: power iteration gives σ_max, inverse iteration with two triangular solves per step
    gives σ_min (its estimate only ever errs high, by a factor near 1 after INVERSE_STEPS steps); when σ_min
    clears the tolerance by RELIABLE_GAP, the sketch has full rank. Anything else gets the full SVD.
    """
    with _lapack_threads(sketch.device):
        quick = _full_rank_by_qr(sketch)
        if quick is not None:
            return quick  # full rank: no dropped values, no invisible directions to show
        if want_vectors:
            # With fewer rows than unknowns, the reduced Vh misses part of the null space: ask for all of it.
            _, values, vh = torch.linalg.svd(sketch, full_matrices=sketch.shape[0] < sketch.shape[1])
        else:
            values, vh = torch.linalg.svdvals(sketch), None
    values = values.cpu().numpy()
    sigma_max = float(values[0]) if values.size else 0.0
    tolerance = _tolerance(sigma_max, sketch)
    rank = int(np.count_nonzero(values > tolerance)) if sigma_max > 0 else 0
    if rank == 0:
        gap = None
    elif rank < values.size:
        gap = math.inf if values[rank] == 0 else float(values[rank - 1] / values[rank])
    else:
        gap = math.inf if tolerance == 0 else float(values[rank - 1]) / tolerance
    return _Spectrum(rank, tolerance, gap, sigma_max, float(values[rank - 1]) if rank else None, values, vh, "svd")


POWER_STEPS = 30
INVERSE_STEPS = 30


def _full_rank_by_qr(sketch: torch.Tensor) -> _Spectrum | None:
    """Full rank with a clear margin, shown from the triangular factor alone; None when that is not shown."""
    rows, n = sketch.shape
    if rows < n:
        return None
    _, triangular = torch.linalg.qr(sketch, mode="r")
    generator = torch.Generator(device=sketch.device).manual_seed(0)
    vector = torch.randn((n, 1), generator=generator, dtype=sketch.dtype, device=sketch.device)
    for _ in range(POWER_STEPS):
        vector = triangular.T @ (triangular @ vector)
        vector = vector / vector.norm()
    sigma_max = float((triangular @ vector).norm())
    if not math.isfinite(sigma_max) or sigma_max == 0:
        return None
    vector = torch.randn((n, 1), generator=generator, dtype=sketch.dtype, device=sketch.device)
    for _ in range(INVERSE_STEPS):
        vector = torch.linalg.solve_triangular(triangular.T, vector, upper=False)
        vector = torch.linalg.solve_triangular(triangular, vector, upper=True)
        norm = vector.norm()
        if not torch.isfinite(norm) or norm == 0:
            return None
        vector = vector / norm
    sigma_min = float((triangular @ vector).norm())
    tolerance = _tolerance(sigma_max, sketch)
    if not math.isfinite(sigma_min) or sigma_min < RELIABLE_GAP * tolerance:
        return None
    return _Spectrum(n, tolerance, sigma_min / tolerance, sigma_max, sigma_min, None, None, "qr+inverse-iteration")


class _lapack_threads:
    """One thread for the CPU factorisations when the cores are already busy: OpenMP's spin-waiting made an SVD
    16x slower with two threads than with one on a shared 2-core machine at load 10 (1,536², 32 s against 1.9 s)."""

    def __init__(self, device: torch.device):
        self.cpu = device.type == "cpu" and os.getloadavg()[0] > (os.cpu_count() or 1) - 0.5

    def __enter__(self):
        if self.cpu:
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.cpu:
            torch.set_num_threads(self._threads)


class _math_attention:
    """Fused attention kernels have no double backward; the math backend has."""

    def __enter__(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self._context = sdpa_kernel(SDPBackend.MATH)
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


# ---- the sketch ----------------------------------------------------------------------------------------------


def _fill_sketch(
    net: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    loss: str,
    names: list[str],
    sketch: torch.Tensor,
    *,
    seed: int,
    chunk_rows: int | None,
    progress: Callable[[int, int], None] | None,
) -> tuple[str, int]:
    """Write R·J into ``sketch`` chunk by chunk; returns the method used and the chunk size."""
    shapes = [tuple(dict(net.named_parameters())[name].shape) for name in names]
    fast = _ForwardOverReverse(net, x, labels, loss, names)
    slow: list[_ReverseOverReverse] = []

    def rows_of(directions: list[torch.Tensor]) -> torch.Tensor:
        if not slow:
            try:
                return fast(directions)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as unsupported:  # torch.func refuses the model: plain autograd can still do it
                slow.append(_ReverseOverReverse(net, x, labels, loss, names, why=unsupported))
        return slow[0](directions)

    size = fill_in_chunks(
        sketch,
        shapes,
        rows_of,
        seed=seed,
        chunk_rows=chunk_rows,
        progress=progress,
        activation_numel=lambda: _activation_numel(net, x, labels, loss),
        too_large="one row of the rank sketch does not fit in the GPU's free memory",
        fix="use --device cpu, or a lower --input-shape / --batch-size",
    )
    return ("reverse-over-reverse" if slow else "forward-over-reverse"), size


def fill_in_chunks(
    sketch: torch.Tensor,
    shapes: list[tuple[int, ...]],
    rows_of: Callable[[list[torch.Tensor]], torch.Tensor],
    *,
    seed: int,
    chunk_rows: int | None,
    progress: Callable[[int, int], None] | None,
    activation_numel: Callable[[], int],
    too_large: str,
    fix: str,
) -> int:
    """Write the rows ``rows_of(directions)`` of R·J into ``sketch``, a chunk of Gaussian directions (one tensor per
    shape in ``shapes``) at a time; returns the chunk size used. The single gradient's sketch and the round's
    (verify/round_rank.py) share it.

    On a CPU a chunk is sized from the parameters and ``activation_numel()`` (the entries one pass saves); on CUDA
    a probe chunk measures what a row costs and the rest is sized to the free memory, halving on running out."""
    device = sketch.device
    rows = sketch.shape[0]
    size = chunk_rows or (
        min(PROBE_ROWS, rows)
        if device.type == "cuda"
        else _cpu_chunk(sum(math.prod(shape) for shape in shapes), activation_numel(), rows)
    )
    size = max(1, min(size, rows))
    generator = torch.Generator(device=device)
    done, sized = 0, chunk_rows is not None or device.type != "cuda"
    while done < rows:
        count = min(size, rows - done)
        if device.type == "cuda" and not sized:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        directions = _gaussian_rows(done, count, shapes, seed, generator, dtype=sketch.dtype)
        try:
            block = rows_of(directions)
        except torch.cuda.OutOfMemoryError:
            del directions
            torch.cuda.empty_cache()
            if count == 1:
                raise UsageError(too_large, fix) from None
            size, sized = max(1, count // 2), True
            continue
        sketch[done : done + count] = block.reshape(count, -1)
        done += count
        if not sized:
            # The probe chunk measured what one row costs; size the rest to the memory that is free now.
            per_row = max(torch.cuda.max_memory_allocated(device) - before, 1) / count
            free = torch.cuda.mem_get_info(device)[0]
            size, sized = int(max(1, min(MAX_CHUNK_ROWS, CUDA_FREE_SHARE * free / per_row))), True
        del directions, block
        if progress is not None:
            progress(done, rows)
    return size


def _gaussian_rows(
    first: int,
    count: int,
    shapes: list[tuple[int, ...]],
    seed: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
) -> list[torch.Tensor]:
    """Rows first .. first + count - 1 of R, cut into one (count, *shape) tensor of ``dtype`` per shared parameter
    (the float32 and the float64 sketch use the same R).

    Each row has its own seed, so R is the same however it is chunked (the CPU's normal sampler fills blocks of
    16: one stream cut at other places gives other numbers). Drawn in float32, then widened: every entry is still
    an exact float64 Gaussian sample (at float32 resolution, which changes nothing about rank(R·J) = rank(J)), and
    PyTorch's CPU sampler is 5x faster for float32; R has rows x m entries, 3.9e9 for Figure 2(c)'s 1.26M
    parameters, and drawing them dominated its sketch.
    """
    sizes = [math.prod(shape) for shape in shapes]
    drawn = torch.empty((count, sum(sizes)), device=generator.device, dtype=torch.float32)
    for offset in range(count):
        generator.manual_seed((seed * 2**24 + first + offset) % 2**63)
        drawn[offset].normal_(generator=generator)
    # One pass widens and cuts: the column block of each parameter is viewed in its shape and copied.
    return [
        torch.empty((count, *shape), device=drawn.device, dtype=dtype).copy_(block.view(count, *shape))
        for block, shape in zip(drawn.split(sizes, dim=1), shapes)
    ]


def _cpu_chunk(shared_numel: int, activation_numel: int, rows: int) -> int:
    # Per row: the random direction (float32 draws and their float64 copy: 1.5m, counted as 2m), and a tangent
    # of every saved activation in the forward and in the backward pass (2 per entry). Measured peak memory on
    # CNN6 and the DenseNet example at 3x16x16 lies within 10 % of this.
    per_row = 8 * (2 * shared_numel + 2 * activation_numel)
    return int(max(1, min(rows, MAX_CHUNK_ROWS, CPU_CHUNK_BYTES // max(per_row, 1))))


def _activation_numel(net: nn.Module, x: torch.Tensor, labels: torch.Tensor, loss: str) -> int:
    """Entries autograd saves for one forward pass and loss, parameters aside: the activations a row's tangents
    mirror."""
    total = [0]
    parameters = {p.data_ptr() for p in net.parameters()}

    def pack(tensor):
        if tensor.data_ptr() not in parameters:
            total[0] += tensor.numel()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _loss(net(x.clone().requires_grad_()), labels, loss)
    return total[0]


class _ForwardOverReverse:
    """rᵀJ = d/dε ∂L/∂x (θ + ε r): jvp of the input gradient along r, vmapped over a chunk of r."""

    def __init__(self, net, x, labels, loss, names):
        from torch.func import functional_call, grad, jvp, vmap

        parameters = {name: p.detach() for name, p in net.named_parameters()}
        buffers = {name: b.detach() for name, b in net.named_buffers()}
        shared = {name: parameters[name] for name in names}
        fixed = {name: p for name, p in parameters.items() if name not in shared}
        self.names = names

        def loss_of(shared_values, inputs):
            logits = functional_call(net, ({**fixed, **shared_values}, buffers), (inputs,))
            return _loss(logits, labels, loss)

        input_gradient = grad(loss_of, argnums=1)

        def row(direction):
            return jvp(lambda values: input_gradient(values, x), (shared,), (direction,))[1]

        self._rows = vmap(row)

    def __call__(self, directions: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self._rows(dict(zip(self.names, directions)))


class _ReverseOverReverse:
    """rᵀJ = ∂/∂x ⟨r, g(x)⟩ by a double backward through plain autograd, batched with is_grads_batched."""

    def __init__(self, net, x, labels, loss, names, why: Exception):
        self.x = x.clone().requires_grad_()
        named = dict(net.named_parameters())
        parameters = [named[name] for name in names]
        with torch.enable_grad():
            objective = _loss(net(self.x), labels, loss)
            custom = _custom_functions(objective.grad_fn)
            severed: list[tuple[str, str]] = []
            hooks = [node.register_hook(_severance_check(node, severed)) for node in custom]
            try:
                gradients = torch.autograd.grad(objective, parameters, create_graph=True, allow_unused=True)
            except RuntimeError as exc:
                raise _no_double_backward(exc, custom) from exc
            finally:
                for hook in hooks:
                    hook.remove()
        if severed:
            name, why = severed[0]
            raise ModelLoadError(
                f"{name} has no double backward: {why}, so ∂g/∂x cannot be taken through it",
                "write its backward with differentiable torch operations (or give the "
                "autograd.Function setup_context and jvp, for torch.func), or replace the op "
                "for this check",
            )
        self.pieces = [(g, p) for g, p in zip(gradients, parameters)]
        differentiable = [g.reshape(-1) for g, _ in self.pieces if g is not None and g.requires_grad]
        self.flat = torch.cat(differentiable) if differentiable else None
        # Which entries of R meet a gradient that depends on x: the rest multiply a constant and drop out.
        self.mask = [g is not None and g.requires_grad for g, _ in self.pieces]
        self.custom = custom
        self.why = why

    def __call__(self, directions: list[torch.Tensor]) -> torch.Tensor:
        count = directions[0].shape[0]
        if self.flat is None:
            return torch.zeros((count, *self.x.shape), dtype=self.x.dtype, device=self.x.device)
        cotangent = torch.cat([d.reshape(count, -1) for d, keep in zip(directions, self.mask) if keep], dim=1)
        try:
            (block,) = torch.autograd.grad(
                self.flat, self.x, grad_outputs=cotangent, retain_graph=True, is_grads_batched=True, allow_unused=True
            )
        except RuntimeError as exc:
            raise _no_double_backward(exc, self.custom) from exc
        if block is None:
            return torch.zeros((count, *self.x.shape), dtype=self.x.dtype, device=self.x.device)
        return block.detach()


def _custom_functions(root) -> list:
    """The custom autograd.Function nodes in a backward graph."""
    seen, stack, found = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "_forward_cls"):
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _function_name(node) -> str:
    cls = node._forward_cls
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ not in ("__main__", None) else cls.__qualname__


def _severance_check(node, severed: list[tuple[str, str]]):
    """A backward run with create_graph must return gradients autograd can differentiate again: ones that still
    require grad when its incoming gradients do, and not wrapped in the error node of @once_differentiable
    (whose inputs were computed without a graph, so a second backward may silently skip it instead of failing)."""

    def hook(grad_inputs, grad_outputs):
        incoming = any(g is not None and g.requires_grad for g in grad_outputs)
        outgoing = [g for g in grad_inputs if g is not None]
        if not incoming or not outgoing:
            return
        if any(g.grad_fn is not None and g.grad_fn.name() in _ERROR_NODES for g in outgoing):
            severed.append((_function_name(node), "its backward is marked @once_differentiable"))
        elif not any(g.requires_grad for g in outgoing):
            severed.append((_function_name(node), "its backward returns gradients computed outside autograd"))

    return hook


_ERROR_NODES = ("torch::autograd::Error", "torch::autograd::DelayedError")


def _no_double_backward(exc: RuntimeError, custom: list) -> ModelLoadError:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    fix = (
        "write the backward with differentiable torch operations (not @once_differentiable), or replace the op "
        "for this check"
    )
    if "once_differentiable" in message:
        marked = [_function_name(n) for n in custom if hasattr(n._forward_cls.backward, "__wrapped__")]
        name = marked[0] if marked else (_function_name(custom[0]) if custom else "a custom autograd.Function")
        return ModelLoadError(
            f"{name} has no double backward: its backward is marked @once_differentiable, so "
            "∂g/∂x cannot be taken through it",
            fix,
        )
    op = re.search(r"derivative for ['\"]?([\w.:]+)['\"]? is not implemented", message)
    if op:
        return ModelLoadError(
            f"{op.group(1)} has no double backward ({message}), so ∂g/∂x cannot be taken through it", fix
        )
    return ModelLoadError(f"the shared gradient cannot be differentiated with respect to the input: {message}", fix)


# ---- against the static verdict -----------------------------------------------------------------------------


def judge(verdict: str, rank: int, unknowns: int) -> tuple[bool | None, str, str]:
    """(confirms, agreement, judgement): full rank agrees with `exposed`, a deficit with `partial` and `protected`
    (spec §11; how much a deficit hides is the hidden-energy measurement's business); `boundary` has nothing to
    agree with (confirms None). `agreement` is the short form the table prints."""
    deficit = unknowns - rank
    measured = (
        "one gradient determines the input"
        if deficit == 0
        else f"{deficit} input directions are invisible to the gradient"
    )
    detail = (
        f"the gradient's Jacobian has full rank {rank} of {unknowns}: {measured}"
        if deficit == 0
        else f"the gradient's Jacobian has rank {rank} of {unknowns}: {measured}"
    )
    if verdict in ("exposed", "partial", "protected"):
        confirms = (deficit == 0) == (verdict == "exposed")
        if confirms:
            return True, f"confirms {verdict} ({measured})", f"confirms {verdict}: {detail}"
        return False, f"disagrees with {verdict} ({measured})", f"disagrees: the analysis says {verdict}, but {detail}"
    return (
        None,
        f"no verdict to compare with ({measured})",
        f"no verdict to compare with ({verdict or 'none'}): {detail}",
    )


def bound_check(identifiability, rank: int) -> dict | None:
    """The measured rank against the static upper bound of spec §9; a rank above it means the bound is wrong."""
    if identifiability is None:
        return None
    bound = int(identifiability.rank_bound)
    consistent = rank <= bound
    check = {"rank_bound": bound, "certified_deficit": int(identifiability.certified_deficit), "consistent": consistent}
    if not consistent:
        check["internal_error"] = (
            f"internal error: the measured rank {rank} exceeds the static upper bound {bound} (spec §9): the static "
            "bound is wrong for this model; please report it with this model file"
        )
    return check


def save_directions(directory, measurement: RankMeasurement) -> list[dict]:
    """The invisible input directions as .npy (raw, unit norm) and PNG (scaled to ±max|v| around mid-grey)."""
    from pathlib import Path

    if measurement.directions is None:
        return []
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    saved = []
    for index, (direction, value) in enumerate(zip(measurement.directions, measurement.direction_singular_values)):
        npy = directory / f"invisible_direction_{index}.npy"
        np.save(npy, direction)
        png = _save_direction_png(directory / f"invisible_direction_{index}.png", direction)
        saved.append({"index": index, "singular_value": value, "npy": str(npy), "png": png})
    return saved


def _save_direction_png(target, direction: np.ndarray) -> str | None:
    """One PNG per direction, the batch's samples side by side; None for inputs that are not images."""
    from PIL import Image

    if direction.ndim != 4 or direction.shape[1] not in (1, 3):
        return None
    peak = float(np.abs(direction).max()) or 1.0
    # Signed values around grey: the direction's sign is arbitrary, its pattern is the point.
    scaled = np.clip(0.5 + 0.5 * direction / peak, 0.0, 1.0)
    tiles = [np.transpose(sample, (1, 2, 0)) for sample in scaled]
    separator = np.ones((tiles[0].shape[0], 1, tiles[0].shape[2]))
    strip = np.concatenate([piece for tile in tiles for piece in (tile, separator)][:-1], axis=1)
    pixels = (strip * 255.0 + 0.5).astype(np.uint8)
    Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels).save(target)
    return str(target)
