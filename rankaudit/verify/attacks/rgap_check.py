"""--verify rgap: R-GAP on real images (inverting gradients where it cannot go), the FedAvg inversion on a round."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rankaudit.errors import UsageError
from rankaudit.settings.levels import count
from rankaudit.verify import scoring
from rankaudit.verify.defense_runs import (
    DEGRADED_MSE_FACTOR,
    WARMUP_SEED_OFFSET,
    AttackSettings,
    defended_rows,
    rms,
    strength_note,
)
from rankaudit.verify.progress import ProgressBar
from rankaudit.verify.registry import Need, Verifier, VerifyContext
from rankaudit.verify.scoring import CONFIRM_EXPOSED_BELOW, CONFIRM_PROTECTED_ABOVE, finite

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rankaudit.result import Result


def run(context: VerifyContext) -> dict:
    """One gradient: R-GAP, or inverting gradients, with the defended runs of --defense; a round: FedAvg inversion."""
    if context.in_round:
        return verify_round_inputs(
            context.result,
            context.spec,
            seed=context.seed,
            device=context.device,
            data=context.data,
            steps=context.steps,
            restarts=context.restarts,
            artifacts=context.artifacts,
            show_progress=context.show_progress,
            shared_layers=context.shared_layers,
            withheld_layers=context.withheld_layers,
        )
    return verify_inputs(
        context.result, context.spec, AttackSettings.of(context), list(context.defenses), artifacts=context.artifacts
    )


def preflight(context: VerifyContext) -> None:
    """A round the inversion cannot finish is refused up front, before the bias readout that runs first."""
    if context.in_round:
        from rankaudit.verify.attacks.fedavg import check_attack_round_size

        check_attack_round_size(
            context.result.round, tuple(context.result.input_shape), context.steps, context.restarts
        )


def runs_first(context: VerifyContext) -> tuple[str, ...]:
    """On a batch (B > 1) or a round, the bias readout runs first: what it gives exactly needs no optimisation."""
    return ("bias",) if context.result.batch_size > 1 or context.in_round else ()


def defended(context: VerifyContext, defenses: list, *, optimisation: bool = False) -> list[dict]:
    """The undefended attack and one against each defense, on the same images: a row per defense."""
    return defended_rows(context, _input_run, _input_rows, defenses, optimisation=optimisation)


VERIFIER = Verifier(
    name="rgap",
    help="input reconstruction: R-GAP, inverting gradients where R-GAP cannot go, the FedAvg inversion on a round "
    "(needs the [verify] extra).",
    needs=frozenset({Need.IMAGES, Need.LABELS, Need.ROUND, Need.GPU, Need.TRAINABLE}),
    run=run,
    order=30,
    preflight=preflight,
    runs_first=runs_first,
    defended=defended,
)


def _loss_for(model: nn.Module, images: torch.Tensor) -> str:
    import torch

    with torch.no_grad():
        logits = model(images[:1].to(dtype=next(model.parameters()).dtype))
    return "logistic" if logits.numel() == 1 else "cross-entropy"


def _input_setup(
    result: Result, spec: str, samples: int, seed: int, data: str | None
) -> tuple[nn.Module, str, torch.Tensor, str, str]:
    """The real model, where its weights came from, `samples` float64 images, their source, the loss."""
    import torch

    from rankaudit.bound import images as image_data
    from rankaudit.verify.model import build_real_model, require_trainable

    model, weights = build_real_model(spec, result.input_shape, seed)
    require_trainable(model, "--verify rgap")
    if len(result.input_shape) != 3:
        raise UsageError(
            f"--verify rgap attacks images; this model's input shape is {result.input_shape}",
            "verify a model whose input is C,H,W",
        )
    from rankaudit.verify.inputs import images_to_attack

    try:
        images, source = image_data.load_images(data, tuple(result.input_shape), images_to_attack(data, samples), seed)
    except image_data.DataError as exc:
        raise UsageError(str(exc)) from exc
    images = images.to(torch.float64)
    return model, weights, images, source, _loss_for(model, images)


def _attack_images(
    model: nn.Module,
    images: torch.Tensor,
    input_shape: tuple[int, ...],
    loss: str,
    settings: AttackSettings,
    *,
    defense=None,
    title: str = "",
    optimisation: bool = False,
):
    """R-GAP on `images`, or inverting gradients where R-GAP cannot go (always, with `optimisation`):
    (attack, outcome, reconstructions, why R-GAP stopped or None)."""
    from rankaudit.verify.attacks import invert, rgap, rgap_chain

    device, seed, show_progress = settings.device, settings.seed, settings.show_progress
    steps, restarts = settings.steps, settings.restarts
    samples = len(images)
    try:
        if optimisation:
            raise rgap_chain.RGapUnsupported(type(model).__name__, "the optimisation attack was asked for")
        rgap_chain.extract_chain(model, tuple(input_shape))
    except rgap_chain.RGapUnsupported as stop:
        # One line for both: the label names the image, the count is the optimisation step.
        with ProgressBar(steps, f"inverting gradients{title}, image 1/{samples}", enabled=show_progress) as bar:

            def next_image(done: int, total: int):
                bar.label = f"inverting gradients{title}, image {min(done + 1, total)}/{total}"

            outcome = invert.run_inverting(
                model,
                images,
                loss=loss,
                steps=steps,
                restarts=restarts,
                device=device,
                seed=seed,
                progress=next_image,
                step_progress=bar,
                defense=defense,
            )
        return "inverting-gradients", outcome, outcome.x_hat, stop
    with ProgressBar(samples, f"R-GAP{title}", enabled=show_progress) as per_sample:
        outcome = rgap.run_rgap(
            model, images, device=device, seed=seed, loss=loss, progress=per_sample, defense=defense
        )
    return "rgap", outcome, outcome.reconstructions, None


@dataclass
class _InputRun:
    """The undefended input attack: its model, images and outcome, reused by every defended run."""

    model: nn.Module
    weights: str
    images: torch.Tensor
    source: str
    loss: str
    attack: str
    outcome: object
    reconstructions: torch.Tensor
    stop: object | None


def _input_run(result: Result, spec: str, settings: AttackSettings, title: str = "") -> _InputRun:
    model, weights, images, source, loss = _input_setup(result, spec, settings.samples, settings.seed, settings.data)
    attack, outcome, reconstructions, stop = _attack_images(
        model, images, tuple(result.input_shape), loss, settings, title=title
    )
    return _InputRun(model, weights, images, source, loss, attack, outcome, reconstructions, stop)


def verify_inputs(
    result: Result, spec: str, settings: AttackSettings, defenses: list = (), artifacts: str | None = None
) -> dict:
    """Run R-GAP (or, where it cannot go, inverting gradients) on real images; fill result.verification['rgap'].

    With `defenses`, also attack each defended gradient on the same images and add the rows to
    result.verification['defenses'] (as verify_defenses does), without running the undefended attack again.
    """
    from rankaudit.verify import baselines

    run = _input_run(result, spec, settings)
    if defenses:
        result.verification.setdefault("defenses", []).extend(_input_rows(result, run, list(defenses), settings))
    steps, restarts = settings.steps, settings.restarts
    weights, images, source, loss = run.weights, run.images, run.source, run.loss
    attack, outcome, reconstructions, stop = run.attack, run.outcome, run.reconstructions, run.stop
    notes = [f"weights: {weights}", f"images: {source}"]
    if stop is not None:
        notes.append(
            f"R-GAP stops at {stop.layer}: {stop.reason}. Checked with the inverting-gradients "
            "optimisation attack (Geiping et al. 2020) instead, as R-GAP's authors did for ResNets."
        )
        layers = []
        notes.append(f"optimisation budget: {steps} steps x {restarts} restarts")
    else:
        notes.extend(outcome.notes)
        layers = [
            {
                "name": s.name,
                "unknowns": s.unknowns,
                "rank": s.rank,
                "local_deficit": s.local_deficit,
                "residual": finite(s.residual),
                "condition": finite(s.condition),
            }
            for s in outcome.layers
        ]
    saved = scoring.save_images(Path(artifacts), images, reconstructions) if artifacts else [(None, None)] * len(images)
    scored, against = scoring.against_baselines(images, reconstructions)
    confirms, judgement = scoring.judge_attack(
        result.verdict, outcome.median_mse, {**against, "samples_scored": len(scored)}
    )
    if attack == "inverting-gradients" and not confirms and result.verdict == "exposed":
        judgement += (
            "; an optimisation attack is not exact, so missing the threshold within its budget "
            f"({steps} steps) does not show the input is safe"
        )
    deficient = [layer for layer in layers if layer["local_deficit"] > 0]
    if deficient:
        # method.md: numerical check: counts cannot see dependent constraints; the numerical rank can, and explains a disagreement.
        judgement += "; numerically deficient: " + ", ".join(
            f"{layer['name']} rank {layer['rank']} of {layer['unknowns']} unknowns (deficit {layer['local_deficit']})"
            for layer in deficient
        )
    verification = {
        "attack": attack,
        "device": outcome.device,
        "weights": weights,
        "images": source,
        "loss": loss,
        "median_mse": outcome.median_mse,
        "median_psnr": finite(outcome.median_psnr),
        "seconds": round(sum(outcome.seconds), 3),
        "confirms": confirms,
        "judgement": judgement,
        "note": " ".join(notes),
        "notes": notes,
        "samples": [
            {
                "index": i,
                "mse": outcome.mse[i],
                "psnr": finite(outcome.psnr[i]),
                "seconds": round(outcome.seconds[i], 3),
                "original_png": saved[i][0],
                "reconstruction_png": saved[i][1],
                **baselines.sample_fields(scored[i]),
            }
            for i in range(len(images))
        ],
        "layers": layers,
        **against,
    }
    result.verification["rgap"] = verification
    return verification


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
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
) -> dict:
    """The FedAvg inversion attack on the round's update, the part the server receives (`shared_layers` or
    `withheld_layers`, as the bound takes them); fill result.verification['rgap'] (R-GAP's slot: the input attack),
    with a per-client recovery."""
    from rankaudit.settings.round import round_dict
    from rankaudit.verify import baselines
    from rankaudit.verify.attacks import fedavg
    from rankaudit.verify.attacks.fedavg import check_attack_round_size
    from rankaudit.verify.client import round_labels
    from rankaudit.verify.inputs import round_inputs
    from rankaudit.verify.model import build_real_model, require_trainable, resolve_device
    from rankaudit.verify.rank.jacobian import shared_parameter_names

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
    sent = shared_parameter_names(model, shared_layers, withheld_layers)
    images, source = round_inputs(result, data, seed, "rgap")
    labels, loss = round_labels(model, images, seed)
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
            shared=sent,
            steps=steps,
            restarts=restarts,
            device=device,
            seed=seed,
            progress=lambda done, total: bar(done, total),
        )
    flat_originals = images.reshape(-1, *images.shape[2:])
    flat_found = attack.reconstructions.reshape(-1, *images.shape[2:])
    saved = (
        scoring.save_images(Path(artifacts), flat_originals, flat_found)
        if artifacts
        else [(None, None)] * len(flat_originals)
    )
    scored, against = scoring.against_baselines(flat_originals, flat_found)
    confirms, judgement = scoring.judge_attack(
        result.verdict, attack.median_mse, {**against, "samples_scored": len(scored)}
    )
    if not confirms and result.verdict == "exposed":
        judgement += (
            "; an optimisation attack is not exact, so missing the threshold within its budget "
            f"({steps} steps) does not show the input is safe"
        )
    notes = [
        f"weights: {weights}",
        f"images: {source}",
        "R-GAP has no multi-step form (its closed form inverts one gradient layer by layer): the FedAvg "
        f"inversion attack simulates the {round_.steps} local steps from θ₀ instead",
        *attack.notes,
    ]
    if shared_layers or withheld_layers:
        notes.append(f"the update fitted is the part the client sends: {len(sent)} parameter tensors")
    samples = [
        {
            "index": c * round_.samples + i,
            "client": c,
            "mse": attack.mse[c][i],
            "psnr": finite(attack.psnr[c][i]),
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
        "median_psnr": finite(attack.median_psnr),
        "seconds": round(attack.seconds, 3),
        "confirms": confirms,
        "judgement": judgement,
        "note": " ".join(notes),
        "notes": notes,
        "samples": samples,
        "layers": [],
        "clients": [{"client": c, "median_psnr": finite(attack.client_median_psnr[c])} for c in range(round_.clients)],
        "final_distance": finite(attack.final_distance),
        "restart_best_distances": [finite(d) for d in attack.best_distances],
        "restart_last_distances": [finite(d) for d in attack.last_iterate_distances],
        "dtype": attack.dtype,
        "tv_weight": attack.tv_weight,
        "tv_weight_applied": attack.tv_weight_applied,
        "tv_until": attack.tv_until,
        "round": round_dict(result.round),
        **against,
    }
    result.verification["rgap"] = verification
    return verification


def _input_rows(result, run: _InputRun, defenses, settings: AttackSettings, optimisation=False) -> list[dict]:
    from rankaudit.verify import baselines
    from rankaudit.verify.attacks import rgap, rgap_chain

    model, images, source, loss = run.model, run.images, run.source, run.loss
    seed = settings.seed
    shape = tuple(result.input_shape)
    first = rgap.client_gradients(model, images[0], 1 if loss == "logistic" else 0, loss)
    warmups = [_input_warmup(model, shape, loss, defense.options.get("warmup", 0), seed) for defense in defenses]
    try:
        rgap_chain.extract_chain(model, shape)
        passes = [False, True] if optimisation else [False]
    except rgap_chain.RGapUnsupported:
        passes = [False]  # the optimisation attack is the only one anyway
    rows = []
    for forced in passes:
        if forced:  # the optimisation attack where R-GAP ran: its own undefended baseline
            attack, base, base_found, stop = _attack_images(
                model, images, shape, loss, settings, title=" without defense", optimisation=True
            )
        else:
            attack, base, base_found, stop = run.attack, run.outcome, run.reconstructions, run.stop
        without_scored = baselines.summary(baselines.score(images, base_found))
        for defense, warmup in zip(defenses, warmups):
            # A fresh client per attack: the noise the two attacks face is the same draw.
            _, outcome, found, _ = _attack_images(
                model,
                images,
                shape,
                loss,
                settings,
                defense=defense.client(seed, warmup),
                title=f" vs {defense.label}",
                optimisation=forced,
            )
            row = _input_row(
                defense, attack, base, outcome, images, source, loss, first, stop, settings.steps, settings.restarts
            )
            with_scored = baselines.summary(baselines.score(images, found))
            # Both medians beside what a flat image scores on the same images.
            row.update(
                {
                    "grey_psnr_median": with_scored["grey_psnr_median"],
                    "mean_colour_psnr_median": with_scored["mean_colour_psnr_median"],
                    "outcome_without": without_scored["outcome"],
                    "outcome_with": with_scored["outcome"],
                }
            )
            rows.append(row)
    return rows


def _input_row(defense, attack, base, outcome, images, source, loss, first, stop, steps, restarts) -> dict:
    without, with_ = base.median_mse, outcome.median_mse
    notes = [note for note in (strength_note(defense, rms(first.values()), "the client's gradient"),) if note]
    if not math.isfinite(with_):
        notes.append("the reconstruction's error overflowed (reported as n/a): the attack output is meaningless")
    attack_notes = []
    if attack == "rgap":
        failed = sum(1 for note in outcome.notes if "R-GAP failed on the defended gradient" in note)
        if failed:
            notes.append(
                f"R-GAP found no solution for {failed} of {len(images)} defended gradients (scored as all-zero images)"
            )
        attack_notes.append(
            "exact algebra: any change to the gradient breaks it, so a defense that stops R-GAP may "
            "still leave an optimisation attack a good approximation"
        )
    elif stop is not None and "asked for" not in stop.reason:
        attack_notes.append(
            f"R-GAP stops at {stop.layer}, so inverting gradients ({steps} steps x {restarts} restarts) attacks instead"
        )
    if defense.name == "adadefense" and defense.options.get("warmup"):
        notes.append(f"the client's moments come from {defense.options['warmup']} earlier rounds on other images")
    return {
        "defense": defense.name,
        "param": defense.param,
        "spec": defense.spec,
        "label": defense.label,
        "description": defense.description,
        "options": dict(defense.options),
        "attack": attack,
        "metric": "median_mse",
        "without": finite(without),
        "with": finite(with_),
        "psnr_without": finite(base.median_psnr),
        "psnr_with": finite(outcome.median_psnr),
        "mse_without": [finite(m) for m in base.mse],
        "mse_with": [finite(m) for m in outcome.mse],
        "degrades": bool(with_ >= DEGRADED_MSE_FACTOR * without and with_ > CONFIRM_EXPOSED_BELOW),
        "fails_without": bool(without > CONFIRM_PROTECTED_ABOVE),
        "fails_with": bool(with_ > CONFIRM_PROTECTED_ABOVE),
        "samples": len(images),
        "images": source,
        "loss": loss,
        "device": outcome.device,
        "seconds": round(sum(outcome.seconds), 3),
        "notes": notes,
        "attack_notes": attack_notes,
    }


def _input_warmup(model: nn.Module, input_shape, loss: str, rounds: int, seed: int) -> list[dict]:
    """The gradients of `rounds` earlier rounds on other images: crops of the photographs under another seed."""
    import torch

    from rankaudit.bound import images as image_data
    from rankaudit.verify.attacks import rgap

    if rounds == 0:
        return []
    images, _ = image_data.load_images(None, tuple(input_shape), rounds, seed + WARMUP_SEED_OFFSET)
    gen = torch.Generator().manual_seed(seed + WARMUP_SEED_OFFSET)
    with torch.no_grad():
        classes = model(images[:1].to(torch.float64)).numel()
    grads = []
    for image in images.to(torch.float64):
        if loss == "logistic":
            y = 1 if torch.rand((), generator=gen) < 0.5 else -1
        else:
            y = int(torch.randint(classes, (), generator=gen))
        grads.append(rgap.client_gradients(model, image, y, loss))
    return grads
