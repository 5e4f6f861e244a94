"""--verify dp: the informed, prior-aware reconstruction attack on DP noise (method.md: DP), measured against B(1/M)."""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.result import Result
from rankaudit.settings.round import DPSettings, Round

DEFAULT_CANDIDATES = 10
DEFAULT_TRIALS = 1000
# Other clients whose updates the attacker knows at the client level (the sample level knows the rest of the batch).
KNOWN_CLIENTS = 3
# Up to this many noise values (trials x steps x gradient size) the update is drawn in full, as DP-SGD draws it;
# beyond it, the noise's projection onto the candidates' span (exactly the same law for every likelihood the attack
# computes, which reads the update only through its inner products with the candidates).
FULL_DRAW_LIMIT = 2**28
CHUNK_ELEMENTS = 2**23  # noise values drawn at once in the full draw
GRADIENT_CHUNK = 32  # units per vmap call of the per-unit gradients
CONFIDENCE = 0.95
# Client level: the samples of all simulated clients (candidates and known ones) drawn at most.
MAX_CLIENT_SAMPLES = 4096


@dataclass
class AttackOutcome:
    successes: int
    trials: int
    draw: str  # full | span
    seconds: float
    device: str


def clopper_pearson(successes: int, trials: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The exact binomial interval (scipy's beta quantiles; scipy comes with the [dp] extra's dp-accounting)."""
    from scipy.stats import beta

    alpha = 1.0 - confidence
    low = 0.0 if successes == 0 else float(beta.ppf(alpha / 2, successes, trials - successes + 1))
    high = 1.0 if successes == trials else float(beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return low, high


def unit_gradients(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    loss: str,
    clip: float,
    device: str,
    sent: list[str] | None = None,
) -> torch.Tensor:
    """Each unit's flattened gradient clipped to norm `clip` (g · min(1, c/‖g‖)), as DP-SGD clips it, returned in
    units of c (clip_in_units): the whole trainable gradient is clipped (DP-SGD clips every parameter it trains),
    then only the `sent` parameters' entries are kept (default all), the part of it the server reads.

    inputs: U x B x ...: a unit is B samples (B = 1: a sample, DP-SGD; B > 1: a client's batch, DP-FedAvg), its
    gradient the mean loss's. torch.func's grad under vmap computes all units at once, GRADIENT_CHUNK at a time.
    """
    from torch.func import functional_call, grad, vmap

    from rankaudit.verify.client import mean_loss

    net = model.to(device)
    params = {name: p.detach() for name, p in net.named_parameters() if p.requires_grad}
    if not params:
        raise UsageError(
            "the model has no trainable parameters, so it sends no gradient to clip and noise",
            "make some parameters trainable (requires_grad) or drop --verify dp",
        )
    buffers = {name: b.detach() for name, b in net.named_buffers()}

    def unit_loss(values, x, y):
        return mean_loss(functional_call(net, (values, buffers), (x,)), y, loss)

    per_unit = vmap(grad(unit_loss), in_dims=(None, 0, 0))
    flat = []
    for start in range(0, len(inputs), GRADIENT_CHUNK):
        x = inputs[start : start + GRADIENT_CHUNK].to(device)
        y = labels[start : start + GRADIENT_CHUNK].to(device)
        grads = per_unit(params, x, y)
        flat.append(torch.cat([g.reshape(len(x), -1) for g in grads.values()], dim=1))
    gradients = torch.cat(flat)
    if not torch.isfinite(gradients).all():
        raise UsageError(
            "a per-sample gradient is not finite (NaN or infinite)",
            "check the model's forward pass on real inputs (a log of zero, a division by zero)",
        )
    clipped = clip_in_units(gradients, clip)
    if sent is None:
        return clipped
    kept = set(sent)
    columns = torch.cat([torch.full((p.numel(),), name in kept, dtype=torch.bool) for name, p in params.items()]).to(
        clipped.device
    )
    return clipped[:, columns]


def clip_in_units(gradients: torch.Tensor, clip: float) -> torch.Tensor:
    """g · min(1, c/‖g‖) / c: the clipped gradients in units of c (norm <= 1), so that no clip norm, 1e-30 or 1e30,
    under- or overflows; the attack, whose likelihoods read only ⟨y, g⟩/(σc)², is the same in these
    units with c = 1. The ratio is taken in float64; a zero gradient stays zero."""
    norms = gradients.double().norm(dim=1, keepdim=True)
    scale = torch.where(
        norms > 0, torch.minimum(1.0 / norms, torch.full_like(norms, 1.0 / clip)), torch.zeros_like(norms)
    )
    return (gradients.double() * scale).to(gradients.dtype)


def client_updates(
    model: nn.Module,
    round_: Round,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    loss: str,
    clip: float,
    device: str,
    sent: list[str] | None = None,
) -> torch.Tensor:
    """Each client's round update u = θ_K − θ₀, simulated by rankaudit.verify.client's local training (N samples,
    batch B, E epochs, the round's optimizer, from the server's weights θ₀), of the `sent` parameters (default every
    trainable one; the others are trained and kept), flattened and clipped to norm `clip` as DP-FedAvg clips the
    update a client sends, in units of `clip` (clip_in_units). inputs: U x N x ..., labels: U x N."""
    from torch.func import vmap

    from rankaudit.verify.client import LocalTraining

    net = model.to(device)
    shared = [name for name, p in net.named_parameters() if p.requires_grad and (sent is None or name in sent)]
    if not shared:
        raise UsageError(
            "the model has no trainable parameters, so a client sends no update to clip and noise",
            "make some parameters trainable (requires_grad) or drop --verify dp",
        )
    training = LocalTraining(net, round_, loss, shared)
    per_client = vmap(training.client_update)
    with torch.no_grad():
        updates = torch.cat(
            [
                per_client(
                    inputs[start : start + GRADIENT_CHUNK].to(device), labels[start : start + GRADIENT_CHUNK].to(device)
                )
                for start in range(0, len(inputs), GRADIENT_CHUNK)
            ]
        )
    if not torch.isfinite(updates).all():
        raise UsageError(
            "a simulated client update is not finite (the local training diverged)", "lower --lr or --local-epochs"
        )
    return clip_in_units(updates, clip)


def separation_note(gradients: torch.Tensor, clip: float) -> str:
    """How far the candidates are from the worst case (norm c, mutually orthogonal) in which the attack meets B."""
    norms = gradients.norm(dim=1)
    unit = gradients / norms.clamp(min=torch.finfo(gradients.dtype).tiny)[:, None]
    cosines = (unit @ unit.T).fill_diagonal_(float("nan"))
    return (
        f"candidates' clipped gradient norms: median {float(norms.median()) / clip:.3g} of c; largest pairwise "
        f"cosine {float(cosines.nan_to_num(-1.0).max()):.3g} (the attack meets the bound at norm c and "
        "orthogonal gradients; smaller or aligned ones leave it below)"
    )


def informed_attack(
    candidates: torch.Tensor,
    known: torch.Tensor | None,
    *,
    noise_multiplier: float,
    clip: float,
    sample_rate: float,
    steps: int,
    trials: int,
    seed: int = 0,
    full_draw_limit: int = FULL_DRAW_LIMIT,
) -> AttackOutcome:
    """The DP section's attack: per trial a target among the M candidates (uniform, so κ = 1/M), T steps of DP-SGD.

    Each step every unit takes part with probability q (Poisson sampling), the update is the sum of the clipped
    gradients that took part plus N(0, σ²c² I). The informed attacker knows the other units and which of them took
    part, subtracts their sum, and picks the candidate j maximising Σ_t log((1 - q) + q·exp((⟨y_t, g_j⟩ - ‖g_j‖²/2)
    / (σc)²)), the likelihood ratio of the mixture "sampled with probability q" against "not sampled": the
    Bayes-optimal guess under the uniform prior. Runs on the candidates' device.
    """
    start = time.perf_counter()
    device = candidates.device
    count, size = candidates.shape
    scale = noise_multiplier * clip
    generator = torch.Generator(device=device).manual_seed(seed)
    gram = candidates @ candidates.T
    half_norms = gram.diagonal() / 2
    draw = "full" if trials * steps * size <= full_draw_limit else "span"
    if draw == "span":
        # ⟨n, g_j⟩ for n ~ N(0, s² I) is N(0, s² G): G = V Λ Vᵀ, so s · z (V Λ^½)ᵀ has that law (G may be singular).
        eigenvalues, eigenvectors = torch.linalg.eigh(gram)
        root = eigenvectors * eigenvalues.clamp(min=0).sqrt()
    per_chunk = max(1, CHUNK_ELEMENTS // (steps * (size if draw == "full" else count)))
    successes = 0
    for first in range(0, trials, per_chunk):
        n = min(per_chunk, trials - first)
        targets = torch.randint(count, (n,), generator=generator, device=device)
        sampled = (
            torch.rand((n, steps, 1), generator=generator, device=device, dtype=candidates.dtype) < sample_rate
        ).to(candidates.dtype)
        if draw == "full":
            noise = torch.randn((n, steps, size), generator=generator, device=device, dtype=candidates.dtype) * scale
            update = sampled * candidates[targets][:, None, :] + noise
            if known is not None and len(known):
                took_part = (
                    torch.rand((n, steps, len(known)), generator=generator, device=device, dtype=candidates.dtype)
                    < sample_rate
                ).to(candidates.dtype)
                others = took_part @ known
                update = (update + others) - others  # what the server receives, less what the attacker knows
            scores = update @ candidates.T
        else:
            projected = torch.randn((n, steps, count), generator=generator, device=device, dtype=candidates.dtype)
            scores = sampled * gram[targets][:, None, :] + scale * projected @ root.T
        log_ratio = (scores - half_norms) / scale**2
        if sample_rate < 1:
            log_ratio = torch.logaddexp(
                torch.full_like(log_ratio, math.log1p(-sample_rate)), math.log(sample_rate) + log_ratio
            )
        guesses = log_ratio.sum(dim=1).argmax(dim=1)
        successes += int((guesses == targets).sum())
    return AttackOutcome(successes, trials, draw, time.perf_counter() - start, str(device))


# What --verify dp may take before it is refused up front. The attack's arithmetic: about 10 operations per
# (trial, step, candidate) (a score, the mixture's log-likelihood ratio, the sum and the argmax), about 1e9 a second
# on a CPU core, so the ceiling is about a minute. The units: each is an image drawn and a per-unit gradient held.
ATTACK_OPERATIONS_PER_SCORE = 10
MAX_ATTACK_OPERATIONS = 5 * 10**10
MAX_UNITS = 100_000
MAX_GRADIENT_VALUES = 2 * 10**9


def check_attack_size(result: Result, settings: DPSettings, candidates: int, trials: int) -> None:
    """Refuse, before any work, an attack that cannot finish: the estimate and the flag to change."""
    operations = ATTACK_OPERATIONS_PER_SCORE * trials * settings.steps * candidates
    if operations > MAX_ATTACK_OPERATIONS:
        raise UsageError(
            f"--verify dp would score {trials:,} trials x {settings.steps:,} steps x {candidates:,} candidates, about "
            f"{operations:.2g} operations ({operations / 1e9 / 60:.2g} CPU-minutes); the most it runs is "
            f"{MAX_ATTACK_OPERATIONS:.0e}",
            "lower --samples (the trials), --dp-candidates or --dp-steps",
        )
    per_unit = 1 if settings.level == "sample" else result.batch_size
    units = candidates + (result.batch_size - 1 if settings.level == "sample" else KNOWN_CLIENTS)
    values = units * max(result.parameters, 1)
    if units * per_unit > MAX_UNITS or values > MAX_GRADIENT_VALUES:
        raise UsageError(
            f"--verify dp would draw {units * per_unit:,} inputs and hold {units:,} per-unit gradients of "
            f"{result.parameters:,} values ({8 * values / 2**30:.3g} GiB in float64); the most it takes is "
            f"{MAX_UNITS:,} inputs and {MAX_GRADIENT_VALUES:.0e} values",
            "lower --dp-candidates (default 10)",
        )


def verify_dp(
    result: Result,
    spec: str,
    settings: DPSettings,
    *,
    candidates: int = DEFAULT_CANDIDATES,
    trials: int = DEFAULT_TRIALS,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
) -> dict:
    """Run the attack on the model's real clipped gradients, the part the server reads (`shared_layers` or
    `withheld_layers`, as the bound takes them); fill result.verification['dp'] beside B(1/M)."""
    from rankaudit.bound import dp
    from rankaudit.settings import dp_options
    from rankaudit.verify.client import draw_labels, logits_of, loss_name_for
    from rankaudit.verify.inputs import real_inputs
    from rankaudit.verify.model import build_real_model, resolve_device
    from rankaudit.verify.rank.jacobian import shared_parameter_names

    dp_options.validate(settings)
    if candidates < 2:
        raise UsageError(f"the attack needs at least 2 candidates, got {candidates}", "use 2 or more (default 10)")
    if trials < 1:
        raise UsageError(f"--samples {trials}: the attack needs at least one trial", "pass --samples >= 1, e.g. 1000")
    check_attack_size(result, settings, candidates, trials)
    if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
        raise UsageError(
            "--verify dp draws real images as candidates; this model reads token ids or several inputs",
            "use --verify dp on models with a single float input",
        )
    device = resolve_device(device)
    round_ = result.round or Round(batch_size=result.batch_size)
    client = settings.level == "client"
    # Sample level: a unit is one sample, the rest of its batch known. Client level: a unit is a client's whole
    # local dataset (N samples) and its contribution the update of the round's local training; the other clients
    # the server samples from are known (an informed attacker subtracts them, so a few stand for all of them).
    per_unit = round_.samples if client else 1
    known_units = min(round_.population - 1, KNOWN_CLIENTS) if client else result.batch_size - 1
    units = candidates + known_units
    if client and units * per_unit > MAX_CLIENT_SAMPLES:
        raise UsageError(
            f"--verify dp at the client level simulates {units} clients' local training over N = "
            f"{per_unit:,} samples each ({units * per_unit:,} samples), above the "
            f"{MAX_CLIENT_SAMPLES:,} it draws",
            "check the mechanism on a smaller round (a smaller "
            "--local-samples; the bound B(κ) does not depend on N) or fewer --dp-candidates",
        )
    model, weights = build_real_model(spec, result.input_shape, seed)
    partial = bool(shared_layers or withheld_layers)
    sent = shared_parameter_names(model, shared_layers, withheld_layers) if partial else None
    if partial and not sent:
        raise UsageError(
            "--verify dp attacks what the client sends, and the shared or withheld layers leave no trainable "
            "parameter sent",
            "name layers that are sent in --shared-layers, or fewer in --withheld-layers",
        )
    inputs, source = real_inputs(result, data, units * per_unit, seed)
    with torch.no_grad():
        logits = logits_of(model(inputs[:1])).numel()
    loss = loss_name_for(logits)
    labels = draw_labels(len(inputs), loss, logits, seed)
    shape = tuple(inputs.shape[1:])
    # A client's unit is its round's local training; a sample's, one gradient.
    contributions = (
        functools.partial(client_updates, model, round_) if client else functools.partial(unit_gradients, model)
    )
    gradients = contributions(
        inputs.reshape(units, per_unit, *shape), labels.reshape(units, per_unit), loss, settings.clip, device, sent
    )
    outcome = informed_attack(
        gradients[:candidates],
        gradients[candidates:],
        noise_multiplier=settings.noise_multiplier,
        clip=1.0,  # gradients in units of c
        sample_rate=settings.sample_rate,
        steps=settings.steps,
        trials=trials,
        seed=seed,
    )
    rate = outcome.successes / outcome.trials
    low, high = clopper_pearson(outcome.successes, outcome.trials)
    bound = dp.bound_at(settings.noise_multiplier, settings.sample_rate, settings.steps, 1.0 / candidates)
    internal_error = None
    if low > bound:
        internal_error = (
            f"internal error: the attack's success rate {rate:.3f} (95 % interval [{low:.3f}, "
            f"{high:.3f}]) lies above the certified bound B(1/{candidates}) = {bound:.3f}: the bound or "
            "the simulated mechanism is wrong"
        )
    from rankaudit.settings.levels import count
    from rankaudit.settings.round import describe

    if client:
        unit = (
            f"client's whole round: its update θ_K − θ₀ from simulated local training ({describe(round_)}), "
            f"clipped to c"
        )
        others = (
            f"{count(known_units, 'other client')} of the {round_.population - 1:,} the server samples from, "
            "each taking part with probability q, known to the attacker and subtracted (as many more would "
            "change nothing)"
            if known_units
            else "no other client"
        )
        rounds = (
            "the same server weights θ₀ in each of the T rounds (the bound holds for any weights; the attack "
            "sees the same update each round)"
        )
    else:
        unit = "sample"
        others = f"{count(known_units, 'other sample')} of its batch known to the attacker"
        rounds = "the same weights in each of the T steps"
    clipped = "the whole trainable gradient clipped" if not client else "the update of these clipped"
    sent_note = "" if sent is None else f"; only the {len(sent):,} parameters sent are attacked ({clipped})"
    verification = {
        "candidates": candidates,
        "trials": outcome.trials,
        "successes": outcome.successes,
        "success_rate": rate,
        "interval": [low, high],
        "confidence": CONFIDENCE,
        "bound": bound,
        "prior": 1.0 / candidates,
        "seconds": round(outcome.seconds, 3),
        "device": outcome.device,
        "draw": outcome.draw,
        "level": settings.level,
        "noise_multiplier": settings.noise_multiplier,
        "clip": settings.clip,
        "sample_rate": settings.sample_rate,
        "steps": settings.steps,
        "below_bound": high <= bound,
        "shared_parameters": sent,  # None: every trainable parameter is sent
        "internal_error": internal_error,
        "notes": [
            f"weights: {weights}",
            f"inputs: {source}",
            f"loss: {loss}, labels drawn with seed {seed}",
            f"unit: a {unit}; {others}",
            rounds,
            f"{'update' if client else 'gradient'} size {gradients.shape[1]:,}; clipped to {settings.clip:g} "
            "(computed in units of it)" + sent_note,
            separation_note(gradients[:candidates], 1.0),
            "noise drawn in full"
            if outcome.draw == "full"
            else "noise drawn in the candidates' span (the same law for every likelihood the attack reads)",
        ],
    }
    result.verification["dp"] = verification
    return verification
