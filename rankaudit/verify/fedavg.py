"""The optimisation attack on a federated round's update (spec §12): inverting gradients, unrolled over local training.

The server knows θ₀, the round (N, B, E, lr, optimizer, C) and, as in the FedSGD attacks, every sample's label
and the batch order. It simulates the clients' local training from θ₀ on candidate inputs (rankaudit.verify.client)
and moves the candidates so that the simulated update points the way the observed one does: cosine distance between
the two updates plus a total-variation prior (Geiping et al. 2020's objective, rankaudit.verify.invert's helpers),
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
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.round import Round
from rankaudit.verify.client import LocalTraining, check_local_training
from rankaudit.verify.invert import (DEFAULT_LR, DEFAULT_TV_UNTIL, DEFAULT_TV_WEIGHT, adam_update,
                                     gradient_distances, psnr_from_mse, total_variations)

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
# The learning rate drops tenfold at these fractions of the budget, as in the FedSGD attack.
MILESTONES = (3 / 8, 5 / 8, 7 / 8)


@dataclass
class RoundAttack:
    """The attack on one round: reconstructions matched to the originals, errors per image and per client."""

    reconstructions: torch.Tensor      # (C, N, *sample), in the originals' order after matching
    mse: list[list[float]]             # [client][sample]
    psnr: list[list[float]]
    client_median_psnr: list[float]
    median_mse: float
    median_psnr: float
    final_distance: float              # the best restart's cosine distance to the observed update
    restarts: int
    steps: int
    seconds: float
    device: str
    candidates_per_pass: int           # restarts carried through one vmapped pass
    notes: list[str] = field(default_factory=list)


def observed_update(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, round_: Round, loss: str,
                    shared: list[str] | None = None) -> torch.Tensor:
    """The update the server receives: Σ_c (θ_K − θ₀) over the shared parameters, flat."""
    names = shared or [name for name, p in model.named_parameters() if p.requires_grad]
    with torch.no_grad():
        return LocalTraining(model, round_, loss, names).update(images, labels)


def invert_round(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, round_: Round, loss: str, *,
                 shared: list[str] | None = None, steps: int = 1000, restarts: int = 2, lr: float = DEFAULT_LR,
                 tv_weight: float = DEFAULT_TV_WEIGHT, device: str | torch.device = "cpu", seed: int = 0,
                 dtype: torch.dtype = torch.float32,
                 progress: Callable[[int, int], None] | None = None) -> RoundAttack:
    """Reconstruct ``images`` (C x N x ...) from the round's aggregated update; ``labels`` (C x N) are known.

    ``model`` holds θ₀. All ``restarts`` run as one batch; the best (lowest final distance) is kept.
    """
    if images.shape[:2] != (round_.clients, round_.samples) or labels.shape != images.shape[:2]:
        raise UsageError(f"images {tuple(images.shape)} and labels {tuple(labels.shape)} do not match the round's "
                         f"{round_.clients} client(s) x {round_.samples} samples",
                         "give images shaped (clients, local samples, C, H, W) and labels (clients, local samples)")
    if steps < 1 or restarts < 1:
        raise UsageError(f"{steps} steps x {restarts} restarts", "give at least one step and one restart")
    from torch.func import grad_and_value, vmap

    device = torch.device(device)
    started = time.perf_counter()
    net = _copy(model, device, dtype)
    names = shared or [name for name, p in net.named_parameters() if p.requires_grad]
    training = LocalTraining(net, round_, loss, names)
    truth = images.to(device=device, dtype=dtype)
    labels = labels.to(device)
    with torch.no_grad():
        target = training.update(truth, labels)
    if not torch.isfinite(target).all():
        check_local_training(net, round_, loss, truth, labels, "--verify rgap for the round")   # names the cause
        raise UsageError("the simulated round's update is not finite (the local training diverged)",
                         "lower --lr or --local-epochs")
    unit_target = (target / target.norm().clamp_min(1e-30)).unsqueeze(0)
    tv = torch.full((), tv_weight, device=device, dtype=dtype)

    def objective(candidate: torch.Tensor) -> torch.Tensor:
        update = training.update(candidate, labels).unsqueeze(0)
        distance = gradient_distances([update], [unit_target])[0]
        return distance + tv * total_variations(candidate.reshape(-1, *candidate.shape[2:])).mean()

    step_all = vmap(grad_and_value(objective))
    generator = torch.Generator().manual_seed(seed)
    x = torch.rand((restarts, *images.shape), generator=generator, dtype=dtype).to(device)
    first, second = torch.zeros_like(x), torch.zeros_like(x)
    steps_done = torch.zeros((), device=device, dtype=dtype)
    rate = torch.full((), lr, device=device, dtype=dtype)
    milestones = {max(1, int(steps * fraction)) for fraction in MILESTONES}
    tv_off = int(round(DEFAULT_TV_UNTIL * steps))
    with torch.no_grad():
        for step in range(steps):
            if step in milestones:
                rate.mul_(0.1)
            if step == tv_off:
                tv.zero_()   # the prior guides the start; the end fits the update alone
            input_grad, _ = step_all(x)
            x = adam_update(x, input_grad.sign(), first, second, steps_done, rate, ADAM_BETAS, ADAM_EPS).clamp_(0, 1)
            if progress is not None:
                progress(step + 1, steps)
        final = vmap(lambda c: gradient_distances([training.update(c, labels).unsqueeze(0)], [unit_target])[0])(x)
    finite = torch.where(torch.isfinite(final), final, torch.full_like(final, math.inf))
    best = int(torch.argmin(finite))
    reconstruction = _match(x[best].double().cpu(), images.double().cpu(), labels.cpu())
    errors = (reconstruction - images.double().cpu()).pow(2).flatten(2).mean(2)
    mse = [[float(e) for e in client] for client in errors]
    psnr = [[psnr_from_mse(e) for e in client] for client in mse]
    flat = sorted(e for client in mse for e in client)
    median_mse = float(torch.tensor(flat).median())
    notes = [f"labels and batch order known to the server (as in the FedSGD attacks); {restarts} restarts x "
             f"{steps} steps in one vmapped batch, the best by its final distance kept",
             "the aggregate is the same for any order of the clients and of same-label samples within a batch: "
             "reconstructions are matched to the originals of the same label by the assignment of least total MSE"]
    return RoundAttack(reconstruction, mse, psnr, [_median(client) for client in psnr], median_mse,
                       psnr_from_mse(median_mse), float(final[best]), restarts, steps, time.perf_counter() - started,
                       str(device), restarts, notes)


def _copy(model: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    import copy

    return copy.deepcopy(model).to(device=device, dtype=dtype).eval()


def _median(values: list[float]) -> float:
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
