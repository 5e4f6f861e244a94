"""--verify fisher: each sample's Fisher information under the client's DP noise, beside the bound B(κ)."""

from __future__ import annotations

import time

from rankaudit.errors import UsageError
from rankaudit.verify.progress import ProgressBar
from rankaudit.verify.registry import Need, Verifier, VerifyContext


def check_settings(dp, what: str = "--verify fisher") -> None:
    """One-line refusals: no noise, noise the server adds, or client-level DP (whose unit is a client's update)."""
    if dp is None:
        raise UsageError(
            f"{what} reads what the DP noise leaves of each sample, but no noise multiplier is given",
            "add --dp-noise σ and --dp-clip C as trained (or noise and clip in [tool.rankaudit.dp])",
        )
    if dp.noise_by != "client":
        raise UsageError(
            f"{what}: noise the server adds after aggregation hides nothing from the server itself",
            "measure the noise the client adds (--noise-by client)",
        )
    if dp.level != "sample":
        raise UsageError(
            f"{what} measures DP-SGD's per-sample noise; at --dp-level client the noised unit is a client's update",
            "use --dp-level sample, or --verify dp for client-level DP",
        )


def run(context: VerifyContext) -> dict:
    """The Fisher line of the first --samples samples at the DP settings the round carries."""
    import torch

    from rankaudit.bound import fisher as fisher_bound
    from rankaudit.verify.client import draw_labels, logits_of, loss_name_for
    from rankaudit.verify.fisher import TARGET_RELATIVE_SE, measure_samples
    from rankaudit.verify.inputs import real_inputs
    from rankaudit.verify.model import build_real_model, require_trainable, resolve_device, weights_phrase
    from rankaudit.verify.rank.jacobian import shared_parameter_names

    dp = context.dp
    check_settings(dp)
    result = context.result
    if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
        raise UsageError(
            "--verify fisher differentiates each sample's gradient with respect to one real-valued input, and this "
            "model takes several or token ids",
            "verify a model with a single float input",
        )
    started = time.perf_counter()
    device = resolve_device(context.device)
    model, weights = build_real_model(context.spec, result.input_shape, context.seed)
    require_trainable(model, "--verify fisher")
    shared = shared_parameter_names(model, context.shared_layers, context.withheld_layers)
    images, source = real_inputs(result, context.data, context.samples, context.seed)
    with torch.no_grad():
        classes = logits_of(model(images[:1])).numel()
    loss = loss_name_for(classes)
    labels = draw_labels(len(images), loss, classes, context.seed)
    with ProgressBar(len(images), "Fisher information", enabled=context.show_progress) as bar:
        measured = measure_samples(
            model,
            images,
            labels,
            clip=dp.clip,
            loss=loss,
            shared=shared,
            device=device,
            seed=context.seed,
            progress=bar,
        )
    dimension = images[0].numel()
    line = fisher_bound.read_samples(
        measured,
        dimension=dimension,
        noise_multiplier=dp.noise_multiplier,
        sample_rate=dp.sample_rate,
        steps=dp.steps,
        psnr_target=context.psnr_target,
    )
    probes = [one["probes"] for one in measured]
    exact = sum(one["exact"] for one in measured)
    notes = [
        f"weights: {weights}",
        f"inputs: {source}",
        f"loss: {loss}, labels drawn with seed {context.seed}",
        f"the sample takes part in at most q·T = {dp.sample_rate:.4g} × {dp.steps:,} = "
        f"{line['participations']:.4g} steps' worth of information, each step read at these weights",
        "BatchNorm reads its running statistics (DP-SGD's per-sample gradients share no batch statistics)",
    ]
    worst_se = max(one["relative_se"] for one in measured)
    if worst_se > TARGET_RELATIVE_SE:
        notes.append(
            f"the estimate's relative standard error reached {worst_se:.1%} after {max(probes):,} probes "
            f"(the most drawn), above the {TARGET_RELATIVE_SE:.0%} asked"
        )
    estimator = (
        f"Hutchinson, {min(probes):,}-{max(probes):,} Rademacher probes per sample (relative standard error at "
        f"most {TARGET_RELATIVE_SE:.0%})"
    )
    if exact:
        estimator += f"; exact ‖J‖_F² from d = {dimension} products for {exact} sample(s), the estimate its check"
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


VERIFIER = Verifier(
    name="fisher",
    help="each sample's Fisher information under the DP noise of --dp-noise/--dp-clip: the MSE floor and PSNR "
    "ceiling of any unbiased reconstruction, at these weights (needs the [verify] extra).",
    needs=frozenset({Need.IMAGES, Need.ROUND, Need.GPU, Need.TRAINABLE}),
    run=run,
    order=40,
    preflight=lambda context: check_settings(context.dp),
)
