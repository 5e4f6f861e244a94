"""--verify rank for a federated round: the numerical rank of J = ∂u/∂X, the update's Jacobian in all C·N·|x| inputs.

the round section's exact check, sketched as method.md: numerical check does the single gradient (rankaudit.verify.rank.jacobian): S = R·J with
min(|θ_s|, n) + 16 Gaussian rows, each row rᵀJ = ∂/∂X ⟨r, u(X)⟩ a vector-Jacobian product through the unrolled
local training (a double backward through every step, and through the weights later steps receive from earlier
ones); ``torch.func.vjp`` records the training once and ``vmap`` pushes a chunk of rows back through it together.
Rank, tolerance and gap come from rank.py's spectrum, so the fields mean what they mean there.

Size limits: n = C·N·|x| as the device's memory allows (the sketch and its SVD, verify/budget.py's rule), and K = E·⌈N/B⌉ local steps at most
MAX_STEPS (the recorded training keeps every step's activations and their gradients, K times one step's memory,
for as long as the sketch runs).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.settings.round import Round
from rankaudit.verify import finite
from rankaudit.verify.client import (
    LocalTraining,
    client_mode,
    logits_of,
    loss_name_for,
    simulated_rounds,
    unknowns_of,
)
from rankaudit.verify.rank.budget import check_size, memory_budget, sketch_bytes

# The single gradient's sketch machinery, shared so that the round's numbers mean what the single gradient's do.
from rankaudit.verify.rank.jacobian import OVERSAMPLING
from rankaudit.verify.rank.measurement import RankMeasurement
from rankaudit.verify.rank.sketch import _activation_numel, _math_attention, fill_in_chunks
from rankaudit.verify.rank.spectrum import _spectrum, sample_ranks

MAX_STEPS = 64


def check_round_size(round_: Round, sample_shape: tuple[int, ...], device: str | torch.device = "cpu"):
    """Refuse a round the sketch cannot hold on ``device`` (the single gradient's memory rule, budget.py), or
    one with more local steps than the recording can keep, before any work."""
    unknowns = unknowns_of(round_, sample_shape)
    # At most n + 16 rows (min(|θ_s|, n) + 16 once the model is known); the vectors only with --artifacts.
    check_size(
        unknowns,
        unknowns + OVERSAMPLING,
        tuple(sample_shape),
        round_.clients * round_.samples,
        device=device,
        counted_by={"--clients": round_.clients, "--local-samples": round_.samples},
    )
    if round_.steps > MAX_STEPS:
        raise UsageError(
            f"--verify rank records all {round_.steps} local steps of the round, above the {MAX_STEPS} it supports",
            "check fewer --local-epochs or a larger --batch-size",
        )


def measure_round(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    round_: Round,
    shared: list[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    loss: str | None = None,
    directions: int = 0,
    chunk_rows: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    hidden: bool = False,
    centre=None,
) -> RankMeasurement:
    """rank(∂u/∂X) for the round's update at ``inputs`` (C x N x ...) with ``labels`` (C x N), in float64.

    u is Σ_c (θ_K − θ₀) over the ``shared`` parameters (names; default every trainable one). The same fields as
    rank.measure; ``unknowns`` is C·N·|x| and ``shared_gradient_size`` the update's |θ_s| values. ``hidden``: also
    P c over all C·N samples, shaped (C·N, *sample), as rank.measure (the verdicts applies to the round section's inputs).
    """
    device = torch.device(device)
    if inputs.shape[:2] != (round_.clients, round_.samples) or labels.shape != inputs.shape[:2]:
        raise UsageError(
            f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} do not match the round's "
            f"{round_.clients} client(s) x {round_.samples} samples",
            "give inputs shaped (clients, local samples, *sample) and labels (clients, local samples)",
        )
    check_round_size(round_, tuple(inputs.shape[2:]), device)
    started = time.perf_counter()
    net = _float64_copy(model, device, round_.bn_mode)
    x = inputs.detach().to(device=device, dtype=torch.float64)
    labels = labels.to(device)
    if loss is None:
        with torch.no_grad(), _math_attention():
            loss = loss_name_for(logits_of(net(x[0, : round_.batch_size]))[:1].numel())
    trainable = [name for name, p in net.named_parameters() if p.requires_grad]
    names = trainable if shared is None else list(dict.fromkeys(shared))
    missing = [name for name in names if name not in trainable]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} is not a trainable parameter of {type(model).__name__}",
            "name parameters from model.named_parameters() that require grad",
        )
    rounds = simulated_rounds(round_)  # every round's update stacked, the weights moving (method.md: the round)
    training = LocalTraining(net, round_, loss, names, rounds=rounds, seed=seed)
    unknowns, m = int(x.numel()), training.values
    rows = min(m, unknowns) + OVERSAMPLING
    sketch = torch.zeros(rows, unknowns, dtype=torch.float64, device=device)
    used_chunk = 0
    if names:
        per_step = _activation_numel(net, x[0, : round_.batch_size], labels[0, : round_.batch_size], loss)
        with _math_attention():
            used_chunk = _fill(
                training,
                x,
                labels,
                sketch,
                seed=seed,
                chunk_rows=chunk_rows,
                progress=progress,
                activation_numel=per_step * round_.steps * round_.clients * rounds,
            )
    if not finite.all_finite(sketch):
        # No SVD of non-finite numbers: the update or its derivative overflowed somewhere in the local training.
        raise finite.NonFiniteError(
            "--verify rank for the round: the update's derivative is not finite at the inputs, so no rank is reported",
            finite.FIX,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    sketched = time.perf_counter()
    # The hidden energy needs the SVD's vectors; where they do not fit, it is reported as unmeasured.
    fits = sketch_bytes(rows, unknowns, vectors=True) <= memory_budget(device)[0]
    want_vectors = directions > 0 or (hidden and fits)
    spectrum = _spectrum(sketch, want_vectors=want_vectors)
    per_sample = sample_ranks(sketch, round_.clients * round_.samples, spectrum.rank)
    found, found_values = None, []
    if spectrum.right_vectors is not None and spectrum.rank < unknowns:
        take = min(directions, unknowns - spectrum.rank)
        found = spectrum.right_vectors[unknowns - take :].flip(0).reshape(take, *x.shape).cpu().numpy()
        padded = np.concatenate([spectrum.values, np.zeros(max(0, unknowns - spectrum.values.size))])
        found_values = [float(v) for v in padded[unknowns - take :][::-1]]
    invisible = None
    if hidden:
        from rankaudit.verify.rank import hidden as hidden_part

        flat = x.reshape(-1, *x.shape[2:])
        invisible = hidden_part.measured_invisible(flat, spectrum.right_vectors, spectrum.rank, centre)
    return RankMeasurement(
        unknowns=unknowns,
        rank=spectrum.rank,
        deficit=unknowns - spectrum.rank,
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
        method="reverse-over-reverse (vmap)",
        loss=loss,
        sketch_rows=rows,
        chunk_rows=used_chunk,
        shared_gradient_size=m,
        shared_parameters=names,
        directions=found,
        direction_singular_values=found_values,
        invisible=invisible,
        sample_ranks=per_sample,
    )


def _float64_copy(model: nn.Module, device: torch.device, bn_mode: str) -> nn.Module:
    import copy

    return client_mode(copy.deepcopy(model).to(device=device, dtype=torch.float64), bn_mode)


def _fill(
    training: LocalTraining,
    x: torch.Tensor,
    labels: torch.Tensor,
    sketch: torch.Tensor,
    *,
    seed: int,
    chunk_rows: int | None,
    progress,
    activation_numel: int,
) -> int:
    """Write R·J into ``sketch`` a chunk of rows at a time (rank.py's chunking); returns the chunk size used."""
    from torch.func import vjp, vmap

    with torch.no_grad():  # torch.func records its own graph; plain autograd need not record the module's
        _, pullback = vjp(lambda inputs: training.update(inputs, labels), x)
    batched = vmap(pullback)

    def rows_of(directions: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return batched(directions[0])[0]

    return fill_in_chunks(
        sketch,
        [(training.values,)],
        rows_of,
        seed=seed,
        chunk_rows=chunk_rows,
        progress=progress,
        activation_numel=lambda: activation_numel,
        too_large="one row of the round's rank sketch does not fit in the GPU's free memory",
        fix="use --device cpu, or a smaller round or --input-shape",
    )
