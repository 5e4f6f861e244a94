"""--verify rgap|gdbr -> Result.verification: picks the attack, compares it with the verdict, keeps the images."""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.load import load_model
from rankaudit.progress import ProgressBar
from rankaudit.result import Result
from rankaudit.verify import baselines

# Spec of issue 3: an exposed model is confirmed by a near-perfect reconstruction, a protected one by a poor one.
CONFIRM_EXPOSED_BELOW = 1e-3
CONFIRM_PROTECTED_ABOVE = 1e-2


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is available", "use --device auto or --device cpu")
    return requested


def build_real_model(spec: str, input_shape: tuple[int, ...], seed: int) -> tuple[nn.Module, str]:
    """The model with real weights on the CPU, and where its weights came from.

    A file that loads its own weights builds the same parameters whatever the seed; one that relies on
    PyTorch's random initialisation does not. Building twice tells the two apart without guessing.
    """
    torch.manual_seed(seed)
    model = load_model(spec, input_shape, device="cpu").module
    torch.manual_seed(seed + 1)
    again = load_model(spec, input_shape, device="cpu").module
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    has_params = any(True for _ in model.parameters())
    weights = (
        "loaded by the model file" if same and has_params else f"random (PyTorch's default initialisation, seed {seed})"
    )
    return model.double().eval(), weights


def require_trainable(model: nn.Module, verifier: str) -> None:
    """An attack on the shared gradient needs one: a model with no trainable parameter (frozen, or none at all)
    shares nothing, an option it cannot meet (exit 2), not an internal error (issue 23)."""
    if not any(p.requires_grad for p in model.parameters()):
        what = "all of its parameters are frozen" if any(True for _ in model.parameters()) else "it has no parameters"
        raise UsageError(
            f"{verifier} attacks the shared gradient, but the model shares none: {what}",
            "make parameters trainable (requires_grad), or use --verify rank (an empty gradient has rank 0)",
        )


def _loss_for(model: nn.Module, images: torch.Tensor) -> str:
    with torch.no_grad():
        logits = model(images[:1].to(dtype=next(model.parameters()).dtype))
    return "logistic" if logits.numel() == 1 else "cross-entropy"


def _confirms(verdict: str, median_mse: float) -> tuple[bool, str]:
    if verdict == "exposed":
        ok = median_mse < CONFIRM_EXPOSED_BELOW
        return ok, (
            f"confirms exposed: median MSE {median_mse:.3g} < {CONFIRM_EXPOSED_BELOW:g}"
            if ok
            else f"disagrees: the analysis says exposed, but the attack's median MSE is {median_mse:.3g} "
            f"(>= {CONFIRM_EXPOSED_BELOW:g})"
        )
    if verdict == "protected":
        ok = median_mse > CONFIRM_PROTECTED_ABOVE
        return ok, (
            f"confirms protected: median MSE {median_mse:.3g} > {CONFIRM_PROTECTED_ABOVE:g}"
            if ok
            else f"disagrees: the analysis says protected, but the attack reached median MSE {median_mse:.3g} "
            f"(<= {CONFIRM_PROTECTED_ABOVE:g})"
        )
    if verdict == "partial":
        # A partial verdict rules out only an exact reconstruction; a near-perfect one is what it predicts for a
        # small deficit, a poor one may be the attack's weakness: neither outcome confirms or refutes it.
        return False, (
            f"partial verdict: no threshold to confirm against (median MSE {median_mse:.3g}); "
            "--verify rank measures what the gradient shows"
        )
    return False, f"boundary verdict: no threshold to confirm against (median MSE {median_mse:.3g})"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _save_images(artifacts: Path, originals: torch.Tensor, reconstructions: torch.Tensor) -> list[tuple[str, str]]:
    from PIL import Image

    artifacts.mkdir(parents=True, exist_ok=True)
    paths = []
    for index, (original, reconstruction) in enumerate(zip(originals, reconstructions)):
        pair = []
        for kind, image in (("original", original), ("reconstruction", reconstruction)):
            array = image.detach().to(torch.float64).cpu().numpy()
            np.save(artifacts / f"{kind}_{index}.npy", array)
            pixels = (np.clip(array, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
            pixels = pixels[0] if pixels.shape[0] == 1 else np.transpose(pixels, (1, 2, 0))
            target = artifacts / f"{kind}_{index}.png"
            Image.fromarray(pixels).save(target)
            pair.append(str(target))
        paths.append((pair[0], pair[1]))
    return paths


def _input_setup(
    result: Result, spec: str, samples: int, seed: int, data: str | None
) -> tuple[nn.Module, str, torch.Tensor, str, str]:
    """The real model, where its weights came from, `samples` float64 images, their source, the loss."""
    from rankaudit.verify import data as image_data

    model, weights = build_real_model(spec, result.input_shape, seed)
    require_trainable(model, "--verify rgap")
    if len(result.input_shape) != 3:
        raise UsageError(
            f"--verify rgap attacks images; this model's input shape is {result.input_shape}",
            "verify a model whose input is C,H,W",
        )
    try:
        images, source = image_data.load_images(data, tuple(result.input_shape), samples, seed)
    except image_data.DataError as exc:
        raise UsageError(str(exc)) from exc
    images = images.to(torch.float64)
    return model, weights, images, source, _loss_for(model, images)


def _attack_images(
    model: nn.Module,
    images: torch.Tensor,
    input_shape: tuple[int, ...],
    loss: str,
    *,
    device: str,
    seed: int,
    steps: int,
    restarts: int,
    show_progress: bool,
    defense=None,
    title: str = "",
    optimisation: bool = False,
):
    """R-GAP on `images`, or inverting gradients where R-GAP cannot go (always, with `optimisation`):
    (attack, outcome, reconstructions, why R-GAP stopped or None)."""
    from rankaudit.verify.attacks import invert, rgap

    samples = len(images)
    try:
        if optimisation:
            raise rgap.RGapUnsupported(type(model).__name__, "the optimisation attack was asked for")
        rgap.extract_chain(model, tuple(input_shape))
    except rgap.RGapUnsupported as stop:
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


def _input_run(
    result: Result,
    spec: str,
    *,
    samples: int,
    seed: int,
    device: str,
    data: str | None,
    steps: int,
    restarts: int,
    show_progress: bool,
    title: str = "",
) -> _InputRun:
    model, weights, images, source, loss = _input_setup(result, spec, samples, seed, data)
    attack, outcome, reconstructions, stop = _attack_images(
        model,
        images,
        tuple(result.input_shape),
        loss,
        device=device,
        seed=seed,
        steps=steps,
        restarts=restarts,
        show_progress=show_progress,
        title=title,
    )
    return _InputRun(model, weights, images, source, loss, attack, outcome, reconstructions, stop)


def verify_inputs(
    result: Result,
    spec: str,
    *,
    samples: int = 4,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    steps: int = 1000,
    restarts: int = 2,
    artifacts: str | None = None,
    show_progress: bool = True,
    defenses: list = (),
) -> dict:
    """Run R-GAP (or, where it cannot go, inverting gradients) on real images; fill result.verification['rgap'].

    With `defenses`, also attack each defended gradient on the same images and add the rows to
    result.verification['defenses'] (as verify_defenses does), without running the undefended attack again.
    """
    device = resolve_device(device)
    run = _input_run(
        result,
        spec,
        samples=samples,
        seed=seed,
        device=device,
        data=data,
        steps=steps,
        restarts=restarts,
        show_progress=show_progress,
    )
    if defenses:
        result.verification.setdefault("defenses", []).extend(
            _input_rows(
                result,
                run,
                list(defenses),
                seed=seed,
                device=device,
                steps=steps,
                restarts=restarts,
                show_progress=show_progress,
            )
        )
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
                "residual": _finite(s.residual),
                "condition": _finite(s.condition),
            }
            for s in outcome.layers
        ]
    saved = _save_images(Path(artifacts), images, reconstructions) if artifacts else [(None, None)] * len(images)
    confirms, judgement = _confirms(result.verdict, outcome.median_mse)
    if attack == "inverting-gradients" and not confirms and result.verdict == "exposed":
        judgement += (
            "; an optimisation attack is not exact, so missing the threshold within its budget "
            f"({steps} steps) does not show the input is safe"
        )
    scored, against = _against_baselines(images, reconstructions)
    judgement += _baseline_judgement(against)
    deficient = [layer for layer in layers if layer["local_deficit"] > 0]
    if deficient:
        # Spec §7: counts cannot see dependent constraints; the numerical rank can, and explains a disagreement.
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
        "median_psnr": _finite(outcome.median_psnr),
        "seconds": round(sum(outcome.seconds), 3),
        "confirms": confirms,
        "judgement": judgement,
        "note": " ".join(notes),
        "notes": notes,
        "samples": [
            {
                "index": i,
                "mse": outcome.mse[i],
                "psnr": _finite(outcome.psnr[i]),
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


def _against_baselines(originals: torch.Tensor, reconstructions: torch.Tensor) -> tuple[list, dict]:
    """Every image's reconstruction scored beside the grey and mean-colour baselines (rankaudit.verify.baselines),
    and the summary keys the verification gains: the baselines' medians, the best image, the outcome."""
    scored = baselines.score(originals, reconstructions)
    return scored, baselines.summary(scored)


def _baseline_judgement(against: dict) -> str:
    """What the judgement adds when some reconstruction does not beat both baselines."""
    if against["outcome"] == baselines.FAILED:
        return (
            "; no reconstruction beats both the flat-grey and the mean-colour baseline: the attack failed, "
            "it recovered nothing"
        )
    if against["outcome"] == baselines.PARTLY:
        return (
            f"; only {against['recovered_samples']} reconstruction(s) beat both the flat-grey and the "
            "mean-colour baseline"
        )
    return ""


def _dager_layer(result: Result):
    """The layer DAGER reads: the first shared layer the static finding exposes, else the first one whose gradient is
    sent at all (to show the test failing where the finding says it does)."""
    tokens = result.token_leakage
    layers = tokens.layers if tokens is not None else []
    sent = [layer for layer in layers if layer.shared and layer.trainable]
    if not sent:
        raise UsageError(
            "no shared, trainable layer reads per-token vectors, so DAGER's span test has no gradient "
            "to read" + ("" if layers else " (the model reads no token ids, or the trace found no such layer)"),
            "verify a language model whose first-block projections' gradients are sent, or skip --verify dager",
        )
    return next((layer for layer in sent if layer.exposed), sent[0])


def _token_call(result: Result, spec: str, seed: int, device: str):
    """The real model in float64 on `device`, where its weights came from, and how to call it with token ids."""
    from rankaudit.trace import input_specs
    from rankaudit.verify.attacks import dager

    named = {info.name: info for info in result.inputs}
    dtypes = {name: getattr(torch, info.dtype) for name, info in named.items()}
    if len(named) == 1:
        (info,) = named.values()
        shape, dtype = tuple(info.shape), dtypes[info.name]
    else:
        shape, dtype = {name: tuple(info.shape) for name, info in named.items()}, dtypes
    model, weights = build_real_model(spec, shape, seed)
    model = model.to(device)
    loaded = load_model(spec, shape, device="meta", input_dtype=dtype)
    specs = [s for s in input_specs(model, shape, dtype) if s.name in named or s.same_as]
    return model, weights, dager.forward_call(model, specs, loaded.forward_kwargs)


def verify_tokens(
    result: Result, spec: str, *, seed: int = 0, device: str = "auto", extend: bool = True, show_progress: bool = True
) -> dict:
    """DAGER (Petrov et al., NeurIPS 2024) on a real gradient: random token batches of the model's vocabulary at
    the analysed batch size and sequence length; fill result.verification['dager']."""
    from rankaudit.verify import AttackUnsupported
    from rankaudit.verify.attacks import dager

    device = resolve_device(device)
    target = _dager_layer(result)
    # Every sent layer reading the same vectors adds its gradient's row space: q, k and v of the first block.
    group = [
        layer
        for layer in result.token_leakage.layers
        if layer.shared and layer.trainable and layer.reads == target.reads
    ]
    vocabulary = max(embedding.vocab_size for embedding in result.token_leakage.embeddings)
    model, weights, call = _token_call(result, spec, seed, device)
    rows = vocabulary if target.position_dependent else -(-vocabulary // target.positions)
    begin = time.perf_counter()
    try:
        with ProgressBar(rows, f"DAGER span test over {vocabulary:,} tokens", enabled=show_progress) as bar:
            outcome = dager.run_dager(
                call,
                [layer.name for layer in group],
                batch_size=result.batch_size,
                positions=target.positions,
                vocab_size=vocabulary,
                position_dependent=target.position_dependent,
                device=device,
                seed=seed,
                extend=extend,
                norm=target.reads,
                progress=bar,
            )
    except AttackUnsupported as exc:
        raise ModelLoadError(
            f"DAGER cannot read {exc.layer}: {exc.reason}",
            "share the first block's projections, or skip --verify dager",
        ) from exc
    seconds = time.perf_counter() - begin
    verification = dager_summary(outcome, group, result.batch_size, vocabulary, weights, device, seconds)
    result.verification["dager"] = verification
    return verification


def dager_summary(outcome, group, batch_size: int, vocabulary: int, weights: str, device: str, seconds: float) -> dict:
    """The JSON shape of verification.dager, and whether the run agrees with the static finding: exposed when any
    layer of the group is (their gradients together span at least what the exposed one's does)."""
    from rankaudit.verify.attacks import dager

    target = next((layer for layer in group if layer.exposed), group[0])

    true_tokens = {token for token, _ in outcome.true_pairs}
    found_tokens = {token for token, _, _ in outcome.passed}
    hits = len(true_tokens & found_tokens)
    precision = hits / len(found_tokens) if found_tokens else 0.0
    recall = hits / len(true_tokens) if true_tokens else 0.0
    found_pairs = {(token, position) for token, position, _ in outcome.passed}
    pair_hits = len(outcome.true_pairs & found_pairs)
    exact = precision == 1.0 and recall == 1.0
    # The condition holds on distinct vectors: a token repeated (at the same position, when vectors depend on it)
    # adds nothing to the span, so a batch of B·n >= d_in tokens can still fall short of d_in distinct vectors.
    distinct = len(outcome.true_pairs) if outcome.position_dependent else len(true_tokens)
    expected = distinct < target.safe_from
    fewer = (
        f"; the batch held {distinct} distinct vectors for B·n = {target.tokens_per_batch} (repeats count once), "
        f"fewer than the {target.safe_from} the test needs to fail"
        if expected and not target.exposed
        else ""
    )
    if expected:
        confirms = exact
        judgement = (
            "confirms exposed: the span test recovered the batch's token set exactly"
            if confirms
            else f"disagrees: the finding says exposed, but token precision {precision:.3f}, recall {recall:.3f}"
        )
        judgement += fewer
    else:
        confirms = not exact
        judgement = (
            f"confirms not exposed at {distinct} distinct vectors (B·n = {target.tokens_per_batch}): token "
            f"precision {precision:.3f}, recall {recall:.3f}"
            if confirms
            else "disagrees: the finding says not exposed, yet the span test recovered the token set exactly"
        )
    basis = outcome.basis
    notes = [
        f"weights: {weights}",
        f"loss: {outcome.loss}",
        f"numerical rank: singular values of the gradient{'s' if len(group) > 1 else ''} ({outcome.d_in} rows"
        f"{', each layer scaled to unit norm' if len(group) > 1 else ''}) above σ_1 · max(rows, columns) · ε "
        f"(float64) = {basis.tolerance:.3g}",
        f"a candidate is in the span when its distance to it is below {dager.DISTANCE_THRESHOLD:g} of its norm; "
        f"tested {outcome.method}, {outcome.candidates_tested:,} vectors",
    ] + outcome.notes
    if outcome.nearest_rejected is not None:
        notes.append(f"the nearest rejected candidate lay at {outcome.nearest_rejected:.3g} of its norm")
    return {
        "layer": outcome.layers[0],
        "layers": outcome.layers,
        "device": device,
        "weights": weights,
        "batch_size": batch_size,
        "positions": target.positions,
        "tokens_per_batch": target.tokens_per_batch,
        "d_in": outcome.d_in,
        "vocabulary": vocabulary,
        "rank": basis.rank,
        "rank_tolerance": basis.tolerance,
        "singular_gap": [basis.last_kept, basis.first_dropped],
        "distance_threshold": dager.DISTANCE_THRESHOLD,
        "position_dependent": outcome.position_dependent,
        "candidates_tested": outcome.candidates_tested,
        "true_tokens": len(true_tokens),
        "recovered_tokens": len(found_tokens),
        "token_precision": precision,
        "token_recall": recall,
        "pair_precision": (pair_hits / len(found_pairs) if found_pairs else 0.0)
        if outcome.position_dependent
        else None,
        "pair_recall": (pair_hits / len(outcome.true_pairs) if outcome.true_pairs else 0.0)
        if outcome.position_dependent
        else None,
        "distinct_vectors": distinct,
        "expected_exposed": expected,
        "decoder": outcome.causal,
        "extension": outcome.extension,
        "exact_sequence_rate": (outcome.extension or {}).get("exact_sequence_rate"),
        "static_exposed": target.exposed,
        "confirms": confirms,
        "judgement": judgement,
        "seconds": round(seconds, 3),
        "span_seconds": round(outcome.span_seconds, 3),
        "notes": notes,
    }


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
    from rankaudit.verify import data as image_data
    from rankaudit.verify.attacks import gdbr

    generator = torch.Generator().manual_seed(seed + 7919)
    if aux in (None, "dummy"):
        # GDBR draws N(0,1) dummies for standardised inputs; ours live in [0, 1], so the dummies do too.
        return torch.rand((1000, *input_shape), generator=generator), "dummy inputs, uniform on [0, 1]"
    if aux == "normal":
        return torch.randn((1000, *input_shape), generator=generator), "dummy inputs, standard normal"
    if aux == "digits":
        return gdbr.held_out_images(tuple(input_shape)), "held-out scikit-learn digits (never in a victim batch)"
    try:
        images, source = image_data.load_images(aux, tuple(input_shape), 1000, seed)
    except image_data.DataError as exc:
        raise UsageError(str(exc)) from exc
    return images, source


def _label_setup(result: Result, spec: str, seed: int, aux: str | None):
    """The shared layer GDBR reads, the model with the paper's bottom-layer init, those layers, the aux inputs."""
    from rankaudit.verify.attacks import gdbr

    layer = _gdbr_layer(result)
    if len(result.input_shape) != 3:
        raise UsageError(
            f"--verify gdbr feeds images; this model's input shape is {result.input_shape}",
            "verify a model whose input is C,H,W",
        )
    torch.manual_seed(seed)
    model = load_model(spec, result.input_shape, device="cpu").module.eval()
    names = [name for name, _ in model.named_modules()]
    bottom = names[names.index(layer) :] if layer in names else [layer]
    bottom = [name for name in bottom if isinstance(model.get_submodule(name), (nn.Linear, nn.Conv2d))]
    gdbr.init_like_paper(model, bottom, seed=seed)
    aux_images, aux_source = _aux_images(aux, tuple(result.input_shape), seed)
    return layer, model, bottom, aux_images, aux_source


def _run_gdbr(
    model,
    layer,
    result: Result,
    *,
    trials,
    class_dist,
    aux_images,
    device,
    seed,
    show_progress,
    defense=None,
    title: str = "",
):
    from rankaudit.verify.attacks import gdbr

    try:
        with ProgressBar(trials, f"GDBR{title}", enabled=show_progress) as per_trial:
            return gdbr.run_gdbr(
                model,
                layer,
                result.batch_size,
                trials=trials,
                class_dist=class_dist,
                aux=aux_images,
                device=device,
                seed=seed,
                progress=per_trial,
                input_shape=tuple(result.input_shape),
                defense=defense,
            )
    except gdbr.GDBRUnsupported as exc:
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


def _label_run(
    result: Result,
    spec: str,
    *,
    trials: int,
    class_dist: str,
    aux: str | None,
    seed: int,
    device: str,
    show_progress: bool,
    title: str = "",
) -> _LabelRun:
    layer, model, bottom, aux_images, aux_source = _label_setup(result, spec, seed, aux)
    outcome = _run_gdbr(
        model,
        layer,
        result,
        trials=trials,
        class_dist=class_dist,
        aux_images=aux_images,
        device=device,
        seed=seed,
        show_progress=show_progress,
        title=title,
    )
    # InsAcc of a random-class batch is high even for an attacker who reads nothing; say what that level is.
    chance = _chance_ins_acc(model, result, class_dist, trials, seed)
    return _LabelRun(layer, model, bottom, aux_images, aux_source, outcome, chance)


def verify_labels(
    result: Result,
    spec: str,
    *,
    trials: int = 5,
    class_dist: str = "random",
    aux: str | None = None,
    device: str = "auto",
    seed: int = 0,
    show_progress: bool = True,
    defenses: list = (),
) -> dict:
    """Run GDBR on real labelled digits from one shared layer's gradient; fill result.verification['gdbr'].

    With `defenses`, also run GDBR on each defended gradient of the same batches and add the rows to
    result.verification['defenses'], without running the undefended attack again.
    """
    device = resolve_device(device)
    run = _label_run(
        result,
        spec,
        trials=trials,
        class_dist=class_dist,
        aux=aux,
        seed=seed,
        device=device,
        show_progress=show_progress,
    )
    if defenses:
        result.verification.setdefault("defenses", []).extend(
            _label_rows(
                result,
                run,
                list(defenses),
                trials=trials,
                class_dist=class_dist,
                seed=seed,
                device=device,
                show_progress=show_progress,
            )
        )
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
        "class_dist": class_dist,
        "features_from": aux_source,
        "estimator": outcome.estimator,
        "device": outcome.device,
        "weights": f"random; {', '.join(bottom)} initialised uniform on [0.01, 0.2] as in GDBR (bias 0)",
        "per_trial_ins_acc": [round(t["ins_acc"], 4) for t in outcome.per_trial],
    }
    verification.update(chance_ins_acc=chance, beats_chance=bool(outcome.ins_acc > chance))
    result.verification["gdbr"] = verification
    return verification


# --------------------------------------------------------------------------- --verify rank: rank of ∂g/∂x (spec §10)


def _rank_inputs(result: Result, data: str | None, count: int, seed: int) -> tuple[torch.Tensor, str]:
    """Real images where the input is one (1 or 3 channels, or --data given); seeded uniform values otherwise."""
    from rankaudit.verify import data as image_data

    shape = tuple(result.input_shape)
    if data is not None or (len(shape) == 3 and shape[0] in (1, 3)):
        try:
            images, source = image_data.load_images(data, shape, count, seed)
        except image_data.DataError as exc:
            raise UsageError(str(exc)) from exc
        return images.to(torch.float64), source
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.rand((count, *shape), generator=generator, dtype=torch.float64),
        f"{count} seeded uniform random inputs on [0, 1] (the input is not an image; --data gives real ones)",
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
) -> dict:
    """Measure rank(∂g/∂x) of the shared gradient (rankaudit.verify.rank.jacobian); fill result.verification['rank'].

    Batch size 1: one sketch per image over `samples` images, the headline the largest rank (the generic rank:
    an image can only lose rank to a coincidence such as a dead unit). Batch size B > 1: one sketch of one
    batch of B images. Compares the headline with the verdict and with the static bound (spec §9).
    """
    from rankaudit.verify.rank import jacobian as rank

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
    images, source = _rank_inputs(result, data, samples if batch == 1 else batch, seed)
    with torch.no_grad():
        logits = rank.logits_of(model(images[:1])).numel()
    loss = rank.loss_name_for(logits)
    labels = rank.draw_labels(len(images), loss, logits, seed)
    batches = [slice(i, i + 1) for i in range(len(images))] if batch == 1 else [slice(0, batch)]
    measurements = []
    with ProgressBar(len(batches), "rank sketch", enabled=show_progress) as bar:
        for number, part in enumerate(batches):
            measurements.append(
                rank.measure(
                    model,
                    images[part],
                    labels[part],
                    shared,
                    device=device,
                    seed=seed + number,
                    loss=loss,
                    directions=rank.MAX_DIRECTIONS if artifacts else 0,
                    hidden=True,
                    precision=precision,
                    progress=lambda done, rows, number=number: bar(number * rows + done, len(batches) * rows),
                )
            )
    headline = max(measurements, key=lambda m: m.rank)
    confirms, agreement, judgement = rank.judge(result.verdict, headline.rank, headline.unknowns)
    bound = rank.bound_check(result.identifiability, headline.rank)
    notes = [
        f"weights: {weights}",
        f"inputs: {source}",
        f"loss: {loss}, labels drawn with seed {seed}",
        f"shared gradient: {len(shared)} parameter tensors, {headline.shared_gradient_size:,} values",
        f"sketch: {headline.sketch_rows} Gaussian rows x {headline.unknowns} unknowns in {headline.precision}, "
        f"{headline.method} in chunks of {headline.chunk_rows} rows; rank by {headline.spectrum}",
    ]
    notes.append(f"precision: {headline.precision_note}")
    if not headline.reliable:
        notes.append(
            f"unreliable: the gap {_gap_text(headline.gap)} is under {rank.RELIABLE_GAP:g}, so the rank "
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
    saved = rank.save_directions(artifacts, headline) if artifacts else []
    seen = _what_the_gradient_shows(result, images, batches, measurements, artifacts)
    verification = {
        "unknowns": headline.unknowns,
        "rank": headline.rank,
        "deficit": headline.deficit,
        "tolerance": headline.tolerance,
        "tolerance_rule": rank.TOLERANCE_RULE,
        "precision": headline.precision,
        "precision_note": headline.precision_note,
        "precisions": [m.precision for m in measurements],
        "gap": _finite(headline.gap or math.nan),
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
                "gap": _finite(m.gap or math.nan),
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
    result.verification["rank"] = verification
    return verification


def read_worst_sample(
    verification: dict, result: Result, ranks: list[int], inputs: list[dict], what: str, *, keep_agreement: bool = False
):
    """Spec §14 in the rank check's JSON: the per-sample keys, and confirms / judgement read the worst sample (the
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


def _what_the_gradient_shows(
    result: Result, images: torch.Tensor, batches: list[slice], measurements: list, artifacts: str | None
) -> dict:
    """Spec §11, measured: each input's hidden energy and visible part (rankaudit.verify.rank.hidden), the medians
    over all inputs, PNGs of the originals and visible parts for the HTML report (result.images), and with
    --artifacts the visible parts as .npy and PNG."""
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
        for offset, share in enumerate(hidden.shares(batch, measurement.invisible)):
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
        # An empty gradient shows nothing: no "visible part" figure of an all-zero projection (issue 23).
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


def _png_bytes(picture: np.ndarray) -> bytes | None:
    """An image (C x H x W, 1 or 3 channels, [0, 1]) as PNG bytes, clipped to the range; None for other inputs."""
    import io

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


# --------------------------------------------------------------------------- --defense: the attacks against defenses

# An input attack is degraded when its median MSE at least doubles and leaves the near-perfect zone; it fails when
# the MSE passes the threshold the verifier reads as a poor reconstruction.
DEGRADED_MSE_FACTOR = 2.0
# A label attack is degraded when it loses at least this share of the batch's labels (and at least one label).
DEGRADED_INS_ACC_DROP = 0.05
WARMUP_SEED_OFFSET = 104_729


def _rms(tensors) -> float:
    tensors = list(tensors)
    total = sum(float(t.double().pow(2).sum()) for t in tensors)
    count = sum(t.numel() for t in tensors)
    return math.sqrt(total / count) if count else 0.0


def _strength_note(defense, rms: float, what: str) -> str | None:
    """Puts σ in the gradient's own units: absolute noise means nothing without the scale it is added to."""
    if defense.name != "noise" or rms <= 0:
        return None
    return f"σ = {defense.param:g} is {defense.param / rms:.3g}× the RMS of {what} ({rms:.3g})"


def _input_warmup(model: nn.Module, input_shape, loss: str, rounds: int, seed: int) -> list[dict]:
    """The gradients of `rounds` earlier rounds on other images: crops of the photographs under another seed."""
    from rankaudit.verify import data as image_data
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


def _label_warmup(model: nn.Module, result: Result, class_dist: str, rounds: int, seed: int) -> list[dict]:
    """The gradients of `rounds` earlier rounds on other digit batches (seeds no trial uses)."""
    from rankaudit.verify.attacks import gdbr

    if rounds == 0:
        return []
    shape = tuple(result.input_shape)
    with torch.no_grad():
        classes = model(torch.zeros((1, *shape))).shape[1]
    grads = []
    for j in range(rounds):
        images, labels = gdbr.victim_batch(
            classes, shape, result.batch_size, class_dist, seed=seed * 1000 + WARMUP_SEED_OFFSET + j
        )
        grads.append(gdbr.client_gradient(model, images, labels))
    return grads


def _first_batch_gradient(model: nn.Module, result: Result, class_dist: str, seed: int) -> dict:
    """The client's gradient on the first trial's victim batch (for the scale of the shared gradient)."""
    from rankaudit.verify.attacks import gdbr

    shape = tuple(result.input_shape)
    with torch.no_grad():
        classes = model(torch.zeros((1, *shape))).shape[1]
    images, labels = gdbr.victim_batch(classes, shape, result.batch_size, class_dist, seed=int(seed) * 1000)
    return gdbr.client_gradient(model, images, labels)


def _chance_ins_acc(model: nn.Module, result: Result, class_dist: str, trials: int, seed: int) -> float:
    """InsAcc of an attacker who reads nothing and guesses equal counts per class, on the same victim batches."""
    from rankaudit.verify.attacks import gdbr

    shape = tuple(result.input_shape)
    with torch.no_grad():
        classes = model(torch.zeros((1, *shape))).shape[1]
    used = min(int(classes), 10)
    guess = gdbr.largest_remainder(torch.ones(used), result.batch_size)
    scores = []
    for t in range(trials):
        _, labels = gdbr.victim_batch(classes, shape, result.batch_size, class_dist, seed=int(seed) * 1000 + t)
        scores.append(gdbr.ins_acc(guess, torch.bincount(labels, minlength=used)))
    return statistics.median(scores)


def _input_rows(
    result, run: _InputRun, defenses, *, seed, device, steps, restarts, show_progress, optimisation=False
) -> list[dict]:
    from rankaudit.verify.attacks import rgap

    model, images, source, loss = run.model, run.images, run.source, run.loss
    shape = tuple(result.input_shape)
    first = rgap.client_gradients(model, images[0], 1 if loss == "logistic" else 0, loss)
    warmups = [_input_warmup(model, shape, loss, defense.options.get("warmup", 0), seed) for defense in defenses]
    try:
        rgap.extract_chain(model, shape)
        passes = [False, True] if optimisation else [False]
    except rgap.RGapUnsupported:
        passes = [False]  # the optimisation attack is the only one anyway
    rows = []
    for forced in passes:
        if forced:  # the optimisation attack where R-GAP ran: its own undefended baseline
            attack, base, base_found, stop = _attack_images(
                model,
                images,
                shape,
                loss,
                device=device,
                seed=seed,
                steps=steps,
                restarts=restarts,
                show_progress=show_progress,
                title=" without defense",
                optimisation=True,
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
                device=device,
                seed=seed,
                steps=steps,
                restarts=restarts,
                show_progress=show_progress,
                defense=defense.client(seed, warmup),
                title=f" vs {defense.label}",
                optimisation=forced,
            )
            row = _input_row(defense, attack, base, outcome, images, source, loss, first, stop, steps, restarts)
            with_scored = baselines.summary(baselines.score(images, found))
            # Issue 21: both medians beside what a flat image scores on the same images.
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
    notes = [note for note in (_strength_note(defense, _rms(first.values()), "the client's gradient"),) if note]
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
        "without": _finite(without),
        "with": _finite(with_),
        "psnr_without": _finite(base.median_psnr),
        "psnr_with": _finite(outcome.median_psnr),
        "mse_without": [_finite(m) for m in base.mse],
        "mse_with": [_finite(m) for m in outcome.mse],
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


def _label_rows(result, run: _LabelRun, defenses, *, trials, class_dist, seed, device, show_progress) -> list[dict]:
    layer, model, aux_images, aux_source = run.layer, run.model, run.aux_images, run.aux_source
    base, chance = run.outcome, run.chance
    shared_rms = _rms([_first_batch_gradient(model, result, class_dist, seed)[f"{layer}.weight"]])
    drop = max(DEGRADED_INS_ACC_DROP, 1.0 / result.batch_size)
    rows = []
    for defense in defenses:
        warmup = _label_warmup(model, result, class_dist, defense.options.get("warmup", 0), seed)
        outcome = _run_gdbr(
            model,
            layer,
            result,
            trials=trials,
            class_dist=class_dist,
            aux_images=aux_images,
            device=device,
            seed=seed,
            show_progress=show_progress,
            defense=defense.client(seed, warmup),
            title=f" vs {defense.label}",
        )
        notes = [note for note in (_strength_note(defense, shared_rms, f"{layer}'s weight gradient"),) if note]
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


def verify_defenses(
    result: Result,
    spec: str,
    defenses: list,
    *,
    attacks=("rgap",),
    samples: int = 4,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    steps: int = 1000,
    restarts: int = 2,
    trials: int = 5,
    class_dist: str = "random",
    aux: str | None = None,
    optimisation: bool = False,
    training: bool = True,
    training_rounds: int | None = None,
    training_clients: int | None = None,
    show_progress: bool = True,
) -> dict:
    """Run each requested attack without and with every defense; fill result.verification['defenses'].

    ``defenses``: :class:`rankaudit.verify.defenses.Defense` objects (``parse_defense("noise:0.01")``).
    ``attacks``: the attacks the user asked for, ``"rgap"`` and/or ``"gdbr"``; the other arguments mean what they
    mean for :func:`verify_inputs` (``samples``, ``data``, ``steps``, ``restarts``) and :func:`verify_labels`
    (``trials``, ``class_dist``, ``aux``), so call this with the same values to attack the same images and
    batches: the baseline ("without") is re-run here on them, the defended runs see only the defended gradient.
    ``optimisation``: where R-GAP runs, also attack every defense with inverting gradients (``steps`` x
    ``restarts``; slow on a CPU, about 10 s per image and restart for CNN6). R-GAP is exact algebra and breaks
    under any perturbation, so its failure alone overstates a defense; the optimisation attack degrades gracefully.

    Sets ``result.verification["defenses"]``: one row per (defense, attack) with ``defense``, ``param``, ``spec``,
    ``label``, ``attack`` ("rgap" | "inverting-gradients" | "gdbr"), ``metric`` ("median_mse" | "ins_acc"),
    ``without``, ``with``, ``degrades`` (MSE at least doubled and above 1e-3; InsAcc down by at least
    max(0.05, 1/B)), ``fails_without``/``fails_with`` (MSE > 1e-2; InsAcc no better than guessing equal counts,
    ``chance``), PSNR or ClsAcc both ways, per-sample/per-trial figures, ``notes`` (about this defense) and
    ``attack_notes`` (about the attack, the same in every row of that attack). When AdaDefense is among the
    defenses and ``training`` is true, also ``result.verification["adadefense_training"]`` = {``rounds``,
    ``clients``, ``accuracy_without``, ``accuracy_with``, ...}: FedAvg on scikit-learn digits with and without
    the stand-in (:func:`rankaudit.verify.defenses.fedavg_accuracy`, about 4 s each). Returns both as a dict.
    """
    unknown = [a for a in attacks if a not in ("rgap", "gdbr")]
    if unknown:
        raise UsageError(f"cannot attack defenses with {', '.join(map(str, unknown))}", "use rgap and/or gdbr")
    defenses = list(defenses)
    out: dict = {}
    if not defenses:
        return out
    device = resolve_device(device)
    rows: list[dict] = []
    if "rgap" in attacks:
        run = _input_run(
            result,
            spec,
            samples=samples,
            seed=seed,
            device=device,
            data=data,
            steps=steps,
            restarts=restarts,
            show_progress=show_progress,
            title=" without defense",
        )
        rows += _input_rows(
            result,
            run,
            defenses,
            seed=seed,
            device=device,
            steps=steps,
            restarts=restarts,
            show_progress=show_progress,
            optimisation=optimisation,
        )
    if "gdbr" in attacks:
        run = _label_run(
            result,
            spec,
            trials=trials,
            class_dist=class_dist,
            aux=aux,
            seed=seed,
            device=device,
            show_progress=show_progress,
            title=" without defense",
        )
        rows += _label_rows(
            result,
            run,
            defenses,
            trials=trials,
            class_dist=class_dist,
            seed=seed,
            device=device,
            show_progress=show_progress,
        )
    result.verification["defenses"] = rows
    out["defenses"] = rows
    if training:
        training_row = verify_training_cost(
            result, defenses, seed=seed, rounds=training_rounds, clients=training_clients, show_progress=show_progress
        )
        if training_row is not None:
            out["adadefense_training"] = training_row
    return out


def verify_training_cost(
    result: Result,
    defenses: list,
    *,
    seed: int = 0,
    rounds: int | None = None,
    clients: int | None = None,
    show_progress: bool = True,
) -> dict | None:
    """When AdaDefense is among `defenses`: FedAvg with and without its stand-in, in
    result.verification['adadefense_training']; None otherwise."""
    from rankaudit.verify import defenses as defense_lib

    ada = next((d for d in defenses if d.name == "adadefense"), None)
    if ada is not None:
        kwargs = {
            "rounds": rounds or defense_lib.FEDAVG_ROUNDS,
            "clients": clients or defense_lib.FEDAVG_CLIENTS,
            "seed": seed,
        }
        with ProgressBar(2, "FedAvg with and without AdaDefense", enabled=show_progress) as bar:
            plain = defense_lib.fedavg_accuracy(None, **kwargs)
            bar.update()
            defended = defense_lib.fedavg_accuracy(ada, **kwargs)
            bar.update()
        training_row = {
            "rounds": plain["rounds"],
            "clients": plain["clients"],
            "local_steps": plain["local_steps"],
            "local_lr": plain["local_lr"],
            "batch_size": plain["batch_size"],
            "accuracy_without": plain["accuracy"],
            "accuracy_with": defended["accuracy"],
            "accuracy_cost": plain["accuracy"] - defended["accuracy"],
            "server_lr_without": plain["server_lr"],
            "server_lr_with": defended["server_lr"],
            "defense": ada.spec,
            "model": plain["model"],
            "data": plain["data"],
            "seed": seed,
            "train_accuracy_without": plain["train_accuracy"],
            "train_accuracy_with": defended["train_accuracy"],
            "seconds": round(plain["seconds"] + defended["seconds"], 3),
        }
        result.verification["adadefense_training"] = training_row
        return training_row
    return None
