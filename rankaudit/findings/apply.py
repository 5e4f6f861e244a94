"""apply_findings: the verdict, its summary and model-level caveats, then the leakage findings and the policy."""

from __future__ import annotations

from rankaudit.bound.energy import certify
from rankaudit.bound.identifiability import identifiability, sample_identifiability
from rankaudit.bound.statistics import batch_statistics
from rankaudit.findings.leakage import (
    bias_readouts,
    label_leakage,
)
from rankaudit.findings.meaning import (
    bound_meaning,
    coverage_sentence,
    energy_sentence,
    per_sample_view,
    ra_sentence,
    round_meaning,
    sample_meaning,
    whole_sentence,
)
from rankaudit.findings.policy import (
    evaluate_policy,
)
from rankaudit.result import Caveat, InputInfo, Result
from rankaudit.settings.levels import (
    DEFAULT_FAIL_ON,
)
from rankaudit.settings.round import Round
from rankaudit.trace.records import TracedModel


def _batch_norms(traced: TracedModel) -> list[str]:
    """The normalisations that read the batch's statistics when the client trains in training mode (a compiled
    module counted as one in the worst case says so in its own caveat)."""
    records = [traced.record(node_id) for node_id in batch_statistics(traced, "train")]
    return [record.name for record in records if record.family != "script_module"]


def _model_caveats(
    result: Result, non_injective_ops: list[tuple[str, str | None]], fallback_reason: str | None
) -> list[Caveat]:
    caveats = []
    if non_injective_ops:
        names = [name for name, _ in non_injective_ops]
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        caveats.append(
            Caveat(
                "RA102",
                names[0],
                "relu",
                f"ReLU-like maps ({shown}) are monotonic but not injective: a zero output removes a "
                "weight constraint, so every count here is an upper bound on what an attacker gets",
                non_injective_ops[0][1],
            )
        )
    if fallback_reason:
        caveats.append(
            Caveat("RA106", result.model_name, "trace", f"traced with torch.export because {fallback_reason}")
        )
    return caveats


def apply_findings(
    result: Result,
    traced: TracedModel,
    *,
    fail_on: str = DEFAULT_FAIL_ON,
    min_ra: int | None = None,
    shared_layers: set[str] | None = None,
    max_recoverable: float | None = None,
    data: str | None = None,
    exposed_below: float | None = None,
    certificate_quantile: float | None = None,
) -> Result:
    """Verdict, meaning, model-level caveats, label leakage and the policy outcome, added to `result`.

    The verdict is the level (method.md: verdicts) of the identifiability bound (method.md: the bound) in `result.identifiability`, computed
    here with all gradients shared when the caller did not compute it; RA-i stays R-GAP's index.
    """
    non_injective = [
        (traced.record(n).name, traced.record(n).source)
        for n in traced.order
        if traced.record(n).counting.non_injective
    ]
    if result.identifiability is None:
        result.identifiability = identifiability(traced, result.batch_size, max_recoverable=max_recoverable)
    bound = result.identifiability
    if bound.sample is None:
        bound.sample = sample_identifiability(
            traced,
            result.round or Round(batch_size=result.batch_size),
            shared_layers=sorted(shared_layers) if shared_layers else None,
            max_recoverable=bound.max_recoverable,
        )
    # method.md: energy: the level is read on energy (the certified hidden share of a typical sample), not on directions.
    certify(bound, traced.inputs, data, exposed_below, certificate_quantile)
    # method.md: each sample: the verdict is the sample level; the batch or round level stays as its own sentence.
    result.verdict = bound.sample.level
    bound.sample.covers = coverage_sentence(
        bound.sample, result.round or Round(batch_size=result.batch_size), _batch_norms(traced)
    )
    if per_sample_view(result):
        result.meaning = sample_meaning(bound)
        meaning = result.meaning[:1].upper() + result.meaning[1:]
        result.summary = (
            f"Rank bound {bound.sample.rank_bound:,} of {bound.sample.unknowns:,} unknowns per sample: "
            f"{result.verdict} (each sample). {meaning}. {energy_sentence(result)} {whole_sentence(result)} "
            + ra_sentence(result)
        )
    else:
        result.meaning = (
            round_meaning(bound)
            if bound.round is not None
            else bound_meaning(bound, result.ra_i, result.critical_layer)
        )
        meaning = result.meaning[:1].upper() + result.meaning[1:]
        result.summary = (
            f"Rank bound {bound.rank_bound:,} of {bound.unknowns:,} unknowns: {result.verdict}. "
            f"{meaning}. {energy_sentence(result)} " + ra_sentence(result)
        )
    result.bias_readout = bias_readouts(traced, result, shared_layers)
    result.caveats = _model_caveats(result, non_injective, traced.fallback_reason) + result.caveats
    result.label_leakage = label_leakage(traced, result, shared_layers)
    result.policy = evaluate_policy(result, fail_on, min_ra, max_recoverable)
    return result


def describe_inputs(result: Result, traced: TracedModel, loaded) -> None:
    """Which inputs forward() got, where their unknowns start, how the model was built and called."""
    infos = []
    for spec in traced.inputs:
        start = traced.input_starts.get(spec.same_as or spec.name)
        record = traced.records.get(start) if start else None
        # An input fed the same ids as another (decoder_input_ids) adds no unknowns of its own.
        unknowns = record.output_numel if record is not None and not spec.same_as else 0
        infos.append(
            InputInfo(
                spec.name,
                tuple(spec.shape),
                str(spec.dtype).removeprefix("torch."),
                spec.role,
                record.name if record is not None else None,
                unknowns,
            )
        )
    result.inputs = infos
    result.build = loaded.build
    result.call_notes = list(traced.call_notes)
