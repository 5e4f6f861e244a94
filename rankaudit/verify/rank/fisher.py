"""--verify fisher: each sample's ‖J/C‖_F², the clipped gradient's Jacobian in the sample, and its Fisher line.

‖J‖_F² = tr(JᵀJ) = E ‖J ε‖² for Rademacher ε (Hutchinson), each ‖J ε‖² one Jacobian–vector product
(rankaudit.verify.jacobian_products): no Jacobian is formed. Probes are drawn PROBE_CHUNK at a time until the
standard error of the mean is at most TARGET_RELATIVE_SE of it (or MAX_PROBES are spent, said in the record).
Where d is at most EXACT_DIMENSION the exact ‖J‖_F² (d products along the unit vectors) is the figure and the
estimate beside it is the check. The DP reading (dFIL, the MSE floor, the PSNR ceiling, the least σ for a PSNR
target) is rankaudit.bound.fisher's. docs/method.md, "The Fisher floor under DP noise".

For callers other than the CLI::

    from rankaudit.verify.rank.fisher import measure_samples
    measured = measure_samples(model, images, labels, clip=1.0, loss="cross-entropy")
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.verify.jacobian_products import ClippedGradientProducts

TARGET_RELATIVE_SE = 0.02
MIN_PROBES = 16  # the standard error of fewer probes is itself too noisy to stop on
MAX_PROBES = 2048
PROBE_CHUNK = 8  # probes carried through one vmap'd pass
EXACT_DIMENSION = 256  # d at or below which the exact ‖J‖_F² is computed (d products) and the estimate checks it
DENSE_VALUES = 2**25  # |θ|·d at or below which J is kept whole (256 MiB in float64) for its dense rank check


def _rademacher(count: int, dimension: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 2, (count, dimension), generator=generator, dtype=torch.float64) * 2 - 1


def hutchinson(
    products: ClippedGradientProducts,
    x: torch.Tensor,
    *,
    seed: int = 0,
    target: float = TARGET_RELATIVE_SE,
    max_probes: int = MAX_PROBES,
    min_probes: int = MIN_PROBES,
    chunk: int = PROBE_CHUNK,
) -> dict:
    """The estimate of ‖J‖_F² with its standard error: {value, standard_error, relative_se, probes}."""
    generator = torch.Generator().manual_seed(seed)
    dimension = x.numel()
    values: list[float] = []
    while len(values) < max_probes:
        probes = _rademacher(min(chunk, max_probes - len(values)), dimension, generator)
        values += products.jvp(x, probes).pow(2).sum(dim=1).tolist()
        if len(values) >= min_probes:
            mean, error = _mean_and_error(values)
            if mean <= 0 or error <= target * mean:
                break
    mean, error = _mean_and_error(values)
    return {
        "value": mean,
        "standard_error": error,
        "relative_se": error / mean if mean > 0 else 0.0,
        "probes": len(values),
    }


def _mean_and_error(values: list[float]) -> tuple[float, float]:
    count = len(values)
    mean = math.fsum(values) / count
    if count < 2:
        return mean, math.inf
    variance = math.fsum((value - mean) ** 2 for value in values) / (count - 1)
    return mean, math.sqrt(variance / count)


def exact_frobenius_squared(products: ClippedGradientProducts, x: torch.Tensor, chunk: int = 64) -> float:
    """‖J‖_F² from J's d columns, J e_k, chunk at a time."""
    return sum(float(columns.pow(2).sum()) for columns in _columns(products, x, chunk))


def dense_jacobian(products: ClippedGradientProducts, x: torch.Tensor, chunk: int = 64) -> torch.Tensor:
    """J itself (|θ| x d), from its d columns: where it fits, for the dense rank check of the line with a prior."""
    return torch.cat(list(_columns(products, x, chunk))).T


def _columns(products: ClippedGradientProducts, x: torch.Tensor, chunk: int):
    """J e_k for the unit vectors, chunk at a time (rows: chunk x |θ|)."""
    dimension = x.numel()
    for start in range(0, dimension, chunk):
        basis = torch.zeros(min(chunk, dimension - start), dimension, dtype=torch.float64)
        basis[torch.arange(len(basis)), torch.arange(start, start + len(basis))] = 1.0
        yield products.jvp(x, basis)


# A Jacobian whose Frobenius norm is below this share of its terms' (s·J_g, before the clipping's derivative cancels
# them) is zero up to rounding: a single clipped scalar, or a gradient that only scales along one fixed direction.
NEGLIGIBLE = 1e-10


def carries_nothing(products: ClippedGradientProducts, x: torch.Tensor, seed: int = 0) -> bool:
    """Whether J is zero up to rounding at x: ‖J V‖ at most NEGLIGIBLE of ‖s·J_g V‖ on MIN_PROBES Rademacher
    probes (an exact zero of both counts too)."""
    probes = _rademacher(MIN_PROBES, x.numel(), torch.Generator().manual_seed(seed))
    moved = float(products.jvp(x, probes).square().sum())
    terms = float(products.scaled_jvp(x, probes).square().sum())
    return moved <= NEGLIGIBLE**2 * terms


def measure_samples(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    clip: float,
    loss: str,
    shared: list[str] | None = None,
    device: str = "cpu",
    seed: int = 0,
    target: float = TARGET_RELATIVE_SE,
    max_probes: int = MAX_PROBES,
    exact_dimension: int = EXACT_DIMENSION,
    progress: Callable[[int, int], None] | None = None,
    masks: dict[str, torch.Tensor] | None = None,
    chunk: int = PROBE_CHUNK,
    mean: torch.Tensor | None = None,
    rank_seconds: float | None = None,
    bn_mode: str = "eval",
) -> list[dict]:
    """For each sample (inputs: k x ...; labels: k): {label, frobenius_squared (‖J/C‖_F²), estimate,
    standard_error, relative_se, probes, exact, estimate_agrees, clipped, carries_nothing}; `chunk` probes per
    vmap'd pass. The model runs in float64 on `device`, in eval mode; BatchNorm reads its running statistics, or with
    `bn_mode` "train" each sample's own (a client whose batches hold one sample: DP-SGD's per-sample gradients share
    no batch statistics).

    With the reference mean `mean`, each sample's J also gets the rank check's reading (rankaudit.verify.rank.
    fisher_prior, at most `rank_seconds` each): {rank, rank_exact, hidden, directions, stopped}; an exact reading's
    tr(JᵀJ) is then the exact norm at any d."""
    from rankaudit.verify.client import client_mode
    from rankaudit.verify.rank.fisher_prior import nothing_seen, read_dense, read_visible

    net = client_mode(model.to(device=device, dtype=torch.float64), bn_mode)
    measured = []
    for number, (x, label) in enumerate(zip(inputs, labels)):
        x = x.to(device=device, dtype=torch.float64)
        products = ClippedGradientProducts(net, int(label), clip=clip, loss=loss, shared=shared, masks=masks)
        if carries_nothing(products, x, seed + number):
            one = {
                "label": int(label),
                "frobenius_squared": 0.0,
                "estimate": 0.0,
                "standard_error": 0.0,
                "relative_se": 0.0,
                "probes": MIN_PROBES,
                "exact": True,
                "estimate_agrees": None,
                "clipped": products.clipped(x),
                "carries_nothing": True,
            }
            measured.append(one | (_visible_keys(nothing_seen(x, mean)) if mean is not None else {}))
            if progress is not None:
                progress(number + 1, len(inputs))
            continue
        small = x.numel() <= exact_dimension
        if mean is not None and products.size * x.numel() <= DENSE_VALUES:
            # Where J fits, its d columns and one SVD cost less than the matrix-free reading (no transposed
            # products, no reorthogonalisation), and give the exact norm too.
            jacobian = dense_jacobian(products, x)
            visible = read_dense(jacobian, x, mean)
        elif mean is not None:
            visible = read_visible(products, x, mean, seed=seed + number, budget_seconds=rank_seconds)
        else:
            visible = None
        read_exactly = visible is not None and visible["trace"] is not None
        # With an exact norm (small d, or the exact reading's trace) the estimate beside it is a check, MIN_PROBES
        # probes suffice.
        estimate = hutchinson(
            products,
            x,
            seed=seed + number,
            target=target,
            max_probes=MIN_PROBES if small or read_exactly else max_probes,
            chunk=chunk,
        )
        exact = visible["trace"] if read_exactly else exact_frobenius_squared(products, x) if small else None
        one = {
            "label": int(label),
            "frobenius_squared": exact if exact is not None else estimate["value"],
            "estimate": estimate["value"],
            "standard_error": estimate["standard_error"],
            "relative_se": estimate["relative_se"],
            "probes": estimate["probes"],
            "exact": exact is not None,
            # The check: the estimate within four standard errors of the exact norm (None: no exact norm).
            "estimate_agrees": None
            if exact is None
            else abs(estimate["value"] - exact) <= 4 * estimate["standard_error"] + 1e-9 * exact,
            "clipped": products.clipped(x),
            "carries_nothing": False,
        }
        measured.append(one | (_visible_keys(visible) if visible is not None else {}))
        if progress is not None:
            progress(number + 1, len(inputs))
    return measured


def _visible_keys(visible: dict) -> dict:
    """The rank reading's keys a measured sample carries."""
    return {
        "rank": visible["rank"],
        "rank_exact": visible["rank_exact"],
        "hidden": visible["hidden"],
        "directions": visible["directions"],
        "stopped": visible["stopped"],
    }


def line_for(
    spec: str,
    input_shape: tuple[int, ...],
    dp,
    *,
    psnr_target: float,
    data: str | None = None,
    samples: int = 4,
    seed: int = 0,
    device: str = "auto",
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
    target: float = TARGET_RELATIVE_SE,
    edit: Callable[[nn.Module], dict | None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    bn_mode: str = "eval",
    batch_size: int = 1,
    rank_seconds: float | None = None,
    what: str = "--verify fisher",
) -> dict:
    """The Fisher line of model `spec` (at --weights, else its seeded initialisation; `edit` changes the real model
    first, and may return masks of the parameter entries the edited design lacks) on the first `samples` samples like the user's, at the DP settings `dp` (DPSettings: σ, C, q, T): the
    record of --verify fisher (rankaudit.bound.fisher.read_samples's keys, plus clip, weights, inputs, estimator,
    probes, seconds, device and notes). Each sample's J also gets the rank check's reading against the reference
    mean (at most `rank_seconds` each), for the line of the attacker with that prior. A client whose BatchNorm
    normalises each batch of `batch_size` > 1 on its own statistics (`bn_mode` "train") is refused: DP-SGD's
    per-sample gradient is not defined there."""
    from rankaudit.bound import fisher as fisher_bound
    from rankaudit.verify.client import draw_labels, logits_of, loss_name_for
    from rankaudit.verify.inputs import inputs_of_shape
    from rankaudit.verify.model import build_real_model, require_trainable, resolve_device, weights_phrase
    from rankaudit.verify.rank.fisher_prior import prior_notes, reference_mean, refuse_batch_statistics
    from rankaudit.verify.rank.jacobian import shared_parameter_names

    started = time.perf_counter()
    device = resolve_device(device)
    model, weights = build_real_model(spec, input_shape, seed)
    masks = edit(model) if edit is not None else None
    require_trainable(model, "--verify fisher")
    refuse_batch_statistics(model, bn_mode, batch_size, what)
    shared = shared_parameter_names(model, shared_layers, withheld_layers)
    images, source = inputs_of_shape(input_shape, data, samples, seed)
    with torch.no_grad():
        classes = logits_of(model(images[:1])).numel()
    loss = loss_name_for(classes)
    labels = draw_labels(len(images), loss, classes, seed)
    mean, reference = reference_mean(tuple(input_shape), data, seed)
    try:
        measured = measure_samples(
            model,
            images,
            labels,
            clip=dp.clip,
            loss=loss,
            shared=shared,
            device=device,
            seed=seed,
            target=target,
            progress=progress,
            masks=masks,
            mean=mean,
            rank_seconds=rank_seconds,
            bn_mode=bn_mode,
        )
    except ValueError as exc:
        if "more than 1 value per channel" not in str(exc):
            raise
        raise UsageError(
            f"{what}: BatchNorm in training mode cannot normalise a batch of one sample over its channels alone",
            "replace BatchNorm with GroupNorm or LayerNorm, as DP training needs, or give --bn-mode eval if the "
            "client trains with BatchNorm on its running statistics",
        ) from exc
    dimension = images[0].numel()
    line = fisher_bound.read_samples(
        measured,
        dimension=dimension,
        noise_multiplier=dp.noise_multiplier,
        sample_rate=dp.sample_rate,
        steps=dp.steps,
        psnr_target=psnr_target,
    )
    probes = [one["probes"] for one in measured]
    exact = sum(one["exact"] for one in measured)
    notes = [
        f"weights: {weights}",
        f"inputs: {source}",
        f"loss: {loss}, labels drawn with seed {seed}",
        f"the sample takes part in at most q·T = {dp.sample_rate:.4g} × {dp.steps:,} = "
        f"{line['participations']:.4g} steps' worth of information, each step read at these weights",
    ]
    if any(isinstance(module, nn.modules.batchnorm._BatchNorm) for module in model.modules()):
        notes.append(
            "BatchNorm normalises each sample on its own statistics (batches of one sample, in training mode)"
            if bn_mode == "train"
            else "BatchNorm reads its running statistics (--bn-mode eval: DP-SGD's per-sample gradients share no "
            "batch statistics)"
        )
    notes += prior_notes(measured, reference, rank_seconds)
    disagree = [number for number, one in enumerate(measured) if one["estimate_agrees"] is False]
    if disagree:
        notes.append(
            f"the estimate misses the exact norm by more than four standard errors for sample(s) "
            f"{', '.join(map(str, disagree))}: the figure is the exact norm"
        )
    estimated = [one for one in measured if not one["exact"]]
    worst_se = max((one["relative_se"] for one in estimated), default=0.0)
    if worst_se > target:
        notes.append(
            f"the estimate's relative standard error reached {worst_se:.1%} after {max(probes):,} probes "
            f"(the most drawn), above the {target:.0%} asked"
        )
    if exact == len(measured) and dimension > EXACT_DIMENSION:
        estimator = (
            "exact ‖J‖_F² from each sample's exact rank check (the dense J, or block Lanczos on JᵀJ); Hutchinson "
            f"with {min(probes):,} Rademacher probes its check"
        )
    elif exact == len(measured):
        estimator = (
            f"exact ‖J‖_F² from d = {dimension} Jacobian–vector products per sample; Hutchinson with "
            f"{min(probes):,} Rademacher probes its check"
        )
    else:
        estimator = (
            f"Hutchinson, {min(probes):,}-{max(probes):,} Rademacher probes per sample (relative standard error at "
            f"most {target:.0%})"
        )
    return {
        **line,
        "clip": dp.clip,
        "weights": weights_phrase(weights),
        "inputs": source,
        "estimator": estimator,
        "probes": sum(probes),
        "seconds": round(time.perf_counter() - started, 3),
        "device": device,
        "notes": notes,
    }
