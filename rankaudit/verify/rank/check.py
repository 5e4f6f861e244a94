"""--verify rank: the numerical rank of the shared gradient's (or the round's update's) Jacobian in the input."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TYPE_CHECKING

from rankaudit.errors import UsageError
from rankaudit.verify.progress import ProgressBar
from rankaudit.verify.registry import Need, Verifier, VerifyContext
from rankaudit.verify.scoring import finite

RANK_METHODS = ("auto", "dense", "matrix-free")

if TYPE_CHECKING:
    from rankaudit.result import Result


def run(context: VerifyContext) -> dict:
    """One gradient: one sketch per image (B = 1) or of one batch; a round: one sketch of its whole update."""
    common = dict(
        seed=context.seed,
        device=context.device,
        data=context.data,
        artifacts=context.artifacts,
        show_progress=context.show_progress,
        shared_layers=context.shared_layers,
        withheld_layers=context.withheld_layers,
    )
    round_ = context.result.round
    if context.in_round or (round_ is not None and round_.rounds_counted > 1):
        return verify_round_rank(context.result, context.spec, **common)
    return verify_rank(
        context.result,
        context.spec,
        samples=context.samples,
        precision=context.rank_precision,
        method=context.rank_method,
        budget=context.rank_budget,
        **common,
    )


VERIFIER = Verifier(
    name="rank",
    help="the numerical rank of the shared gradient's Jacobian in the input: the exact answer, any architecture "
    "(needs the [verify] extra).",
    needs=frozenset({Need.IMAGES, Need.ROUND, Need.GPU}),
    run=run,
    order=50,
    flags={"--rank-budget": "the time limit of each sample's matrix-free check"},
)


def verify_rank(
    result: Result,
    spec: str,
    *,
    samples: int = 4,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    artifacts: str | None = None,
    show_progress: bool = True,
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
    precision: str = "auto",
    method: str = "auto",
    budget: float | None = None,
) -> dict:
    """Measure rank(∂g/∂x) of the shared gradient (rankaudit.verify.rank.jacobian); fill result.verification['rank'].

    Batch size 1: one sketch per image over `samples` images, the headline the largest rank (the generic rank:
    an image can only lose rank to a coincidence such as a dead unit). Batch size B > 1: one sketch of one
    batch of B images. Compares the headline with the verdict and with the static bound (method.md: the bound).
    ``budget``: seconds per sample for the matrix-free check; a sample it stops early turns the record into bounds
    (rankaudit.verify.rank.partial).
    """
    import torch

    from rankaudit.verify.client import draw_labels, logits_of, loss_name_for
    from rankaudit.verify.inputs import images_to_attack, real_inputs
    from rankaudit.verify.model import build_real_model, resolve_device, weights_phrase
    from rankaudit.verify.rank import jacobian as rank
    from rankaudit.verify.rank.energy import read_energy
    from rankaudit.verify.rank.measurement import bound_check, judge, save_directions
    from rankaudit.verify.rank.spectrum import RELIABLE_GAP, TOLERANCE_RULE

    if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
        fed = ", ".join(f"{info.name} ({info.role}, {info.dtype})" for info in result.inputs)
        raise UsageError(
            f"--verify rank differentiates the gradient with respect to one real-valued input; this model takes {fed}",
            "token ids are discrete: the token-leakage finding covers them; use --verify rank on "
            "models with a single float input",
        )
    batch = result.batch_size
    device = resolve_device(device)
    model, weights = build_real_model(spec, result.input_shape, seed)
    shared = rank.shared_parameter_names(model, shared_layers, withheld_layers)
    images, source = real_inputs(result, data, images_to_attack(data, samples) if batch == 1 else batch, seed)
    with torch.no_grad():
        logits = logits_of(model(images[:1])).numel()
    loss = loss_name_for(logits)
    labels = draw_labels(len(images), loss, logits, seed)
    batches = [slice(i, i + 1) for i in range(len(images))] if batch == 1 else [slice(0, batch)]
    centre, centre_note = _reference_centre(result, data)
    # A batch of one has no batch to share statistics with (BatchNorm1d refuses to train on it): running ones then.
    bn_mode = result.round.bn_mode if result.round is not None and batch > 1 else "eval"
    # In training mode the running statistics a client sends move with the batch: their rows join the sketch.
    statistics = rank.sent_statistics(model, shared_layers, withheld_layers) if bn_mode == "train" else []
    shared_size = sum(p.numel() for name, p in model.named_parameters() if name in set(shared))
    measurements = []
    readings = []  # matrix-free: each sample's reading and its hidden share from above
    matrix_free = _matrix_free(method, images[batches[0]], batch, device, bool(artifacts))
    with ProgressBar(len(batches), "rank check" if matrix_free else "rank sketch", enabled=show_progress) as bar:
        overall = OverallProgress(bar, len(batches))
        if matrix_free:
            from rankaudit.verify.rank.gram import as_rank_measurement, measure_matrix_free
            from rankaudit.verify.rank.partial import hidden_at_most, partial_verification
        for number, part in enumerate(batches):
            common = dict(device=device, seed=seed + number, loss=loss, bn_mode=bn_mode, progress=overall.part(number))
            if matrix_free:
                reading = measure_matrix_free(
                    model, images[part], labels[part], shared, budget_seconds=budget, centre=centre, **common
                )
                readings.append((reading, hidden_at_most(reading, images[part], centre)))
                if not reading.exact:  # bounds only: read below, with the others
                    overall.finish(overall.last_total)
                    continue
                measured = as_rank_measurement(
                    reading,
                    images[part],
                    shared=shared,
                    shared_size=shared_size,
                    loss=loss,
                    device=str(device),
                    centre=centre,
                )
            else:
                measured = rank.measure(
                    model,
                    images[part],
                    labels[part],
                    shared,
                    directions=rank.MAX_DIRECTIONS if artifacts else 0,
                    hidden=True,
                    precision=precision,
                    centre=centre,
                    statistics=statistics,
                    **common,
                )
            overall.finish(overall.last_total)
            measurements.append(measured)
    notes = [
        f"weights: {weights}",
        f"inputs: {source}",
        f"loss: {loss}, labels drawn with seed {seed}",
        f"shared gradient: {len(shared)} parameter tensors, {shared_size:,} values",
        centre_note,
    ]
    if statistics:
        notes.append(
            f"running statistics sent: {', '.join(statistics)}"
            + (
                " (not in the matrix-free reading: it measures the gradient alone; the bound counts them)"
                if matrix_free
                else " (their exact Jacobian's rows join the sketch)"
            )
        )
    if any(not reading.exact for reading, _ in readings):
        notes.append(
            "matrix-free: a Krylov basis of JᵀJ per sample, from products with J and Jᵀ; stopped before the "
            "exact answer, so the rank is a lower bound and each hidden share an upper bound (exact arithmetic)"
        )
        verification = partial_verification(result, readings, budget=budget, device=str(device), notes=notes)
        result.verification["rank"] = verification
        return verification
    headline = max(measurements, key=lambda m: m.rank)
    confirms, agreement, judgement = judge(result.verdict, headline.rank, headline.unknowns)
    bound = bound_check(result.identifiability, headline.rank)
    notes += [
        f"sketch: {headline.sketch_rows} Gaussian rows x {headline.unknowns} unknowns in {headline.precision}, "
        f"{headline.method} in chunks of {headline.chunk_rows} rows; rank by {headline.spectrum}"
        if not matrix_free
        else f"matrix-free: a Krylov basis of {headline.sketch_rows} directions of JᵀJ x {headline.unknowns} "
        f"unknowns in blocks of {headline.chunk_rows}, from products with J and Jᵀ (no dense Jacobian); rank by "
        f"{headline.spectrum}",
    ]
    notes.append(f"precision: {headline.precision_note}")
    notes.append(_mode_note(bn_mode))
    if budget is not None and not matrix_free:
        notes.append("--rank-budget applies to the matrix-free check; the dense sketch ran to the end")
    if not headline.reliable:
        notes.append(
            f"unreliable: the gap {_gap_text(headline.gap)} is under {RELIABLE_GAP:g}, so the rank "
            "depends on where the tolerance falls"
        )
    if batch > 1:
        notes.append(f"one batch of {batch} images (--samples applies at batch size 1)")
    if len({m.rank for m in measurements}) > 1:
        notes.append(
            "ranks differ between images: "
            + ", ".join(str(m.rank) for m in measurements)
            + "; the headline is the largest (the generic rank)"
        )
    if any(m.invisible is None for m in measurements):
        notes.append(
            "hidden energy not measured for a deficient batch: the SVD's vectors it needs did not fit the "
            "device's memory (or --rank-precision float32 skipped them); lower --input-shape to measure it"
        )
    saved = save_directions(artifacts, headline) if artifacts else []
    seen = _what_the_gradient_shows(result, images, batches, measurements, artifacts, centre)
    verification = {
        "unknowns": headline.unknowns,
        "rank": headline.rank,
        "deficit": headline.deficit,
        "tolerance": headline.tolerance,
        "tolerance_rule": TOLERANCE_RULE,
        "precision": headline.precision,
        "precision_note": headline.precision_note,
        "precisions": [m.precision for m in measurements],
        "gap": finite(headline.gap or math.nan),
        "reliable": headline.reliable,
        "sigma_max": headline.sigma_max,
        "sigma_min_kept": headline.sigma_min_kept,
        "seconds": round(sum(m.seconds for m in measurements), 3),
        "device": headline.device,
        "method": headline.method,
        "spectrum": headline.spectrum,
        "sketch_rows": headline.sketch_rows,
        "chunk_rows": headline.chunk_rows,
        "shared_gradient_size": headline.shared_gradient_size,
        "shared_parameters": shared,
        "batch_size": batch,
        "loss": loss,
        "weights": weights,
        "inputs": source,
        "headline": "the largest rank over the samples (the generic rank)" if batch == 1 else "one batch",
        "samples": [
            {
                "index": i,
                "rank": m.rank,
                "deficit": m.deficit,
                "gap": finite(m.gap or math.nan),
                "reliable": m.reliable,
                "seconds": round(m.seconds, 3),
                "inputs": inputs,
            }
            for i, (m, inputs) in enumerate(zip(measurements, seen["inputs"]))
        ],
        "hidden_energy_median": seen["hidden_energy_median"],
        "visible_psnr_median": seen["visible_psnr_median"],
        "visible_ssim_median": seen["visible_ssim_median"],
        "visible_reading": seen["reading"],
        "confirms": confirms,
        "agreement": agreement,
        "judgement": judgement,
        "verdict": result.verdict,
        "bound": bound,
        "internal_error": bound.get("internal_error") if bound else None,
        "directions": saved,
        "notes": notes,
    }
    per_sample_ranks = [m.rank for m in measurements] if batch == 1 else measurements[0].sample_ranks
    read_worst_sample(
        verification,
        result,
        per_sample_ranks,
        [e for part in seen["inputs"] for e in part],
        "gradient",
        keep_agreement=batch == 1,
    )
    read_energy(verification, result, weights_phrase(weights))
    result.verification["rank"] = verification
    return verification


def _matrix_free(method: str, first, batch: int, device, artifacts: bool) -> bool:
    """Whether the rank check runs matrix-free: asked for, or (auto) at batch size 1 when the dense sketch would not
    fit the device's memory. The dense sketch stays the default wherever it fits (it also saves the null-space
    directions --artifacts asks for)."""
    from rankaudit.verify.rank.budget import memory_budget, sketch_bytes
    from rankaudit.verify.rank.jacobian import OVERSAMPLING

    if method not in RANK_METHODS:
        raise UsageError(f"unknown rank method {method!r}", f"use one of {', '.join(RANK_METHODS)}")
    if method == "matrix-free" and batch != 1:
        raise UsageError(
            "the matrix-free rank check measures one sample at a time (batch size 1)",
            "use --rank-method dense (or auto) with --batch-size above 1",
        )
    if method != "auto" or batch != 1 or artifacts:
        return method == "matrix-free"
    unknowns = int(first.numel())
    return sketch_bytes(unknowns + OVERSAMPLING, unknowns, vectors=True) > memory_budget(device)[0]


class OverallProgress:
    """One counter over several measurements whose work is known only as each runs (a float32 sketch that is
    redone in float64 doubles its own): the count never moves backwards, and the later measurements are estimated
    at the size of the latest one, so the time left grows honestly when a measurement turns out larger."""

    def __init__(self, bar, parts: int):
        self.bar, self.parts = bar, parts
        self.finished = 0
        self.last_total = 0
        self._offset = 0  # within the current part: work already reported by an earlier attempt
        self._seen = 0

    def part(self, number: int):
        self._offset, self._seen = 0, 0

        def report(done: int, total: int) -> None:
            if done < self._seen:  # a new attempt at the same part (float64 after float32) starts over
                self._offset += self._seen
            self._seen = done
            mine = self._offset + total
            self.last_total = mine
            later = (self.parts - number - 1) * mine
            self.bar(self.finished + self._offset + done, self.finished + mine + later)

        return report

    def finish(self, total: int) -> None:
        self.finished += total


def read_worst_sample(
    verification: dict, result: Result, ranks: list[int], inputs: list[dict], what: str, *, keep_agreement: bool = False
):
    """The per-sample rank check's JSON: the per-sample keys, and confirms / judgement read the worst sample (the
    batch's reading stays under batch_*); a rank(J_i) above R_s joins internal_error."""
    from rankaudit.verify.rank.per_sample import sample_reading

    if not ranks:  # unmeasured (an unchecked float32 sketch below full rank): the batch's reading stands
        verification["per_sample_rank"] = None
        return
    reading = sample_reading(result, ranks, inputs, math.prod(result.input_shape), what=what)
    verification.update({f"batch_{key}": verification[key] for key in ("confirms", "agreement", "judgement")})
    verification.update(
        {
            key: value
            for key, value in reading.items()
            if not key.startswith("sample_") or key in ("sample_bound", "sample_level")
        }
    )
    verification["confirms"], verification["judgement"] = reading["sample_confirms"], reading["sample_judgement"]
    if not keep_agreement:
        verification["agreement"] = reading["sample_agreement"]
    sample_error = (reading["sample_bound"] or {}).get("internal_error")
    if sample_error:
        verification["internal_error"] = "; ".join(e for e in (verification.get("internal_error"), sample_error) if e)


def _reference_centre(result: Result, data: str | None):
    """(the reference's mean sample, its note): each sample's hidden share is measured on its deviation from it, the
    quantity the certificate speaks of (bound.energy.reference_mean); each sample's own mean where there is none."""
    from rankaudit.bound.energy import ReferenceDataError, reference_mean

    shape = tuple(result.input_shape) if result.input_shape else None
    try:
        centre = reference_mean(shape, data)
    except ReferenceDataError:
        centre = None  # the analysis already named --data's problem
    if centre is None:
        return None, "hidden shares: each sample's deviation from its own mean (no reference mean sample)"
    what = "--data's mean sample" if data is not None else "the photographs' mean colour"
    return centre, f"hidden shares: each sample's deviation from {what}, as the certificate measures it"


def _what_the_gradient_shows(
    result: Result, images, batches: list[slice], measurements: list, artifacts: str | None, centre=None
) -> dict:
    """method.md: verdicts, measured: each input's hidden energy and visible part (rankaudit.verify.rank.hidden), the medians
    over all inputs, PNGs of the originals and visible parts for the HTML report (result.images), and with
    --artifacts the visible parts as .npy and PNG."""
    import numpy as np
    import torch

    from rankaudit.verify.rank import hidden

    per_sample, every = [], []
    for _number, (part, measurement) in enumerate(zip(batches, measurements)):
        batch = images[part].detach().to(torch.float64).cpu().numpy()
        if measurement.invisible is None:
            # A deficit without the SVD's vectors (they did not fit the device's memory, or --rank-precision
            # float32 skipped them): the hidden part is not measured, and the notes say so.
            per_sample.append(
                [
                    {"index": part.start + offset, "hidden_energy": None, "visible_psnr": None, "visible_ssim": None}
                    for offset in range(len(batch))
                ]
            )
            continue
        visible = hidden.visible_parts(batch, measurement.invisible)
        inputs = []
        for offset, share in enumerate(hidden.shares(batch, measurement.invisible, centre)):
            index = part.start + offset
            entry = {
                "index": index,
                "hidden_energy": share.hidden_energy,
                "visible_psnr": share.visible_psnr,
                "visible_ssim": share.visible_ssim,
            }
            for kind, picture in (("original", batch[offset]), ("visible", visible[offset])):
                png = _png_bytes(picture)
                if png is not None:
                    result.images[f"rank/{kind}_{index}"] = png
            if artifacts:
                directory = Path(artifacts)
                directory.mkdir(parents=True, exist_ok=True)
                np.save(directory / f"visible_part_{index}.npy", visible[offset])
                entry["visible_npy"] = str(directory / f"visible_part_{index}.npy")
                png = result.images.get(f"rank/visible_{index}")
                if png is not None:
                    (directory / f"visible_part_{index}.png").write_bytes(png)
                entry["visible_png"] = str(directory / f"visible_part_{index}.png") if png is not None else None
            inputs.append(entry)
            every.append(share)
        per_sample.append(inputs)
    psnr_median = hidden.median([s.visible_psnr for s in every], none_is_infinite=True)
    if all(measurement.rank == 0 for measurement in measurements):
        # An empty gradient shows nothing: no "visible part" figure of an all-zero projection.
        for entry in (entry for inputs in per_sample for entry in inputs):
            entry["visible_psnr"] = entry["visible_ssim"] = None
        return {
            "inputs": per_sample,
            "hidden_energy_median": hidden.median([s.hidden_energy for s in every]),
            "visible_psnr_median": None,
            "visible_ssim_median": None,
            "reading": "the gradient shows nothing of the inputs (rank 0)",
        }
    return {
        "inputs": per_sample,
        "hidden_energy_median": hidden.median([s.hidden_energy for s in every]),
        "visible_psnr_median": psnr_median,
        "visible_ssim_median": hidden.median([s.visible_ssim for s in every]),
        "reading": hidden.reading([s.visible_psnr for s in every], psnr_median),
    }


def _png_bytes(picture) -> bytes | None:
    """An image (C x H x W, 1 or 3 channels, [0, 1]) as PNG bytes, clipped to the range; None for other inputs."""
    import io

    import numpy as np
    from PIL import Image

    if picture.ndim != 3 or picture.shape[0] not in (1, 3) or not np.all(np.isfinite(picture)):
        return None
    pixels = (np.clip(picture, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    pixels = pixels[0] if pixels.shape[0] == 1 else np.transpose(pixels, (1, 2, 0))
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _gap_text(gap: float | None) -> str:
    return "undefined (rank 0)" if gap is None else f"{gap:.3g}"


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
    from rankaudit.settings.round import round_dict
    from rankaudit.verify.client import check_local_training, round_labels, simulated_rounds
    from rankaudit.verify.inputs import round_inputs
    from rankaudit.verify.model import build_real_model, resolve_device, weights_phrase
    from rankaudit.verify.rank import jacobian as rank
    from rankaudit.verify.rank import round_jacobian as round_rank
    from rankaudit.verify.rank.energy import read_energy
    from rankaudit.verify.rank.measurement import bound_check, judge, save_directions
    from rankaudit.verify.rank.spectrum import RELIABLE_GAP, TOLERANCE_RULE

    round_ = result.round
    device = resolve_device(device)
    round_rank.check_round_size(round_, tuple(result.input_shape), device)
    model, weights = build_real_model(spec, result.input_shape, seed)
    shared = rank.shared_parameter_names(model, shared_layers, withheld_layers)
    inputs, source = round_inputs(result, data, seed, "rank")
    centre, centre_note = _reference_centre(result, data)
    labels, loss = round_labels(model, inputs, seed)
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
            centre=centre,
        )
    if not all(math.isfinite(v) for v in (measured.sigma_max, measured.tolerance)):
        raise UsageError(
            "the round's sketch is not finite (the local training diverged at these weights)",
            "lower --lr or --local-epochs",
        )
    confirms, agreement, judgement = judge(result.verdict, measured.rank, measured.unknowns)
    # judge speaks of one gradient; here the Jacobian is the round's update's.
    agreement, judgement = (
        text.replace("one gradient", "the update")
        .replace("the gradient's", "the update's")
        .replace("to the gradient", "to the update")
        for text in (agreement, judgement)
    )
    rounds = simulated_rounds(round_)
    # method.md: the round: over several rounds the stacked updates can show each round's directions; the round's bound counts
    # one round, so the whole Jacobian is held to the sum over the rounds simulated.
    whole = result.identifiability
    if rounds > 1 and whole is not None:
        whole = dataclasses.replace(
            whole, rank_bound=min(measured.unknowns, rounds * whole.rank_bound), certified_deficit=0
        )
    bound = bound_check(whole, measured.rank)
    notes = [
        f"weights: {weights}",
        f"inputs: {source}",
        f"loss: {loss}, labels drawn with seed {seed}; batch order fixed, the same each epoch",
        f"update: {len(shared)} parameter tensors, {measured.shared_gradient_size:,} values, "
        + ("summed over the clients (secure aggregation)" if round_.secure_aggregation else "one client"),
        f"sketch: {measured.sketch_rows} Gaussian rows x {measured.unknowns} unknowns in float64, each a "
        f"vector-Jacobian product through the {round_.steps} unrolled local steps, in chunks of "
        f"{measured.chunk_rows} rows; rank by {measured.spectrum}",
        _mode_note(round_.bn_mode),
        centre_note,
    ]
    sent_statistics = rank.sent_statistics(model, shared_layers, withheld_layers) if round_.bn_mode == "train" else []
    if sent_statistics:
        notes.append(
            f"running statistics sent: {', '.join(sent_statistics)}; the round's sketch measures the update of the "
            "parameters alone (the bound counts them)"
        )
    if rounds > 1:
        notes.append(
            f"server rounds: {rounds} simulated"
            + (f" of the {round_.rounds_counted:,} counted" if rounds < round_.rounds_counted else "")
            + ", each round's update stacked; between rounds the weights move by the clients' mean update and a "
            "fixed random step for the other clients (independent of the samples)"
        )
    if not measured.reliable:
        notes.append(
            f"unreliable: the gap {_gap_text(measured.gap)} is under {RELIABLE_GAP:g}, so the rank "
            "depends on where the tolerance falls"
        )
    saved = save_directions(artifacts, _first_client_view(measured)) if artifacts else []
    # the verdicts over the round section's inputs: every client's samples in one projection, each sample's share reported.
    flat = inputs.reshape(-1, *inputs.shape[2:])
    seen = _what_the_gradient_shows(result, flat, [slice(0, len(flat))], [measured], artifacts, centre)
    if measured.invisible is None:
        notes.append("hidden energy not measured: the SVD's vectors it needs did not fit the device's memory")
    verification = {
        "unknowns": measured.unknowns,
        "rank": measured.rank,
        "deficit": measured.deficit,
        "tolerance": measured.tolerance,
        "tolerance_rule": TOLERANCE_RULE,
        "gap": finite(measured.gap or math.nan),
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
                "gap": finite(measured.gap or math.nan),
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
        "round": round_dict(result.round),
    }
    read_worst_sample(verification, result, measured.sample_ranks, seen["inputs"][0], "update")
    read_energy(verification, result, weights_phrase(weights))
    result.verification["rank"] = verification
    return verification


def _mode_note(bn_mode: str) -> str:
    return (
        "BatchNorm in training mode: each batch normalised with its own statistics, as a training client does"
        if bn_mode == "train"
        else "BatchNorm in eval mode: running statistics"
    )


def _first_client_view(measured):
    """Directions over (C, N, *sample) flattened to (C·N, *sample) so each saved image shows all samples."""
    import dataclasses

    if measured.directions is None:
        return measured
    shape = measured.directions.shape
    return dataclasses.replace(
        measured, directions=measured.directions.reshape(shape[0], shape[1] * shape[2], *shape[3:])
    )
