"""The design review: suggest() runs the edits and searches on the traced model, ranks them in a SuggestReport."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rankaudit.bound.energy import EnergyScale, ReferenceDataError, certify
from rankaudit.bound.identifiability import identifiability, sample_identifiability
from rankaudit.count.analysis import analyze
from rankaudit.count.calls import trace_and_count
from rankaudit.design.edits import cut_skips, narrow_edits, remove_bias_edits, stride_edits
from rankaudit.design.round_review import RoundReview, round_review
from rankaudit.design.searches import certifying_withheld, smallest_certified_batch, smallest_protected_batch
from rankaudit.errors import UsageError
from rankaudit.findings.leakage import readout_layers, token_leakage
from rankaudit.model.load import load_model
from rankaudit.result import DPNoiseSuggestion, SampleBound
from rankaudit.settings.levels import DEFAULT_CERTIFICATE_QUANTILE, DEFAULT_MAX_RECOVERABLE
from rankaudit.settings.levels import ceiling as level_ceiling
from rankaudit.settings.round import DPSettings, Round

if TYPE_CHECKING:
    from rankaudit.design.fisher_review import FisherReview

EDITS = ("cut-skip", "narrow", "stride", "remove-bias")  # batch sizes protect no sample (method.md: each sample)
ACCURACY_NOTE = (
    "Accuracy is not measured: each edit changes what the model can learn, so retrain and compare "
    "before adopting one (R-GAP's Figure 4 found cutting block 3's skip cost no accuracy on CIFAR-10)."
)


@dataclass
class Suggestion:
    edit: str  # one of EDITS
    target: str  # the block's or layer's qualified name (layer2.0), or "batch"
    detail: str  # what exactly changes, e.g. "out_channels 16 -> 5"
    ra_i: int | None
    critical_layer: str | None
    verdict: str  # the per-sample verdict level of the edited model, on energy as `check` reads it (method.md: each sample, energy)
    delta_params: int
    crosses_verdict: bool  # the verdict differs from the unedited model's
    rank_bound: int = 0  # R_s of the edited model: each sample's bound (method.md: each sample)
    certified_deficit: int = 0  # |x| - R_s: directions of each sample certified hidden
    recoverable_fraction: float = 1.0  # R_s/|x| of the edited model: the edits are ranked by it


@dataclass
class SuggestReport:
    model: str
    input_shape: tuple[int, ...]
    batch_size: int
    ra_i: int | None
    critical_layer: str | None
    verdict: str  # the per-sample verdict on energy (method.md: each sample, energy), as `check` prints it: what the edits aim at
    suggestions: list[Suggestion]
    skipped: list[str] = field(default_factory=list)  # edits that could not be applied, and why
    # The batch as a whole (method.md: the bound, verdicts) at batch_size: R of n = B·|x|; a statement about all samples at once.
    unknowns: int = 0
    rank_bound: int = 0
    certified_deficit: int = 0
    certifying_batch: int | None = None  # smallest batch size with a certified deficit of the whole batch
    protecting_batch: int | None = None  # smallest batch size whose whole batch is protected (None: none is)
    max_recoverable: float = DEFAULT_MAX_RECOVERABLE  # protected asks that 1 - this of the energy stays hidden
    recoverable_fraction: float = 1.0  # R/n of the model as it is (the whole batch)
    # Layers whose gradients, kept back, make each sample protected (method.md: each sample); [] none needed; None: no set does
    certifying_withheld: list[str] | None = None
    # Where no set of layers reaches protected (norms and other directly used parameters still send enough):
    # layers whose gradients, kept back, give at least a certified deficit (partial).
    deficit_withheld: list[str] | None = None
    # Language models: DAGER's span test on the layers reading per-token vectors (all gradients shared).
    token_span_exposed: list[str] = field(default_factory=list)  # layers whose gradient passes it at this B·n
    tokens_per_batch: int | None = None  # B·n now
    safe_tokens_per_batch: int | None = None  # the smallest B·n at which it fails on every layer
    safe_token_batch: int | None = None  # the smallest batch size reaching it at this length
    note: str = ACCURACY_NOTE
    seconds: float = 0.0
    round_review: RoundReview | None = None  # with a round: the N, E and C that make it protected
    noise: DPNoiseSuggestion | None = None  # with DP options: the least noise meeting --max-reconstruction
    # With DP options: the least σ keeping the PSNR ceiling of unbiased reconstructions at or below --psnr-target,
    # for the model as it is and each edit (rankaudit.design.fisher_review.FisherReview)
    fisher: FisherReview | None = None
    sample: SampleBound | None = None  # each sample's bound as the model is (method.md: each sample)
    readout_layers: list[str] = field(default_factory=list)  # layers with a bias readout (method.md: each sample)
    # No single edit, withheld set or round setting makes each sample protected: only noise the client adds can
    # bound what the server reconstructs of a sample.
    noise_is_the_way: bool = False
    spectrum: str = ""  # the reference distribution the levels are read on (method.md: energy); "" for token inputs
    exposed_below: float | None = None  # the hidden share under which a sample is exposed
    certificate_quantile: float = DEFAULT_CERTIFICATE_QUANTILE  # the share of samples the certificate speaks for
    round_dp: DPSettings | None = None  # the round's own DP (an app's DP-SGD or DP-FedAvg), kept as it is read
    check_command: str = ""  # the `check` line that judges the same model on the same round ("": check MODEL)
    # What the client sends, as `check` reads it: the shared or withheld layers (an app's withheld set); None: all.
    shared_layers: list[str] | None = None
    withheld_layers: list[str] | None = None


def suggest(
    spec: str,
    *,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int = 1,
    max_recoverable: float | None = None,
    round_: Round | None = None,
    data: str | None = None,
    exposed_below: float | None = None,
    certificate_quantile: float | None = None,
    model_args: dict | None = None,
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
) -> SuggestReport:
    """Every single edit of EDITS that applies to the model, re-counted and ranked by the per-sample recoverable
    fraction R_s/|x| it reaches (method.md: each sample; the verdict level follows it, method.md: verdicts), then by the RA-i; with a round,
    also the N, E and C at which each sample is protected. The batch sizes at which the batch as a whole is
    certified or protected are reported beside them: no batch size protects any one sample.

    Every level is read on energy, as `check` reads it (method.md: energy): the reference is `data` (--data), else the
    shipped photograph spectrum for C×H×W inputs, else none (nothing certified); `exposed_below` and
    `certificate_quantile` as check's flags; `model_args` the arguments the model is built with (an app's);
    `shared_layers` or `withheld_layers` what the client sends (an app's withheld set): every bound judges it."""
    sent = {"shared_layers": shared_layers, "withheld_layers": withheld_layers}
    ceiling = level_ceiling(max_recoverable)
    started = time.perf_counter()
    loaded = load_model(spec, input_shape, device="meta", model_args=model_args)
    traced = trace_and_count(
        loaded.module, loaded.input_shape, input_dtype=loaded.input_dtype, forward_kwargs=loaded.forward_kwargs
    )
    base = analyze(traced, batch_size)
    base_bound = identifiability(traced, batch_size, max_recoverable=ceiling, **sent)
    judged_round = round_ or Round(batch_size=batch_size)
    base_sample = sample_identifiability(traced, judged_round, max_recoverable=ceiling, **sent)
    try:
        energy = EnergyScale.of(traced.inputs, base_sample.unknowns, data, ceiling, exposed_below, certificate_quantile)
        base_bound.sample = base_sample
        reference = certify(
            base_bound, traced.inputs, data, exposed_below, certificate_quantile
        )  # the levels `check` prints
    except ReferenceDataError as exc:
        raise UsageError(str(exc), "give a readable --data, or leave it out to use the shipped reference") from exc
    readouts = {name for _, name, _, _ in readout_layers(traced)}
    skipped: list[str] = []
    suggestions = []

    def add(edit, target, detail, edited, delta):
        result = analyze(edited, batch_size)
        sample = sample_identifiability(edited, judged_round, max_recoverable=ceiling, **sent)
        sample.level = energy.level(sample.rank_bound)  # the input, hence the reference, is the unedited one's
        suggestions.append(
            Suggestion(
                edit,
                target,
                detail,
                result.ra_i,
                result.critical_layer,
                sample.level,
                delta,
                sample.level != base_sample.level,
                sample.rank_bound,
                sample.unknowns - sample.rank_bound,
                sample.recoverable_fraction,
            )
        )

    for target, detail, edited, delta in cut_skips(traced, base):
        add("cut-skip", target, detail, edited, delta)
    for target, detail, edited, delta in narrow_edits(traced, base, skipped):
        add("narrow", target, detail, edited, delta)
    for target, detail, edited, delta in stride_edits(loaded.module, loaded.input_shape, skipped):
        add("stride", target, detail, edited, delta)
    for target, detail, edited, delta in remove_bias_edits(traced):
        if target.split("#")[0] in readouts:
            detail += "; stops the exact bias readout of a sample, though the weight rows still point along it"
        add("remove-bias", target, detail, edited, delta)
    certifying_batch = smallest_certified_batch(traced, batch_size, base_bound, sent)
    protecting_batch = smallest_protected_batch(traced, batch_size, base_bound, ceiling, energy, sent)
    suggestions.sort(key=lambda s: (s.recoverable_fraction, s.ra_i is None, -(s.ra_i if s.ra_i is not None else 0)))
    protecting = certifying_withheld(
        traced, batch_size, max_recoverable=ceiling, round_=round_, energy=energy, sent=sent
    )
    deficit_only = (
        None
        if protecting is not None
        else certifying_withheld(
            traced, batch_size, max_recoverable=ceiling, aim="partial", round_=round_, energy=energy, sent=sent
        )
    )
    review = round_review(traced, round_, ceiling, energy, sent) if round_ is not None else None
    structural = (
        base_sample.level == "protected"
        or protecting is not None
        or any(s.verdict == "protected" for s in suggestions)
        or (review is not None and any(setting.value is not None or setting.unbounded for setting in review.settings))
    )
    tokens = token_leakage(traced, batch_size, None)
    span = (
        {
            "token_span_exposed": tokens.span_exposing,
            "safe_tokens_per_batch": tokens.safe_tokens_per_batch,
            "safe_token_batch": tokens.safe_batch_size,
            "tokens_per_batch": tokens.layers[0].tokens_per_batch if tokens.layers else None,
        }
        if tokens
        else {}
    )
    return SuggestReport(
        spec,
        loaded.input_shape,
        batch_size,
        base.ra_i,
        base.critical_layer,
        base_sample.level,
        suggestions,
        skipped,
        unknowns=base_bound.unknowns,
        rank_bound=base_bound.rank_bound,
        certified_deficit=base_bound.certified_deficit,
        certifying_batch=certifying_batch,
        protecting_batch=protecting_batch,
        max_recoverable=ceiling,
        recoverable_fraction=base_bound.recoverable_fraction,
        certifying_withheld=protecting,
        deficit_withheld=deficit_only,
        round_review=review,
        seconds=time.perf_counter() - started,
        sample=base_sample,
        readout_layers=sorted(readouts),
        noise_is_the_way=not structural,
        spectrum=reference.name if reference is not None else "",
        exposed_below=energy.exposed_below,
        certificate_quantile=energy.quantile,
        round_dp=round_.dp if round_ is not None else None,
        shared_layers=shared_layers,
        withheld_layers=withheld_layers,
        **span,
    )
