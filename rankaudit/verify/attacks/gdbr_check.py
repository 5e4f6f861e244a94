"""--verify gdbr: GDBR's label recovery from one shared hidden layer's gradient, undefended and against --defense."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.verify.defense_runs import (
    DEGRADED_INS_ACC_DROP,
    WARMUP_SEED_OFFSET,
    AttackSettings,
    defended_rows,
    rms,
    strength_note,
)
from rankaudit.verify.progress import ProgressBar
from rankaudit.verify.registry import Need, Verifier, VerifyContext

if TYPE_CHECKING:
    import torch
    from torch import nn

    from rankaudit.result import Result


def run(context: VerifyContext) -> dict:
    """GDBR on real labelled digits, with the defended runs of --defense on the same batches."""
    return verify_labels(context.result, context.spec, AttackSettings.of(context), list(context.defenses))


def defended(context: VerifyContext, defenses: list, *, optimisation: bool = False) -> list[dict]:
    """The undefended attack and one against each defense, on the same batches: a row per defense."""
    return defended_rows(context, _label_run, _label_rows, defenses)


VERIFIER = Verifier(
    name="gdbr",
    help="label recovery from one shared hidden layer (GDBR; needs the [verify] extra).",
    needs=frozenset({Need.IMAGES, Need.LABELS, Need.GPU}),
    run=run,
    order=40,
    defended=defended,
)


def _gdbr_layer(result: Result) -> str:
    """The shared layer GDBR reads: the shared, bridging layer nearest the logits (the paper's default)."""
    leakage = result.label_leakage
    candidates = [b for b in leakage.layers if b.shared and b.bridge and not b.direct] if leakage else []
    if not candidates:
        direct = [b.name for b in leakage.layers if b.shared and b.direct] if leakage else []
        raise UsageError(
            "no shared hidden layer's gradient bridges to the logits, so GDBR has nothing to read"
            + (f" (the logits layer {direct[0]} is shared: its gradient gives the labels directly)" if direct else ""),
            "share a hidden layer (--shared-layers) or skip --verify gdbr",
        )
    return candidates[-1].name


def _aux_images(aux: str | None, input_shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor | None, str]:
    """The attacker's stand-in inputs for estimating activations and probabilities (GDBR §V-D3)."""
    import torch

    from rankaudit.bound import images as image_data
    from rankaudit.verify.attacks.gdbr_victims import held_out_images

    generator = torch.Generator().manual_seed(seed + 7919)
    if aux in (None, "dummy"):
        # GDBR draws N(0,1) dummies for standardised inputs; ours live in [0, 1], so the dummies do too.
        return torch.rand((1000, *input_shape), generator=generator), "dummy inputs, uniform on [0, 1]"
    if aux == "normal":
        return torch.randn((1000, *input_shape), generator=generator), "dummy inputs, standard normal"
    if aux == "digits":
        return held_out_images(tuple(input_shape)), "held-out scikit-learn digits (never in a victim batch)"
    try:
        images, source = image_data.load_images(aux, tuple(input_shape), 1000, seed)
    except image_data.DataError as exc:
        raise UsageError(str(exc)) from exc
    return images, source


def _weights_used(bottom: list[str]) -> str:
    from rankaudit.verify.model import deployed_weights_file

    deployed = deployed_weights_file()
    if deployed is not None:
        from pathlib import Path

        return f"the weights in {Path(deployed).name}"
    return f"random; {', '.join(bottom)} initialised uniform on [0.01, 0.2] as in GDBR (bias 0)"


def _label_setup(result: Result, spec: str, seed: int, aux: str | None):
    """The shared layer GDBR reads, the model with the paper's bottom-layer init, those layers, the aux inputs."""
    import torch
    from torch import nn

    from rankaudit.model.load import load_model
    from rankaudit.verify.attacks import gdbr_victims
    from rankaudit.verify.model import current_model_arguments, deployed_weights_file, load_weights, read_state_dict

    layer = _gdbr_layer(result)
    if len(result.input_shape) != 3:
        raise UsageError(
            f"--verify gdbr feeds images; this model's input shape is {result.input_shape}",
            "verify a model whose input is C,H,W",
        )
    torch.manual_seed(seed)
    model = load_model(spec, result.input_shape, device="cpu", model_args=current_model_arguments()).module.eval()
    names = [name for name, _ in model.named_modules()]
    bottom = names[names.index(layer) :] if layer in names else [layer]
    bottom = [name for name in bottom if isinstance(model.get_submodule(name), (nn.Linear, nn.Conv2d))]
    deployed = deployed_weights_file()
    if deployed is not None:  # --weights: the attack reads the gradient at the weights that are sent
        load_weights(model, read_state_dict(deployed), deployed)
    else:
        gdbr_victims.init_like_paper(model, bottom, seed=seed)
    aux_images, aux_source = _aux_images(aux, tuple(result.input_shape), seed)
    return layer, model, bottom, aux_images, aux_source


def _run_gdbr(model, layer, result: Result, settings: AttackSettings, aux_images, *, defense=None, title: str = ""):
    from rankaudit.verify.attacks import gdbr, gdbr_bridge

    try:
        with ProgressBar(settings.trials, f"GDBR{title}", enabled=settings.show_progress) as per_trial:
            return gdbr.run_gdbr(
                model,
                layer,
                result.batch_size,
                trials=settings.trials,
                class_dist=settings.class_dist,
                aux=aux_images,
                device=settings.device,
                seed=settings.seed,
                progress=per_trial,
                input_shape=tuple(result.input_shape),
                defense=defense,
            )
    except gdbr_bridge.GDBRUnsupported as exc:
        raise ModelLoadError(
            f"GDBR cannot read {layer}: {exc.reason} (at {exc.layer})",
            "share another hidden layer with --shared-layers",
        ) from exc


@dataclass
class _LabelRun:
    """The undefended GDBR run: its model, stand-in inputs, outcome and chance level, reused by defended runs."""

    layer: str
    model: nn.Module
    bottom: list[str]
    aux_images: torch.Tensor | None
    aux_source: str
    outcome: object
    chance: float


def _label_run(result: Result, spec: str, settings: AttackSettings, title: str = "") -> _LabelRun:
    layer, model, bottom, aux_images, aux_source = _label_setup(result, spec, settings.seed, settings.aux)
    outcome = _run_gdbr(model, layer, result, settings, aux_images, title=title)
    # InsAcc of a random-class batch is high even for an attacker who reads nothing; say what that level is.
    chance = _chance_ins_acc(model, result, settings.class_dist, settings.trials, settings.seed)
    return _LabelRun(layer, model, bottom, aux_images, aux_source, outcome, chance)


def verify_labels(result: Result, spec: str, settings: AttackSettings, defenses: list = ()) -> dict:
    """Run GDBR on real labelled digits from one shared layer's gradient; fill result.verification['gdbr'].

    With `defenses`, also run GDBR on each defended gradient of the same batches and add the rows to
    result.verification['defenses'], without running the undefended attack again.
    """
    run = _label_run(result, spec, settings)
    if defenses:
        result.verification.setdefault("defenses", []).extend(_label_rows(result, run, list(defenses), settings))
    layer, bottom, aux_source, outcome, chance = run.layer, run.bottom, run.aux_source, run.outcome, run.chance
    verification = {
        "shared_layer": layer,
        "batch_size": result.batch_size,
        "ins_acc": outcome.ins_acc,
        "cls_acc": outcome.cls_acc,
        "trials": outcome.trials,
        "seconds": round(outcome.seconds, 3),
        "recovered": {str(k): v for k, v in sorted(outcome.recovered.items())},
        "true": {str(k): v for k, v in sorted(outcome.true.items())},
        "class_dist": settings.class_dist,
        "features_from": aux_source,
        "estimator": outcome.estimator,
        "device": outcome.device,
        "weights": _weights_used(bottom),
        "per_trial_ins_acc": [round(t["ins_acc"], 4) for t in outcome.per_trial],
    }
    verification.update(chance_ins_acc=chance, beats_chance=bool(outcome.ins_acc > chance))
    result.verification["gdbr"] = verification
    return verification


def _chance_ins_acc(model: nn.Module, result: Result, class_dist: str, trials: int, seed: int) -> float:
    """InsAcc of an attacker who reads nothing and guesses equal counts per class, on the same victim batches."""
    import torch

    from rankaudit.verify.attacks import gdbr, gdbr_victims

    shape = tuple(result.input_shape)
    with torch.no_grad():
        classes = model(torch.zeros((1, *shape))).shape[1]
    used = min(int(classes), 10)
    guess = gdbr.largest_remainder(torch.ones(used), result.batch_size)
    scores = []
    for t in range(trials):
        _, labels = gdbr_victims.victim_batch(classes, shape, result.batch_size, class_dist, seed=int(seed) * 1000 + t)
        scores.append(gdbr.ins_acc(guess, torch.bincount(labels, minlength=used)))
    return statistics.median(scores)


def _label_rows(result, run: _LabelRun, defenses, settings: AttackSettings) -> list[dict]:
    layer, model, aux_images, aux_source = run.layer, run.model, run.aux_images, run.aux_source
    base, chance = run.outcome, run.chance
    trials, class_dist, seed = settings.trials, settings.class_dist, settings.seed
    shared_rms = rms([_first_batch_gradient(model, result, class_dist, seed)[f"{layer}.weight"]])
    drop = max(DEGRADED_INS_ACC_DROP, 1.0 / result.batch_size)
    rows = []
    for defense in defenses:
        warmup = _label_warmup(model, result, class_dist, defense.options.get("warmup", 0), seed)
        outcome = _run_gdbr(
            model,
            layer,
            result,
            settings,
            aux_images,
            defense=defense.client(seed, warmup),
            title=f" vs {defense.label}",
        )
        notes = [note for note in (strength_note(defense, shared_rms, f"{layer}'s weight gradient"),) if note]
        if defense.name == "adadefense" and defense.options.get("warmup"):
            notes.append(f"the client's moments come from {defense.options['warmup']} earlier rounds on other batches")
        attack_notes = [
            f"chance level: guessing equal counts per class, reading nothing, scores InsAcc "
            f"{chance:.1%} on these batches"
        ]
        rows.append(
            {
                "defense": defense.name,
                "param": defense.param,
                "spec": defense.spec,
                "label": defense.label,
                "description": defense.description,
                "options": dict(defense.options),
                "attack": "gdbr",
                "metric": "ins_acc",
                "without": base.ins_acc,
                "with": outcome.ins_acc,
                "cls_acc_without": base.cls_acc,
                "cls_acc_with": outcome.cls_acc,
                "chance": chance,
                "per_trial_without": [round(t["ins_acc"], 4) for t in base.per_trial],
                "per_trial_with": [round(t["ins_acc"], 4) for t in outcome.per_trial],
                "degrades": bool(base.ins_acc - outcome.ins_acc >= drop - 1e-12),
                "fails_without": bool(base.ins_acc <= chance),
                "fails_with": bool(outcome.ins_acc <= chance),
                "shared_layer": layer,
                "batch_size": result.batch_size,
                "trials": trials,
                "class_dist": class_dist,
                "features_from": aux_source,
                "device": outcome.device,
                "seconds": round(outcome.seconds, 3),
                "notes": notes,
                "attack_notes": attack_notes,
            }
        )
    return rows


def _label_warmup(model: nn.Module, result: Result, class_dist: str, rounds: int, seed: int) -> list[dict]:
    """The gradients of `rounds` earlier rounds on other digit batches (seeds no trial uses)."""
    import torch

    from rankaudit.verify.attacks import gdbr_victims

    if rounds == 0:
        return []
    shape = tuple(result.input_shape)
    with torch.no_grad():
        classes = model(torch.zeros((1, *shape))).shape[1]
    grads = []
    for j in range(rounds):
        images, labels = gdbr_victims.victim_batch(
            classes, shape, result.batch_size, class_dist, seed=seed * 1000 + WARMUP_SEED_OFFSET + j
        )
        grads.append(gdbr_victims.client_gradient(model, images, labels))
    return grads


def _first_batch_gradient(model: nn.Module, result: Result, class_dist: str, seed: int) -> dict:
    """The client's gradient on the first trial's victim batch (for the scale of the shared gradient)."""
    import torch

    from rankaudit.verify.attacks import gdbr_victims

    shape = tuple(result.input_shape)
    with torch.no_grad():
        classes = model(torch.zeros((1, *shape))).shape[1]
    images, labels = gdbr_victims.victim_batch(classes, shape, result.batch_size, class_dist, seed=int(seed) * 1000)
    return gdbr_victims.client_gradient(model, images, labels)
