"""--verify rgap|gdbr -> Result.verification: picks the attack, compares it with the verdict, keeps the images."""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from torch import nn

from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.load import load_model
from rankaudit.progress import ProgressBar
from rankaudit.result import Result

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
    weights = ("loaded by the model file" if same and has_params
               else f"random (PyTorch's default initialisation, seed {seed})")
    return model.double().eval(), weights


def _loss_for(model: nn.Module, images: torch.Tensor) -> str:
    with torch.no_grad():
        logits = model(images[:1].to(dtype=next(model.parameters()).dtype))
    return "logistic" if logits.numel() == 1 else "cross-entropy"


def _confirms(verdict: str, median_mse: float) -> tuple[bool, str]:
    if verdict == "exposed":
        ok = median_mse < CONFIRM_EXPOSED_BELOW
        return ok, (f"confirms exposed: median MSE {median_mse:.3g} < {CONFIRM_EXPOSED_BELOW:g}" if ok else
                    f"disagrees: the analysis says exposed, but the attack's median MSE is {median_mse:.3g} "
                    f"(>= {CONFIRM_EXPOSED_BELOW:g})")
    if verdict == "protected":
        ok = median_mse > CONFIRM_PROTECTED_ABOVE
        return ok, (f"confirms protected: median MSE {median_mse:.3g} > {CONFIRM_PROTECTED_ABOVE:g}" if ok else
                    f"disagrees: the analysis says protected, but the attack reached median MSE {median_mse:.3g} "
                    f"(<= {CONFIRM_PROTECTED_ABOVE:g})")
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


def verify_inputs(result: Result, spec: str, *, samples: int = 4, seed: int = 0, device: str = "auto",
                  data: str | None = None, steps: int = 1000, restarts: int = 2, artifacts: str | None = None,
                  show_progress: bool = True) -> dict:
    """Run R-GAP (or, where it cannot go, inverting gradients) on real images; fill result.verification['rgap']."""
    from rankaudit.verify import data as image_data, invert, rgap

    device = resolve_device(device)
    model, weights = build_real_model(spec, result.input_shape, seed)
    if len(result.input_shape) != 3:
        raise UsageError(f"--verify rgap attacks images; this model's input shape is {result.input_shape}",
                         "verify a model whose input is C,H,W")
    try:
        images, source = image_data.load_images(data, tuple(result.input_shape), samples, seed)
    except image_data.DataError as exc:
        raise UsageError(str(exc)) from exc
    images = images.to(torch.float64)
    loss = _loss_for(model, images)
    notes = [f"weights: {weights}", f"images: {source}"]
    try:
        rgap.extract_chain(model, tuple(result.input_shape))
    except rgap.RGapUnsupported as stop:
        notes.append(f"R-GAP stops at {stop.layer}: {stop.reason}. Checked with the inverting-gradients "
                     "optimisation attack (Geiping et al. 2020) instead, as R-GAP's authors did for ResNets.")
        # One line for both: the label names the image, the count is the optimisation step.
        with ProgressBar(steps, f"inverting gradients, image 1/{samples}", enabled=show_progress) as bar:
            def next_image(done: int, total: int):
                bar.label = f"inverting gradients, image {min(done + 1, total)}/{total}"

            outcome = invert.run_inverting(model, images, loss=loss, steps=steps, restarts=restarts, device=device,
                                           seed=seed, progress=next_image, step_progress=bar)
        attack, reconstructions, layers = "inverting-gradients", outcome.x_hat, []
        notes.append(f"optimisation budget: {steps} steps x {restarts} restarts")
    else:
        with ProgressBar(samples, "R-GAP", enabled=show_progress) as per_sample:
            outcome = rgap.run_rgap(model, images, device=device, seed=seed, loss=loss, progress=per_sample)
        attack, reconstructions = "rgap", outcome.reconstructions
        notes.extend(outcome.notes)
        layers = [{"name": s.name, "unknowns": s.unknowns, "rank": s.rank, "local_deficit": s.local_deficit,
                   "residual": _finite(s.residual), "condition": _finite(s.condition)} for s in outcome.layers]
    saved = _save_images(Path(artifacts), images, reconstructions) if artifacts else [(None, None)] * len(images)
    confirms, judgement = _confirms(result.verdict, outcome.median_mse)
    if attack == "inverting-gradients" and not confirms and result.verdict == "exposed":
        judgement += ("; an optimisation attack is not exact, so missing the threshold within its budget "
                      f"({steps} steps) does not show the input is safe")
    deficient = [layer for layer in layers if layer["local_deficit"] > 0]
    if deficient:
        # Spec §7: counts cannot see dependent constraints; the numerical rank can, and explains a disagreement.
        judgement += "; numerically deficient: " + ", ".join(
            f"{layer['name']} rank {layer['rank']} of {layer['unknowns']} unknowns (deficit {layer['local_deficit']})"
            for layer in deficient)
    verification = {
        "attack": attack, "device": outcome.device, "weights": weights, "images": source, "loss": loss,
        "median_mse": outcome.median_mse, "median_psnr": _finite(outcome.median_psnr),
        "seconds": round(sum(outcome.seconds), 3), "confirms": confirms, "judgement": judgement,
        "note": " ".join(notes),
        "notes": notes,
        "samples": [{"index": i, "mse": outcome.mse[i], "psnr": _finite(outcome.psnr[i]),
                     "seconds": round(outcome.seconds[i], 3), "original_png": saved[i][0],
                     "reconstruction_png": saved[i][1]} for i in range(len(images))],
        "layers": layers,
    }
    result.verification["rgap"] = verification
    return verification


def _gdbr_layer(result: Result) -> str:
    """The shared layer GDBR reads: the shared, bridging layer nearest the logits (the paper's default)."""
    leakage = result.label_leakage
    candidates = [b for b in leakage.layers if b.shared and b.bridge and not b.direct] if leakage else []
    if not candidates:
        direct = [b.name for b in leakage.layers if b.shared and b.direct] if leakage else []
        raise UsageError("no shared hidden layer's gradient bridges to the logits, so GDBR has nothing to read"
                         + (f" (the logits layer {direct[0]} is shared: its gradient gives the labels directly)"
                            if direct else ""),
                         "share a hidden layer (--shared-layers) or skip --verify gdbr")
    return candidates[-1].name


def _aux_images(aux: str | None, input_shape: tuple[int, ...], seed: int) -> tuple[torch.Tensor | None, str]:
    """The attacker's stand-in inputs for estimating activations and probabilities (GDBR §V-D3)."""
    from rankaudit.verify import data as image_data, gdbr

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


def verify_labels(result: Result, spec: str, *, trials: int = 5, class_dist: str = "random", aux: str | None = None,
                  device: str = "auto", seed: int = 0, show_progress: bool = True) -> dict:
    """Run GDBR on real labelled digits from one shared layer's gradient; fill result.verification['gdbr']."""
    from rankaudit.verify import gdbr

    device = resolve_device(device)
    layer = _gdbr_layer(result)
    if len(result.input_shape) != 3:
        raise UsageError(f"--verify gdbr feeds images; this model's input shape is {result.input_shape}",
                         "verify a model whose input is C,H,W")
    torch.manual_seed(seed)
    model = load_model(spec, result.input_shape, device="cpu").module.eval()
    names = [name for name, _ in model.named_modules()]
    bottom = names[names.index(layer):] if layer in names else [layer]
    bottom = [name for name in bottom if isinstance(model.get_submodule(name), (nn.Linear, nn.Conv2d))]
    gdbr.init_like_paper(model, bottom, seed=seed)
    aux_images, aux_source = _aux_images(aux, tuple(result.input_shape), seed)
    try:
        with ProgressBar(trials, "GDBR", enabled=show_progress) as per_trial:
            outcome = gdbr.run_gdbr(model, layer, result.batch_size, trials=trials, class_dist=class_dist,
                                    aux=aux_images, device=device, seed=seed, progress=per_trial,
                                    input_shape=tuple(result.input_shape))
    except gdbr.GDBRUnsupported as exc:
        raise ModelLoadError(f"GDBR cannot read {layer}: {exc.reason} (at {exc.layer})",
                             "share another hidden layer with --shared-layers") from exc
    verification = {
        "shared_layer": layer, "batch_size": result.batch_size, "ins_acc": outcome.ins_acc,
        "cls_acc": outcome.cls_acc, "trials": outcome.trials, "seconds": round(outcome.seconds, 3),
        "recovered": {str(k): v for k, v in sorted(outcome.recovered.items())},
        "true": {str(k): v for k, v in sorted(outcome.true.items())},
        "class_dist": class_dist, "features_from": aux_source, "estimator": outcome.estimator,
        "device": outcome.device,
        "weights": f"random; {', '.join(bottom)} initialised uniform on [0.01, 0.2] as in GDBR (bias 0)",
        "per_trial_ins_acc": [round(t["ins_acc"], 4) for t in outcome.per_trial],
    }
    result.verification["gdbr"] = verification
    return verification
