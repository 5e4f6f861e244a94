"""Result -> the JSON object whose key names are a contract (add keys freely, never rename)."""

from __future__ import annotations

import json as _json
import math
from dataclasses import asdict

from rankaudit import __version__
from rankaudit.result import Result
from rankaudit.settings.round import round_dict


def to_dict(result: Result) -> dict:
    return {
        "rankaudit_version": __version__,
        "model": result.model,
        "model_name": result.model_name,
        "input_shape": _input_shape(result),
        "batch_size": result.batch_size,
        "tracer": result.tracer,
        "ra_i": result.ra_i,
        "critical_layer": result.critical_layer,
        "verdict": result.verdict,
        "identifiability": (
            {**asdict(result.identifiability), "hidden_estimate": result.identifiability.hidden_estimate}
            if result.identifiability
            else None
        ),
        "meaning": result.meaning,
        "summary": result.summary,
        "parameters": result.parameters,
        "policy": {**asdict(result.policy), "next_step": _next_step(result)} if result.policy else None,
        "layers": [
            {
                "name": row.name,
                "op": row.op,
                "inputs": row.inputs,
                "weights": row.weights,
                "outputs": row.outputs,
                "virtual": row.virtual,
                "ra_i": row.ra_i,
                "dense": row.dense,
                "side": row.side,
                "critical": row.critical,
                "block": row.block,
                "folded": row.folded,
                "own_weights": row.own_weights,
                "reported_params": row.reported_params,
                "frozen_params": row.frozen_params,
                "source": row.source,
            }
            for row in result.layers
        ],
        "blocks": [asdict(block) for block in result.blocks],
        "caveats": [
            {"node": c.node, "op": c.op, "message": c.message, "code": c.code, "source": c.source}
            for c in result.caveats
        ],
        "label_leakage": _label_leakage(result),
        "verification": result.verification,
        "seconds": round(result.seconds, 4),
        "inputs": [asdict(info) for info in result.inputs],
        "token_leakage": asdict(result.token_leakage) if result.token_leakage else None,
        "build": result.build or None,
        "forward_kwargs": result.call_notes,
        "stand_ins": result.stand_ins,
        "round": round_dict(result.round),
        "dp": _dp(result),
        "bias_readout": [asdict(finding) for finding in result.bias_readout],
        "deployment": None
        if result.deployment is None
        else {
            "kind": result.deployment.kind,
            "root": result.deployment.root,
            "notes": result.deployment.notes,
            "settings": [
                {"setting": setting, "value": value, "source": source}
                for setting, value, source in result.deployment.settings
            ],
        },
    }


def _dp(result: Result) -> dict | None:
    """The DP section; the HTML card's curve stays out of the contract."""
    if result.dp is None:
        return None
    from rankaudit.bound.fisher import BOUND_COVERS, summary

    section = asdict(result.dp)
    section.pop("curve")
    section["covers"] = BOUND_COVERS
    fisher = result.verification.get("fisher")
    # --verify fisher: the line for unbiased attackers at the weights measured, beside B(κ) (its full record is
    # verification.fisher).
    section["fisher"] = summary(fisher) if fisher else None
    return section


def _input_shape(result: Result) -> list[int] | dict[str, list[int]]:
    """The per-sample shape; a dict by input name when forward() was fed several tensors."""
    if len(result.inputs) > 1:
        return {info.name: list(info.shape) for info in result.inputs}
    return list(result.input_shape)


def _label_leakage(result: Result) -> dict | None:
    leakage = result.label_leakage
    if leakage is None:
        return None
    return {
        "risk": leakage.risk,
        "layers": [
            {
                "name": b.name,
                "bridge": b.bridge,
                "blocked_by": b.blocked_by,
                "shared": b.shared,
                "direct": b.direct,
                "kind": b.kind,
                "reason": b.reason,
            }
            for b in leakage.layers
        ],
    }


def render(results: list[Result]) -> str:
    """One object for one model, a list for several."""
    payload = to_dict(results[0]) if len(results) == 1 else [to_dict(r) for r in results]
    return dumps(payload)


def finite(value):
    """The payload as JSON every strict reader takes: NaN and infinities as null (JSON has no spelling for them;
    Python's NaN / Infinity make strict readers refuse the whole report, and a measurement that came out
    non-finite was not measured), and a file name's bytes that arrived escaped (the C locale) as the UTF-8 text
    they are, never lone surrogates."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, str):
        return value if value.isprintable() else _text(value)
    if isinstance(value, dict):
        return {finite(key) if isinstance(key, str) else key: finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(item) for item in value]
    return value


def _text(value: str) -> str:
    try:
        return value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no decoder made
        return value.encode("utf-8", "backslashreplace").decode("utf-8")


def dumps(payload) -> str:
    """Strict JSON text of a report: indented, non-finite numbers as null."""
    return _json.dumps(finite(payload), indent=2, allow_nan=False) + "\n"


def _next_step(result: Result) -> dict | None:
    """The command to run next when the policy fails, and why (None when it passes)."""
    from rankaudit.findings.next_step import next_step

    step = next_step(result)
    return asdict(step) if step is not None else None
