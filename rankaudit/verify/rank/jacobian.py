"""--verify rank: the numerical rank of J = ∂g/∂x, the shared gradient's Jacobian in the input (method.md: numerical check).

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

The steps live beside this module, in the order the data flows: the rows of S in :mod:`.sketch`, the rank decided
from its singular values in :mod:`.spectrum`, the record and its readings in :mod:`.measurement`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import time
from collections.abc import Callable, Iterable

import numpy as np
import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.verify import finite
from rankaudit.verify.client import client_mode, logits_of, loss_name_for, mean_loss
from rankaudit.verify.rank.budget import check_size, memory_budget, sketch_bytes
from rankaudit.verify.rank.measurement import RankMeasurement
from rankaudit.verify.rank.sketch import _fill_sketch, _math_attention, full_float32, shared_names
from rankaudit.verify.rank.spectrum import _Spectrum, _spectrum, sample_ranks
from rankaudit.verify.substitute import differentiable_ops

# Extra rows over min(m, n): a Gaussian sketch with that many rows plus p has rank(S) = rank(J) with probability 1
# for any p >= 0; p = 16 keeps the smallest kept singular value of S close to J's (a square Gaussian is
# ill-conditioned).
OVERSAMPLING = 16
MAX_DIRECTIONS = 16
# --verify rank's precision choice (see _float32_attempt): a float32 sketch shows full rank when its σ_min clears
# float32's error floor this many times over; PRECISION_PROBE_ROWS rows recomputed in float64 measure that error.
PRECISIONS = ("auto", "float64", "float32")
FLOAT32_MARGIN = 10.0
PRECISION_PROBE_ROWS = 8
LOSSES = ("cross-entropy", "logistic")


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

    # A module or buffer that holds no trainable parameter (an affine-free norm, `bn1.running_mean`) sends nothing.
    known = [name for name, _ in model.named_modules() if name] + [name for name, _ in model.named_buffers()]
    unmatched = [layer for layer in named if not any(owned_by(p, layer) for p in trainable) and layer not in known]
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


def sent_statistics(
    model: nn.Module, shared_layers: Iterable[str] | None = None, withheld_layers: Iterable[str] | None = None
) -> list[str]:
    """The running statistics a client in training mode sends with its update (a state_dict, not only
    parameters()): every BatchNorm's running_mean and running_var keys, those --shared-layers covers or
    --withheld-layers does not. Each moves by m·(the batch's mean or unbiased variance of the norm's input)."""
    named = list(shared_layers or withheld_layers or [])

    def covered(key: str) -> bool:
        return any(key == name or key.startswith(name + ".") for name in named)

    keys = [
        f"{name}.{buffer}"
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats
        for buffer in ("running_mean", "running_var")
    ]
    if shared_layers:
        return [key for key in keys if covered(key)]
    return [key for key in keys if not covered(key)]


def statistics_jacobian(net: nn.Module, x: torch.Tensor, keys: list[str]) -> torch.Tensor:
    """∂s/∂x for s the batch means and unbiased variances of the inputs of the BatchNorms whose running statistics
    `keys` names, per channel: the running statistic (1-m)·old + m·s moves along exactly these rows (m ≠ 0, so the
    rows span the same space). `net` in training mode; one row per channel and statistic."""
    modules = dict(net.named_modules())
    wanted = list(dict.fromkeys(key.rsplit(".", 1)[0] for key in keys))
    seen: dict[str, list[torch.Tensor]] = {}
    hooks = [
        modules[name].register_forward_pre_hook(lambda module, args, name=name: seen[name].append(args[0]))
        for name in wanted
    ]

    def statistics(inputs: torch.Tensor) -> torch.Tensor:
        seen.clear()
        seen.update({name: [] for name in wanted})
        net(inputs)
        values = []
        for key in keys:
            name, buffer = key.rsplit(".", 1)
            for read in seen[name]:  # a module called twice updates its statistics twice
                dims = [0, *range(2, read.dim())]
                values.append(read.mean(dim=dims) if buffer == "running_mean" else read.var(dim=dims, unbiased=True))
        return torch.cat(values) if values else inputs.new_zeros(0)

    try:
        with _math_attention():
            rows = torch.autograd.functional.jacobian(statistics, x)
    finally:
        for hook in hooks:
            hook.remove()
    return rows.reshape(-1, x.numel())


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
    bn_mode: str = "eval",
    centre=None,
    statistics: Iterable[str] = (),
) -> RankMeasurement:
    """rank(∂g/∂x) for the batch ``images`` (B x ...) with ``labels`` (B), all in float64 on ``device``.

    g is the gradient of the mean loss over the batch with respect to the ``shared`` parameters (names; default
    every trainable one). ``loss``: "cross-entropy" or "logistic" (default: logistic for a single logit).
    The model is copied, moved to ``device`` in float64 and put in eval mode, its BatchNorm in ``bn_mode``
    (verify.client.client_mode: "train" normalises with the batch's own statistics, as a client in training mode
    does; "eval" with the running ones); attention runs under the math SDPA backend, the only one with a
    double backward. ``directions``: also return up to that many right singular vectors of dropped singular
    values (a full SVD instead of singular values only). ``chunk_rows``: rows per batched pass (default: sized
    to the device's free memory). ``progress(done, total)`` runs after each chunk of rows. ``hidden``: also
    return P c, the batch's deviation from ``centre`` (the reference's mean sample; default each sample's own mean) projected onto the whole invisible subspace (method.md: verdicts; a full SVD
    with vectors unless the rank is full), for :mod:`rankaudit.verify.rank.hidden`. ``precision``:
    "float64" (the reference), "auto" (a float32 sketch first, kept only when it shows full rank with σ_min at
    least FLOAT32_MARGIN times above both float32's tolerance and its measured error, else float64; see
    _float32_attempt) or "float32" (unchecked; for benchmarks). ``statistics``: the running statistics the client
    sends beside the gradient (sent_statistics); in training mode their exact Jacobian (statistics_jacobian) joins
    the sketch's rows, so the rank is that of everything the server reads.

    Raises UsageError when the sketch does not fit the device's memory (check_size) and ModelLoadError (exit 3)
    when an op has no double backward.
    """
    device = torch.device(device)
    unknowns = int(images.numel())
    if labels.shape[0] != images.shape[0]:
        raise UsageError(f"{images.shape[0]} images but {labels.shape[0]} labels", "give one label per image")
    started = time.perf_counter()
    net = client_mode(copy.deepcopy(model).to(device=device, dtype=torch.float64), bn_mode)
    x = images.detach().to(device=device, dtype=torch.float64)
    labels = labels.to(device)
    if loss is None:
        with torch.no_grad(), _math_attention():
            loss = loss_name_for(logits_of(net(x))[:1].numel())
    if loss not in LOSSES:
        raise UsageError(f"unknown loss {loss!r}", "use cross-entropy or logistic")
    trainable, names = shared_names(net, shared, type(model).__name__)
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
    statistics = list(statistics) if bn_mode == "train" else []
    if statistics and precision != "float64":
        precision, precision_note = "float64", "float64: the running statistics' rows join the sketch"
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
        if statistics:
            sketch = _with_statistics(sketch, statistics_jacobian(net, x, statistics).reshape(-1, unknowns))
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

        invisible = hidden_part.measured_invisible(x, spectrum.right_vectors, rank, centre)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return RankMeasurement(
        unknowns=unknowns,
        rank=rank,
        deficit=unknowns - rank,
        tolerance=spectrum.tolerance,
        gap=spectrum.gap,
        reliable=spectrum.reliable(m),
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


def _with_statistics(sketch: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The sketch R·J with the statistics' rows below it, each scaled to the sketch's largest row norm (scaling a
    row changes no rank; it keeps the rows above the tolerance, which is relative to σ_max)."""
    scale = float(sketch.norm(dim=1).max()) if sketch.numel() and float(sketch.abs().max()) > 0 else 1.0
    norms = rows.norm(dim=1, keepdim=True)
    scaled = torch.where(norms > 0, rows / norms.clamp_min(1e-300) * scale, rows)
    return torch.cat([sketch, scaled.to(sketch)])


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
    with _math_attention(), differentiable_ops(), full_float32():
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
    spectrum_min = spectrum.sigma_min_kept
    if math.isfinite(relative) and clearance >= FLOAT32_MARGIN:
        spectrum = _from_below(spectrum, spectrum_min - error, spectrum.how)
        return (method, used_chunk, spectrum, sketched), (
            f"float32 rows: full rank with σ_min {spectrum_min:.3g}, {clearance:.3g}x the "
            f"float32 error {error:.3g} (rows off by up to {relative:.2g} of their norm against {probe} rows "
            f"recomputed in float64, times the sketch's norm); margin {FLOAT32_MARGIN:g}"
        )
    if math.isfinite(relative) and wide.shape[0] >= unknowns:
        refined = _trailing_rows_in_float64(net, x, labels, loss, names, wide, error, seed, method, used_chunk)
        if refined is not None and refined.sigma_min_at_least > spectrum.tolerance:
            lower = refined.sigma_min_at_least
            spectrum = _from_below(spectrum, lower, f"{spectrum.how}, its {refined.trailing} trailing rows in float64")
            return (method, used_chunk, spectrum, sketched), (
                f"float32 rows, the {refined.trailing} trailing ones recomputed in float64 "
                f"({refined.seconds:.1f} s): full rank with σ_min at least {lower:.3g}. The float32 sketch's σ_min "
                f"{spectrum_min:.3g} is only {clearance:.3g}x its float32 error {error:.3g} (margin "
                f"{FLOAT32_MARGIN:g}); its singular values past the {refined.trailing} smallest (from "
                f"{refined.next_singular_value:.3g}) clear it, and the rows along those {refined.trailing} were "
                "recomputed in float64"
            )
    return None, (
        f"the float32 sketch ({seconds}) showed full rank, but σ_min {spectrum_min:.3g} is only "
        f"{clearance:.3g}x its float32 error {error:.3g} (margin {FLOAT32_MARGIN:g}), so the rank was "
        "computed in float64"
    )


def _from_below(spectrum: _Spectrum, lower: float, how: str) -> _Spectrum:
    """A float32 sketch's spectrum kept at full rank, read in float64's terms: σ_min is a float64 lower bound, and
    the gap is that bound over float64's tolerance."""
    gap = lower / spectrum.tolerance if spectrum.tolerance else math.inf
    return dataclasses.replace(spectrum, gap=gap, sigma_min_kept=lower, right_vectors=None, how=how)


def _trailing_rows_in_float64(net, x, labels, loss, names, wide, error, seed, method, chunk):
    """The float32 sketch's σ_min from below with its trailing rows recomputed in float64 (verify.rank.refine), or
    None when the rest of the sketch does not clear the float32 error either."""
    from rankaudit.verify.rank.refine import trailing_rows_bound
    from rankaudit.verify.rank.sketch import _draw_rows, _ForwardOverReverse, _ReverseOverReverse, per_parameter

    named = dict(net.named_parameters())
    shapes = [tuple(named[name].shape) for name in names]
    width = sum(named[name].numel() for name in names)
    generator = torch.Generator(device=x.device)
    reuse: dict = {}
    with _math_attention(), differentiable_ops():
        if method == "reverse-over-reverse":  # the way the float32 rows were taken
            rows_of = _ReverseOverReverse(net, x, labels, loss, names, why=RuntimeError("as the float32 sketch"))
        else:
            rows_of = _ForwardOverReverse(net, x, labels, loss, names)
    step = max(1, chunk // 2)  # float64 rows take twice the float32 ones' memory

    def exact_rows(directions: torch.Tensor) -> torch.Tensor:
        parts = []
        with _math_attention(), differentiable_ops():
            for first in range(0, directions.shape[0], step):
                chunk_rows = directions[first : first + step]
                parts.append(rows_of(per_parameter(chunk_rows, shapes)).reshape(len(chunk_rows), -1))
        return torch.cat(parts)

    return trailing_rows_bound(
        wide,
        error,
        draw_rows=lambda first, count: _draw_rows(first, count, width, seed, generator, reuse),
        exact_rows=exact_rows,
        margin=FLOAT32_MARGIN,
        width=width,
        memory_bytes=memory_budget(x.device)[0],
    )


def _require_finite_gradient(
    net: nn.Module, x: torch.Tensor, labels: torch.Tensor, loss: str, parameters: list[torch.Tensor]
):
    """The output and the shared gradient at x must be finite before anything is sketched (spec: no figure from
    non-finite numbers); finite.py names the op that broke them."""

    def rerun():
        output = net(x)
        return output, mean_loss(output, labels, loss)

    with torch.enable_grad(), _math_attention(), differentiable_ops():
        output, objective = rerun()
        gradients = torch.autograd.grad(objective, parameters, allow_unused=True) if parameters else ()
        finite.require_finite(
            "--verify rank", (output, objective), gradients, model=net, rerun=rerun, parameters=parameters, inputs=x
        )
