"""Result -> SARIF 2.1.0 for code scanning: stable rule ids, results located at the model's source lines."""

from __future__ import annotations

from pathlib import Path

from rankaudit import REPOSITORY, __version__
from rankaudit.report.json import dumps as strict_json
from rankaudit.result import CAVEAT_CODES, Result

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
# Each rule's section on the rules page of this version's documentation (docs/rules.md: one heading per rule id).
RULES_PAGE = f"{REPOSITORY}/blob/main/docs/rules.md"  # no release is tagged yet: the default branch's page

# id -> (name, short description, default level, security-severity). Ids are stable: never renumber.
RULES = {
    "RA001": (
        "input-exposed",
        "The model's input can be reconstructed completely from one shared gradient (RA-i < 0)",
        "error",
        "8.0",
    ),
    "RA002": (
        "input-boundary",
        "The critical layer has exactly as many constraints as unknowns (RA-i = 0)",
        "warning",
        "5.0",
    ),
    "RA003": (
        "label-leakage",
        "A shared layer's gradient alone reveals the batch's labels (gradient bridge)",
        "warning",
        "6.5",
    ),
    "RA004": (
        "no-certified-deficit",
        "Less than the exposed share (--exposed-below) of the detail of 90 % of samples like yours is certified "
        "hidden from any weights: the gradient can show such a sample almost in full",
        "error",
        "8.0",
    ),
    "RA005": (
        "token-set-exposed",
        "The token embedding's shared gradient reveals which tokens the batch holds (its non-zero rows)",
        "error",
        "7.5",
    ),
    "RA006": (
        "token-set-span-test",
        "A shared gradient of a layer reading per-token vectors has rank below its "
        "input width, so a span test over the vocabulary reads the batch's token set (DAGER)",
        "error",
        "7.5",
    ),
    "RA007": (
        "input-partial",
        "Part of each sample's detail is certified hidden from any weights, but less than protected asks "
        "(--max-recoverable): not protection",
        "warning",
        "6.5",
    ),
    "RA009": (
        "dp-reconstruction-bound",
        "The DP noise bounds a reconstruction's success only above the allowed ceiling: B(κ) > --max-reconstruction",
        "error",
        "7.0",
    ),
    "RA010": (
        "bias-readout",
        "A shared layer with a trainable bias and a ReLU-like activation reads per-sample "
        "vectors: a unit that fires for one sample alone hands that sample's input to the layer over exactly "
        "(weight update row / bias update; Qian et al., Prop. 1)",
        "warning",
        "7.0",
    ),
    "RA011": (
        "dp-fisher-floor",
        "Under the client's DP noise, the Fisher information of the update bounds how close an unbiased "
        "reconstruction of each measured sample gets (an MSE floor and a PSNR ceiling, at the weights measured), "
        "beside the bound B(κ) that holds for every attacker",
        "note",
        "3.0",
    ),
    **{code: (name, title, "note", "2.0") for code, (name, title) in CAVEAT_CODES.items()},
}
# RA001/RA002 read R-GAP's index (RA-i); RA004 (exposed) and RA007 (partial) read the identifiability bound's
# verdict level (method.md: verdicts).
_RA_RULE = {"exposed": "RA001", "boundary": "RA002"}
_VERDICT_RULE = {"exposed": "RA004", "partial": "RA007"}


def _model_path(result: Result) -> str:
    path = result.model.rsplit(":", 1)[0] if result.model.endswith(":" + result.model_name) else result.model
    return _uri(path)


def _uri(path: str) -> str:
    candidate = Path(path)
    try:
        candidate = candidate.resolve().relative_to(Path.cwd().resolve())
    except ValueError:
        pass
    return candidate.as_posix()


def _location(result: Result, source: str | None) -> dict:
    """At `file:line` when the trace knows it, else at the model file."""
    # Without a known line the finding is about the whole file: its first line (code scanning needs a region).
    uri, region = _model_path(result), {"startLine": 1}
    if source:
        file_part, _, line = source.rpartition(":")
        if file_part and line.isdigit():
            uri, region = _uri(file_part), {"startLine": max(1, int(line))}
    return {"physicalLocation": {"artifactLocation": {"uri": uri, "uriBaseId": "%SRCROOT%"}, "region": region}}


def _rule(rule_id: str) -> dict:
    name, description, level, severity = RULES[rule_id]
    return {
        "id": rule_id,
        "name": name,
        "shortDescription": {"text": description},
        "defaultConfiguration": {"level": level},
        "helpUri": f"{RULES_PAGE}#{rule_id.lower()}",
        "help": {"text": f"What {rule_id} means and what to do: {RULES_PAGE}#{rule_id.lower()}"},
        "properties": {"security-severity": severity, "tags": ["security", "privacy", "federated-learning"]},
    }


def _results_for(result: Result) -> list[dict]:
    from rankaudit.findings.meaning import ra_sentence, ra_verdict

    found = []
    row = result.critical_row
    bound = result.identifiability
    if bound is not None and _VERDICT_RULE.get(result.verdict):
        verdict_rule = _VERDICT_RULE[result.verdict]
        from rankaudit.findings.meaning import carried_by_sentence
        from rankaudit.findings.next_step import next_step

        carried = (
            carried_by_sentence(result) if result.policy is not None and result.policy.carried_by == "noise" else ""
        )
        step = next_step(result)
        found.append(
            {
                "ruleId": verdict_rule,
                "level": RULES[verdict_rule][2],
                "message": {
                    "text": f"{result.model}: {result.summary}"
                    + (f" The policy passes, {carried}." if carried else "")
                    + (f" Next step: `{step.command}`: {step.why}." if step else "")
                },
                # At the critical layer's line where the trace knows it: where a reviewer would start.
                "locations": [_location(result, row.source if row else None)],
                "properties": {
                    "rank_bound": bound.rank_bound,
                    "unknowns": bound.unknowns,
                    "recoverable_fraction": bound.recoverable_fraction,
                    "max_recoverable": bound.max_recoverable,
                    "certified_hidden_energy": bound.sample.certified_hidden_energy if bound.sample else None,
                    "visible_psnr_ceiling": bound.sample.visible_psnr_ceiling if bound.sample else None,
                    "verdict": result.verdict,
                    "bottleneck": bound.bottleneck,
                    "batch_size": result.batch_size,
                    **_sample_properties(result),
                    **_round_properties(result),
                },
            }
        )
    rule_id = _RA_RULE.get(ra_verdict(result.ra_i))
    if rule_id:
        found.append(
            {
                "ruleId": rule_id,
                "level": RULES[rule_id][2],
                "message": {"text": f"{result.model}: {ra_sentence(result)}"},
                "locations": [_location(result, row.source if row else None)],
                "properties": {
                    "ra_i": result.ra_i,
                    "critical_layer": result.critical_layer,
                    "batch_size": result.batch_size,
                },
            }
        )
    leakage = result.label_leakage
    if leakage is not None and leakage.risk == "high":
        leaking = leakage.leaking
        rows = {row.name: row for row in result.layers}
        first = rows.get(leaking[0])
        found.append(
            {
                "ruleId": "RA003",
                "level": RULES["RA003"][2],
                "message": {
                    "text": f"{result.model}: the gradient of any one of {', '.join(leaking)} reveals "
                    "the batch's labels (GDBR gradient bridge / iDLG)."
                },
                "locations": [_location(result, first.source if first else None)],
                "properties": {"layers": leaking},
            }
        )
    tokens = result.token_leakage
    if tokens is not None and tokens.exposed:
        exposing = [e for e in tokens.embeddings if e.exposed]
        found.append(
            {
                "ruleId": "RA005",
                "level": RULES["RA005"][2],
                "message": {"text": f"{result.model}: " + "; ".join(e.reason for e in exposing) + "."},
                "locations": [_location(result, exposing[0].source)],
                "properties": {"embeddings": [e.name for e in exposing], "tokens_per_batch": tokens.tokens_per_batch},
            }
        )
    if tokens is not None and tokens.span_exposed:
        exposing = [layer for layer in tokens.layers if layer.exposed]
        found.append(
            {
                "ruleId": "RA006",
                "level": RULES["RA006"][2],
                "message": {
                    "text": f"{result.model}: {exposing[0].reason}; safe from "
                    f"{tokens.safe_tokens_per_batch} tokens per shared gradient."
                },
                "locations": [_location(result, exposing[0].source)],
                "properties": {
                    "layers": [layer.name for layer in exposing],
                    "tokens_per_batch": exposing[0].tokens_per_batch,
                    "d_in": exposing[0].d_in,
                    "safe_tokens_per_batch": tokens.safe_tokens_per_batch,
                },
            }
        )
    for finding in result.bias_readout:
        found.append(
            {
                "ruleId": "RA010",
                "level": RULES["RA010"][2],
                "message": {"text": f"{result.model}: {finding.message}. Fix: {finding.fix}."},
                "locations": [_location(result, finding.source)],
                "properties": {
                    "layer": finding.name,
                    "op": finding.op,
                    "units": finding.units,
                    "width": finding.width,
                    "reads_input": finding.reads_input,
                    "activation": finding.activation,
                    "exact": finding.exact,
                    "batch_size": finding.batch_size,
                    "samples": finding.samples,
                    "whole_batch": finding.whole_batch,
                },
            }
        )
    dp = result.dp
    if dp is not None and dp.within_limit is False:
        from rankaudit.findings.meaning import dp_sentence

        found.append(
            {
                "ruleId": "RA009",
                "level": RULES["RA009"][2],
                "message": {"text": f"{result.model}: {dp_sentence(dp)}, above the allowed {dp.max_reconstruction:g}."},
                "locations": [_location(result, None)],
                "properties": {
                    "level": dp.level,
                    "noise_multiplier": dp.noise_multiplier,
                    "sample_rate": dp.sample_rate,
                    "steps": dp.steps,
                    "epsilon": dp.epsilon,
                    "delta": dp.delta,
                    "prior": dp.prior,
                    "reconstruction_bound": dp.reconstruction_bound,
                    "max_reconstruction": dp.max_reconstruction,
                    "fisher": _fisher_summary(result),
                },
            }
        )
    fisher = result.verification.get("fisher")
    if dp is not None and fisher:
        from rankaudit.bound.fisher import BOUND_COVERS

        line = _fisher_summary(result)
        worst = line["worst_psnr_ceiling"]
        found.append(
            {
                "ruleId": "RA011",
                "level": RULES["RA011"][2],
                "message": {
                    "text": f"{result.model}: at σ {line['noise_multiplier']:g} an unbiased reconstruction of the "
                    f"measured samples reaches a PSNR of at most "
                    + ("-inf" if worst is None else f"{worst:.1f}")
                    + f" dB ({line['weights']}); σ {line['least_noise']:.3g} keeps it at or below "
                    f"{line['psnr_target']:g} dB. Any attacker: B({dp.prior:g}) = {dp.reconstruction_bound:.3g}."
                },
                "locations": [_location(result, None)],
                "properties": {
                    **line,
                    "reconstruction_bound": dp.reconstruction_bound,
                    "prior": dp.prior,
                    "reconstruction_bound_covers": BOUND_COVERS,
                },
            }
        )
    for caveat in result.caveats:
        found.append(
            {
                "ruleId": caveat.code,
                "level": "note",
                "message": {"text": f"{caveat.node} ({caveat.op}): {caveat.message}"},
                "locations": [_location(result, caveat.source)],
            }
        )
    return found


def _fisher_summary(result: Result) -> dict | None:
    """--verify fisher's line as the DP section shows it (None where it did not run)."""
    from rankaudit.bound.fisher import summary

    fisher = result.verification.get("fisher")
    return summary(fisher) if fisher else None


def _sample_properties(result: Result) -> dict:
    """method.md: each sample: the per-sample bound the verdict reads (rank_bound and unknowns above are the batch's or round's)."""
    sample = result.identifiability.sample
    if sample is None:
        return {}
    return {
        "sample": {
            "rank_bound": sample.rank_bound,
            "unknowns": sample.unknowns,
            "recoverable_fraction": sample.recoverable_fraction,
            "level": sample.level,
            "steps_per_sample": sample.steps_per_sample,
            "binding": sample.binding,
            "rounds": sample.rounds,
            "rounds_known": sample.rounds_known,
        }
    }


def _round_properties(result: Result) -> dict:
    """The round behind a verdict (method.md: the round), for a round that is not FedSGD."""
    from rankaudit.settings.round import round_dict

    if result.round is None or result.round.fedsgd:
        return {}
    caps = result.identifiability.round
    return {
        "round": round_dict(result.round),
        "binding_cap": caps.binding if caps else None,
        "binding_explanation": caps.explanation if caps else None,
    }


def to_sarif(results: list[Result]) -> dict:
    findings = [finding for result in results for finding in _results_for(result)]
    used = sorted(
        {finding["ruleId"] for finding in findings}
        | set(_RA_RULE.values())
        | set(_VERDICT_RULE.values())
        | {"RA003", "RA005", "RA006", "RA010"}
        | ({"RA009"} if any(r.dp for r in results) else set())
        | ({"RA011"} if any(r.dp and r.verification.get("fisher") for r in results) else set())
    )
    return {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": "rankaudit",
                        "version": __version__,
                        "semanticVersion": __version__,
                        "rules": [_rule(rule_id) for rule_id in used],
                    }
                },
                "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().resolve().as_uri() + "/"}},
                "results": findings,
            }
        ],
    }


def render(results: list[Result]) -> str:
    return strict_json(to_sarif(results))
