"""The optimisation attack on a federated round's update (method.md: the round): inverting gradients, unrolled over local training.

The server knows θ₀, the round (N, B, E, lr, optimizer, C) and, as in the FedSGD attacks, every sample's label
and the batch order. It simulates the clients' local training from θ₀ on candidate inputs (rankaudit.verify.client)
and moves the candidates so that the simulated update points the way the observed one does: cosine distance between
the two updates plus a total-variation prior (Geiping et al. 2020's objective, rankaudit.verify.attacks.invert's helpers),
minimised with Adam on the sign of the input gradient, the candidates projected into [0, 1]. Every restart is one
row of a batch: ``vmap`` carries all of them (and, inside each, all C clients) through one pass, on the GPU when
present. With secure aggregation the server sees only Σ_c u_c: the candidates of all C clients are fitted to it
together, and each client's recovery is reported on its own.

R-GAP has no multi-step form (its closed form inverts one gradient layer by layer): for a round with more than one
step or client this is the attack `--verify rgap` runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.settings.round import Round
from rankaudit.verify.attacks.invert import DEFAULT_LR, DEFAULT_TV_UNTIL
from rankaudit.verify.attacks.invert_loop import adam_update
from rankaudit.verify.attacks.invert_match import gradient_distances, psnr_from_mse, total_variations
from rankaudit.verify.baselines import GREY_LEVEL
from rankaudit.verify.client import LocalTraining, check_local_training

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
# The learning rate drops tenfold at these fractions of the budget, as in the FedSGD attack.
MILESTONES = (3 / 8, 5 / 8, 7 / 8)
# The total-variation prior's weight, relative to the update distance's pull (see _prior_scale). Adam is fed the sign of
# the input gradient, so only how the prior's pull compares with the distance's counts, and that ratio swings by
# three orders of magnitude between nets: at the starting points mean |d distance/dx| / mean |d TV/dx| is 0.59 for
# the test suite's small LeakyReLU CNN and 3e-4 to 5e-4 for the sigmoid LeNet's 4-step round. A fixed weight cannot
# serve both: the single-gradient attack's 1e-2 is the best of 1e-2 ... 0 on the CNN (two-step round, photographs
# 42.9 / 43.3 dB against 29.8 / 30.8 dB at 1e-5), while on the LeNet it lets the prior decide every sign for 5/8 of
# the steps (1e-1, 1e-2, 1e-3 give the same images) and 1e-5 is best (benchmarks/bench_round_prior.py, N = 4,
# B = 1, 300 steps x 2 restarts, float64, median PSNR on 4 digits: 0 -> 12.2, 1e-6 -> 14.9, 3e-6 -> 16.7,
# 1e-5 -> 17.7, 1e-4 -> 15.0, 1e-3 -> 14.5, 1e-2 -> 14.4 dB; on 4 photograph crops 1e-2 -> 18.6, 1e-5 -> 23.1 dB).
# Scaled by the measured ratio, one relative weight lands near both optima: 0.02 x 0.59 = 1.2e-2, 0.02 x 4e-4 = 8e-6.
# Calibrated on rounds at 32 px beside breaching's attack (benchmarks/bench_breaching.py, 1,000 steps x 2 restarts,
# float64, docs/benchmarks.md), 0.02 is too weak: breaching's relative prior is about nine times stronger. Median
# PSNR on a LeNet's three rounds: 0.05 -> 24.4 / 18.6 / 33.3 dB, 0.2 -> 23.5 / 18.1 / 33.6 dB (breaching 20.6 /
# 15.5 / 30.2); on a ConvNet's round (N = 2, B = 1, E = 2) 0.05 -> 4.7 dB, 0.2 -> 9.0 dB (breaching 7.1). The
# price is on the test suite's small CNN at 8 px (two-step round, 150 x 4, float32): 0.02 -> 38.0 / 42.5,
# 0.05 -> 37.7 / 38.5, 0.1 -> 32.6 / 33.5, 0.2 -> 32.0 / 30.5 dB. 0.2 is the one that keeps pace at 32 px.
ROUND_TV_WEIGHT = 0.2
# The first restart's starting image: flat at the middle of [0, 1] (the mean colour of the uniform starts the other
# restarts draw, and the grey baseline itself), so that one candidate begins where an attack that reads nothing ends.
FLAT_START = GREY_LEVEL


@dataclass
class RoundAttack:
    """The attack on one round: reconstructions matched to the originals, errors per image and per client."""

    reconstructions: torch.Tensor  # (C, N, *sample), in the originals' order after matching
    mse: list[list[float]]  # [client][sample]
    psnr: list[list[float]]
    client_median_psnr: list[float]
    median_mse: float  # the median over all images (the mean of the two middle values for an even count)
    median_psnr: float  # the median of the images' PSNRs, the same way (not the PSNR of the median MSE)
    final_distance: float  # the winning restart's best distance to the observed update
    restarts: int
    steps: int
    seconds: float
    device: str
    candidates_per_pass: int  # restarts carried through one vmapped pass
    notes: list[str] = field(default_factory=list)
    best_distances: list[float] = field(default_factory=list)  # per restart: its best iterate's distance
    last_iterate_distances: list[float] = field(default_factory=list)  # per restart: its last iterate's distance
    dtype: str = "float64"
    tv_weight: float = math.nan
    tv_until: float = math.nan
    tv_weight_applied: float = math.nan  # tv_weight scaled by the distance's pull (_prior_scale)


def observed_update(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    round_: Round,
    loss: str,
    shared: list[str] | None = None,
) -> torch.Tensor:
    """The update the server receives: Σ_c (θ_K − θ₀) over the shared parameters, flat."""
    names = shared or [name for name, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        return LocalTraining(model, round_, loss, names).update(images, labels)


def invert_round(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    round_: Round,
    loss: str,
    *,
    shared: list[str] | None = None,
    steps: int = 1000,
    restarts: int = 2,
    lr: float = DEFAULT_LR,
    tv_weight: float = ROUND_TV_WEIGHT,
    tv_until: float = DEFAULT_TV_UNTIL,
    device: str | torch.device = "cpu",
    seed: int = 0,
    dtype: torch.dtype | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> RoundAttack:
    """Reconstruct ``images`` (C x N x ...) from the round's aggregated update; ``labels`` (C x N) are known.

    ``model`` holds θ₀. ``dtype`` defaults to the model's own (the verifier builds it in float64, the precision of
    the single-gradient attack): in float32 the cosine distance of two updates stops resolving a better fit long
    before the input is pinned down. All ``restarts`` run as one batch. Each restart keeps its best iterate (the
    lowest distance to the observed update, scored before every step and once after the last), and the restart
    whose best is lowest wins, as in :func:`rankaudit.verify.attacks.invert.invert_gradients`. The TV prior weighs
    ``tv_weight`` times the ratio of the distance's mean input gradient to the prior's at the starting points
    (see ROUND_TV_WEIGHT) for the first ``tv_until`` of the steps, then the update alone is fitted.
    """
    if images.shape[:2] != (round_.clients, round_.samples) or labels.shape != images.shape[:2]:
        raise UsageError(
            f"images {tuple(images.shape)} and labels {tuple(labels.shape)} do not match the round's "
            f"{round_.clients} client(s) x {round_.samples} samples",
            "give images shaped (clients, local samples, C, H, W) and labels (clients, local samples)",
        )
    if steps < 1 or restarts < 1:
        raise UsageError(f"{steps} steps x {restarts} restarts", "give at least one step and one restart")
    from torch.func import grad, vmap

    device = torch.device(device)
    dtype = dtype or next(model.parameters()).dtype
    started = time.perf_counter()
    net = _copy(model, device, dtype)
    names = shared or [name for name, p in net.named_parameters() if p.requires_grad]
    training = LocalTraining(net, round_, loss, names)
    truth = images.to(device=device, dtype=dtype)
    labels = labels.to(device)
    # In float32, as clients train, whatever precision the attack runs at: the same answer as --verify rank's check.
    check_local_training(net, round_, loss, truth, labels, "--verify rgap for the round")
    with torch.no_grad():
        target = training.update(truth, labels)
    if not torch.isfinite(target).all():
        raise UsageError(
            "the simulated round's update is not finite (the local training diverged)", "lower --lr or --local-epochs"
        )
    unit_target = (target / target.norm().clamp_min(1e-30)).unsqueeze(0)

    def distance_to_target(candidate: torch.Tensor) -> torch.Tensor:
        return gradient_distances([training.update(candidate, labels).unsqueeze(0)], [unit_target])[0]

    def objective(candidate: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        distance = distance_to_target(candidate)
        return distance + tv * prior(candidate), distance

    def prior(candidate: torch.Tensor) -> torch.Tensor:
        return total_variations(candidate.reshape(-1, *candidate.shape[2:])).mean()

    step_all = vmap(grad(objective, has_aux=True))
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand((restarts, *images.shape), generator=generator, dtype=dtype).to(device)
    # The prior's scale is read at the random starting points (a flat image has no TV gradient to scale by) ...
    applied = tv_weight * _prior_scale(vmap(grad(distance_to_target))(x), vmap(grad(prior))(x)) if tv_weight else 0.0
    # ... and then the first restart starts from a flat image at the range's mean colour: it begins at the grey
    # baseline, and its best iterate only moves away from it when that fits the update better.
    x[0] = FLAT_START
    tv = torch.full((), applied, device=device, dtype=dtype)
    first, second = torch.zeros_like(x), torch.zeros_like(x)
    steps_done = torch.zeros((), device=device, dtype=dtype)
    rate = torch.full((), lr, device=device, dtype=dtype)
    milestones = {max(1, int(steps * fraction)) for fraction in MILESTONES}
    tv_off = int(round(tv_until * steps))
    per_restart = (-1,) + (1,) * (x.dim() - 1)
    best_x, best = x.clone(), torch.full((restarts,), math.inf, device=device, dtype=dtype)
    with torch.no_grad():
        for step in range(steps):
            if step in milestones:
                rate.mul_(0.1)
            if step == tv_off:
                tv.zero_()  # the prior guides the start; the end fits the update alone
            input_grad, distance = step_all(x)
            _keep_best(x, distance, best_x, best, per_restart)
            x = adam_update(x, input_grad.sign(), first, second, steps_done, rate, ADAM_BETAS, ADAM_EPS).clamp_(0, 1)
            if progress is not None:
                progress(step + 1, steps)
        # The last projected iterate was never scored inside the loop.
        final = vmap(distance_to_target)(x)
        _keep_best(x, final, best_x, best, per_restart)
    winner = int(torch.argmin(best))
    reconstruction = _match(best_x[winner].double().cpu(), images.double().cpu(), labels.cpu())
    errors = (reconstruction - images.double().cpu()).pow(2).flatten(2).mean(2)
    mse = [[float(e) for e in client] for client in errors]
    psnr = [[psnr_from_mse(e) for e in client] for client in mse]
    median_mse = _median([e for client in mse for e in client])
    notes = [
        f"labels and batch order known to the server (as in the FedSGD attacks); {restarts} restarts x "
        f"{steps} steps in one vmapped batch in {str(dtype).replace('torch.', '')}; each restart keeps its "
        f"best iterate (least distance to the update), the best restart wins; the first restart starts from a "
        f"flat image at {FLAT_START:g} (the range's mean colour), the others uniformly at random",
        f"prior: total variation x {applied:.3g} ({tv_weight:g} x the ratio of the distance's mean input "
        f"gradient to the prior's at the starting points) for the first {tv_until:.0%} of the steps, then the "
        "update alone",
        "the aggregate is the same for any order of the clients and of same-label samples within a batch: "
        "reconstructions are matched to the originals of the same label by the assignment of least total MSE",
    ]
    return RoundAttack(
        reconstruction,
        mse,
        psnr,
        [_median(client) for client in psnr],
        median_mse,
        _median([p for client in psnr for p in client]),
        float(best[winner]),
        restarts,
        steps,
        time.perf_counter() - started,
        str(device),
        restarts,
        notes,
        best.tolist(),
        _finite_list(final),
        str(dtype).replace("torch.", ""),
        tv_weight,
        tv_until,
        applied,
    )


def _prior_scale(distance_grads: torch.Tensor, prior_grads: torch.Tensor) -> float:
    """mean |d distance/dx| / mean |d TV/dx| over the starting points: what makes the prior's weight relative.

    1 where either is zero or not finite (a flat start: nothing to scale by)."""
    distance_pull, prior_pull = float(distance_grads.abs().mean()), float(prior_grads.abs().mean())
    ratio = distance_pull / prior_pull if prior_pull > 0 else math.nan
    return ratio if math.isfinite(ratio) and ratio > 0 else 1.0


def _keep_best(
    x: torch.Tensor, distance: torch.Tensor, best_x: torch.Tensor, best: torch.Tensor, per_restart: tuple[int, ...]
) -> None:
    """Where a restart's iterate fits the update better than its best so far, it becomes the best (a NaN never
    does)."""
    improved = distance < best
    best_x.copy_(torch.where(improved.view(per_restart), x, best_x))
    best.copy_(torch.where(improved, distance, best))


def _finite_list(values: torch.Tensor) -> list[float]:
    return [float(v) if math.isfinite(float(v)) else math.inf for v in values]


def _copy(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(device=device, dtype=dtype).eval()


def _median(values: list[float]) -> float:
    """The true median: the middle value, or the mean of the two middle values for an even count."""
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def _match(reconstruction: torch.Tensor, originals: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Reorder the reconstructed samples onto the originals: a one-to-one assignment of least total MSE that pairs
    only samples of the same label (Hungarian method)."""
    from scipy.optimize import linear_sum_assignment

    sample_shape = originals.shape[2:]
    found = reconstruction.reshape(-1, *sample_shape)
    wanted = originals.reshape(-1, *sample_shape)
    flat_labels = labels.reshape(-1)
    cost = torch.cdist(wanted.flatten(1), found.flatten(1)).pow(2) / wanted[0].numel()
    cost = torch.where(flat_labels[:, None] == flat_labels[None, :], cost, torch.full_like(cost, 1e9))
    rows, columns = linear_sum_assignment(cost.numpy())
    ordered = torch.empty_like(wanted)
    ordered[torch.as_tensor(rows)] = found[torch.as_tensor(columns)]
    return ordered.reshape(originals.shape)


# The FedAvg inversion's limits, checked before any image is loaded: sample-gradient passes (each with
# its double backward; a small CNN does about 1e4 a second on a CPU core) and values its candidates hold at once.
MAX_SAMPLE_PASSES = 10**10
MAX_CANDIDATE_VALUES = 2 * 10**9


def check_attack_round_size(
    round_, sample_shape: tuple[int, ...], steps: int, restarts: int, verifier: str = "--verify rgap"
) -> None:
    """Refuse a round the inversion (or `verifier`'s one simulation of it: steps = restarts = 1) cannot finish, with
    the estimate and the flags that made it large, before any model code runs."""
    from rankaudit.settings.levels import count
    from rankaudit.verify.rank.round_jacobian import MAX_STEPS

    samples = round_.clients * round_.samples
    passes = steps * restarts * samples * round_.local_epochs
    values = samples * restarts * math.prod(sample_shape)
    if round_.steps > MAX_STEPS:
        raise UsageError(
            f"{verifier} unrolls all {round_.steps:,} local steps of the round ("
            f"{count(round_.local_epochs, 'epoch')} of {count(round_.samples, 'sample')} in batches of "
            f"{round_.batch_size:,}), above the "
            f"{MAX_STEPS} it supports",
            "check fewer --local-epochs or --local-samples, or a larger --batch-size",
        )
    if passes > MAX_SAMPLE_PASSES or values > MAX_CANDIDATE_VALUES:
        raise UsageError(
            f"{verifier} on this round would run {passes:.2g} sample-gradient passes ({steps:,} attack steps x "
            f"{restarts} restarts x {round_.clients:,} (--clients) x {round_.samples:,} (--local-samples) x "
            f"{round_.local_epochs:,} (--local-epochs)) and hold {values:.2g} candidate values; the most it runs is "
            f"{MAX_SAMPLE_PASSES:.0e} passes and {MAX_CANDIDATE_VALUES:.0e} values",
            "lower --clients, --local-samples, --local-epochs or --steps",
        )
