"""--verify rank|rgap for a round that is not FedSGD -> Result.verification: the FedSGD fields plus the round.

`rank`: rank(∂u/∂X) of the round's (aggregated) update over all C·N·|x| inputs (rankaudit.verify.rank.round_jacobian).
`rgap`: R-GAP has no multi-step form, so the FedAvg inversion attack runs instead (rankaudit.verify.attacks.fedavg).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from rankaudit.errors import UsageError
from rankaudit.levels import count
from rankaudit.progress import ProgressBar
from rankaudit.report.json import round_dict
from rankaudit.result import Result
from rankaudit.verify import baselines
from rankaudit.verify.client import check_local_training
from rankaudit.verify.runner import (
    _against_baselines,
    _baseline_judgement,
    _confirms,
    _finite,
    _gap_text,
    _rank_inputs,
    _save_images,
    _what_the_gradient_shows,
    build_real_model,
    read_worst_sample,
    require_trainable,
    resolve_device,
)


def _inputs(result: Result, data: str | None, seed: int, what: str) -> tuple[torch.Tensor, str]:
    """C·N inputs shaped (C, N, *sample): real images where the input is one, seeded uniform values otherwise."""
    round_ = result.round
    if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
        raise UsageError(
            f"--verify {what} for a round differentiates the update with respect to one real-valued "
            "input, and this model takes several or token ids",
            "verify a model with a single float input",
        )
    flat, source = _rank_inputs(result, data, round_.clients * round_.samples, seed)
    return flat.reshape(round_.clients, round_.samples, *flat.shape[1:]), source


def _labels(model, inputs: torch.Tensor, seed: int) -> tuple[torch.Tensor, str]:
    from rankaudit.verify.rank import jacobian as rank

    with torch.no_grad():
        logits = rank.logits_of(model(inputs[0, :1])).numel()
    loss = rank.loss_name_for(logits)
    count = inputs.shape[0] * inputs.shape[1]
    return rank.draw_labels(count, loss, logits, seed).reshape(inputs.shape[:2]), loss


def verify_round_rank(
    result: Result,
    spec: str,
    *,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    artifacts: str | None = None,
    show_progress: bool = True,
    shared_layers=None,
    withheld_layers=None,
) -> dict:
    """Measure rank(∂u/∂X) for the round; fill result.verification['rank'] (one sketch over the whole round)."""
    from rankaudit.verify.rank import jacobian as rank
    from rankaudit.verify.rank import round_jacobian as round_rank

    round_ = result.round
    device = resolve_device(device)
    round_rank.check_round_size(round_, tuple(result.input_shape), device)
    model, weights = build_real_model(spec, result.input_shape, seed)
    shared = rank.shared_parameter_names(model, shared_layers, withheld_layers)
    inputs, source = _inputs(result, data, seed, "rank")
    labels, loss = _labels(model, inputs, seed)
    check_local_training(model, round_, loss, inputs, labels, "--verify rank for the round")
    with ProgressBar(1, "round rank sketch", enabled=show_progress) as bar:
        measured = round_rank.measure_round(
            model,
            inputs,
            labels,
            round_,
            shared,
            device=device,
            seed=seed,
            loss=loss,
            directions=rank.MAX_DIRECTIONS if artifacts else 0,
            hidden=True,
            progress=lambda done, rows: bar(done, rows),
        )
    if not all(math.isfinite(v) for v in (measured.sigma_max, measured.tolerance)):
        raise UsageError(
            "the round's sketch is not finite (the local training diverged at these weights)",
            "lower --lr or --local-epochs",
        )
    confirms, agreement, judgement = rank.judge(result.verdict, measured.rank, measured.unknowns)
    # rank.judge speaks of one gradient; here the Jacobian is the round's update's.
    agreement, judgement = (
        text.replace("one gradient", "the update")
        .replace("the gradient's", "the update's")
        .replace("to the gradient", "to the update")
        for text in (agreement, judgement)
    )
    bound = rank.bound_check(result.identifiability, measured.rank)
    notes = [
        f"weights: {weights}",
        f"inputs: {source}",
        f"loss: {loss}, labels drawn with seed {seed}; batch order fixed, the same each epoch",
        f"update: {len(shared)} parameter tensors, {measured.shared_gradient_size:,} values, "
        + ("summed over the clients (secure aggregation)" if round_.secure_aggregation else "one client"),
        f"sketch: {measured.sketch_rows} Gaussian rows x {measured.unknowns} unknowns in float64, each a "
        f"vector-Jacobian product through the {round_.steps} unrolled local steps, in chunks of "
        f"{measured.chunk_rows} rows; rank by {measured.spectrum}",
        "model in eval mode (BatchNorm on its running statistics) during local training",
    ]
    if not measured.reliable:
        notes.append(
            f"unreliable: the gap {_gap_text(measured.gap)} is under {rank.RELIABLE_GAP:g}, so the rank "
            "depends on where the tolerance falls"
        )
    saved = rank.save_directions(artifacts, _first_client_view(measured)) if artifacts else []
    # Spec §11 over the round's inputs: every client's samples in one projection, each sample's share reported.
    flat = inputs.reshape(-1, *inputs.shape[2:])
    seen = _what_the_gradient_shows(result, flat, [slice(0, len(flat))], [measured], artifacts)
    if measured.invisible is None:
        notes.append("hidden energy not measured: the SVD's vectors it needs did not fit the device's memory")
    verification = {
        "unknowns": measured.unknowns,
        "rank": measured.rank,
        "deficit": measured.deficit,
        "tolerance": measured.tolerance,
        "tolerance_rule": rank.TOLERANCE_RULE,
        "gap": _finite(measured.gap or math.nan),
        "reliable": measured.reliable,
        "sigma_max": measured.sigma_max,
        "sigma_min_kept": measured.sigma_min_kept,
        "seconds": round(measured.seconds, 3),
        "device": measured.device,
        "method": measured.method,
        "spectrum": measured.spectrum,
        "sketch_rows": measured.sketch_rows,
        "chunk_rows": measured.chunk_rows,
        "shared_gradient_size": measured.shared_gradient_size,
        "shared_parameters": shared,
        "batch_size": round_.batch_size,
        "loss": loss,
        "weights": weights,
        "inputs": source,
        "headline": "the whole round: every client's samples at once",
        "samples": [
            {
                "index": 0,
                "rank": measured.rank,
                "deficit": measured.deficit,
                "gap": _finite(measured.gap or math.nan),
                "reliable": measured.reliable,
                "seconds": round(measured.seconds, 3),
                "inputs": seen["inputs"][0],
            }
        ],
        "hidden_energy_median": seen["hidden_energy_median"],
        "visible_psnr_median": seen["visible_psnr_median"],
        "visible_ssim_median": seen["visible_ssim_median"],
        "visible_reading": seen["reading"] and seen["reading"].replace("the gradient", "the update"),
        "confirms": confirms,
        "agreement": agreement,
        "judgement": judgement,
        "verdict": result.verdict,
        "bound": bound,
        "internal_error": bound.get("internal_error") if bound else None,
        "directions": saved,
        "notes": notes,
        "round": round_dict(result),
    }
    read_worst_sample(verification, result, measured.sample_ranks, seen["inputs"][0], "update")
    result.verification["rank"] = verification
    return verification


def _first_client_view(measured):
    """Directions over (C, N, *sample) flattened to (C·N, *sample) so each saved image shows all samples."""
    import dataclasses

    if measured.directions is None:
        return measured
    shape = measured.directions.shape
    return dataclasses.replace(
        measured, directions=measured.directions.reshape(shape[0], shape[1] * shape[2], *shape[3:])
    )


# The FedAvg inversion's limits (issue 23), checked before any image is loaded: sample-gradient passes (each with
# its double backward; a small CNN does about 1e4 a second on a CPU core) and values its candidates hold at once.
MAX_SAMPLE_PASSES = 10**10
MAX_CANDIDATE_VALUES = 2 * 10**9


def check_attack_round_size(
    round_, sample_shape: tuple[int, ...], steps: int, restarts: int, verifier: str = "--verify rgap"
) -> None:
    """Refuse a round the inversion (or `verifier`'s one simulation of it: steps = restarts = 1) cannot finish, with
    the estimate and the flags that made it large, before any model code runs."""
    from rankaudit.levels import count
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


def verify_round_inputs(
    result: Result,
    spec: str,
    *,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    steps: int = 1000,
    restarts: int = 2,
    artifacts: str | None = None,
    show_progress: bool = True,
) -> dict:
    """The FedAvg inversion attack on the round's update; fill result.verification['rgap'] (R-GAP's slot: the input
    attack), with a per-client recovery."""
    from rankaudit.verify.attacks import fedavg

    round_ = result.round
    if len(result.input_shape) != 3:
        raise UsageError(
            f"--verify rgap attacks images; this model's input shape is {result.input_shape}",
            "verify a model whose input is C,H,W",
        )
    check_attack_round_size(round_, tuple(result.input_shape), steps, restarts)
    device = resolve_device(device)
    model, weights = build_real_model(spec, result.input_shape, seed)
    require_trainable(model, "--verify rgap for the round")
    images, source = _inputs(result, data, seed, "rgap")
    labels, loss = _labels(model, images, seed)
    with ProgressBar(
        steps,
        f"FedAvg inversion ({count(round_.steps, 'local step')}, {count(round_.clients, 'client')})",
        enabled=show_progress,
    ) as bar:
        attack = fedavg.invert_round(
            model,
            images,
            labels,
            round_,
            loss,
            steps=steps,
            restarts=restarts,
            device=device,
            seed=seed,
            progress=lambda done, total: bar(done, total),
        )
    flat_originals = images.reshape(-1, *images.shape[2:])
    flat_found = attack.reconstructions.reshape(-1, *images.shape[2:])
    saved = (
        _save_images(Path(artifacts), flat_originals, flat_found) if artifacts else [(None, None)] * len(flat_originals)
    )
    confirms, judgement = _confirms(result.verdict, attack.median_mse)
    if not confirms and result.verdict == "exposed":
        judgement += (
            "; an optimisation attack is not exact, so missing the threshold within its budget "
            f"({steps} steps) does not show the input is safe"
        )
    scored, against = _against_baselines(flat_originals, flat_found)
    judgement += _baseline_judgement(against)
    notes = [
        f"weights: {weights}",
        f"images: {source}",
        "R-GAP has no multi-step form (its closed form inverts one gradient layer by layer): the FedAvg "
        f"inversion attack simulates the {round_.steps} local steps from θ₀ instead",
        *attack.notes,
    ]
    samples = [
        {
            "index": c * round_.samples + i,
            "client": c,
            "mse": attack.mse[c][i],
            "psnr": _finite(attack.psnr[c][i]),
            "seconds": round(attack.seconds / len(flat_originals), 3),
            "original_png": saved[c * round_.samples + i][0],
            "reconstruction_png": saved[c * round_.samples + i][1],
            **baselines.sample_fields(scored[c * round_.samples + i]),
        }
        for c in range(round_.clients)
        for i in range(round_.samples)
    ]
    verification = {
        "attack": "fedavg-inversion",
        "device": attack.device,
        "weights": weights,
        "images": source,
        "loss": loss,
        "median_mse": attack.median_mse,
        "median_psnr": _finite(attack.median_psnr),
        "seconds": round(attack.seconds, 3),
        "confirms": confirms,
        "judgement": judgement,
        "note": " ".join(notes),
        "notes": notes,
        "samples": samples,
        "layers": [],
        "clients": [{"client": c, "median_psnr": _finite(attack.client_median_psnr[c])} for c in range(round_.clients)],
        "final_distance": _finite(attack.final_distance),
        "restart_best_distances": [_finite(d) for d in attack.best_distances],
        "restart_last_distances": [_finite(d) for d in attack.last_iterate_distances],
        "dtype": attack.dtype,
        "tv_weight": attack.tv_weight,
        "tv_weight_applied": attack.tv_weight_applied,
        "tv_until": attack.tv_until,
        "round": round_dict(result),
        **against,
    }
    result.verification["rgap"] = verification
    return verification
