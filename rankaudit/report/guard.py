"""GuardRun -> the guard command's JSON object (key names are a contract: add keys, never rename) and its table."""

from __future__ import annotations

from dataclasses import asdict

from rankaudit import __version__
from rankaudit.report.json import dumps as strict_dumps
from rankaudit.result import GuardDecision, GuardRun
from rankaudit.settings.round import round_dict


def decision_dict(decision: GuardDecision) -> dict:
    """The `guard` object: action, exact_samples, reasons, and what they rest on."""
    return {
        "action": decision.action,
        "exact_samples": decision.exact_samples,
        "reasons": decision.reasons + decision.notes,
        "readouts": [asdict(readout) for readout in decision.readouts],
        "layers_checked": decision.layers_checked,
        "skipped": decision.skipped,
        "architecture": decision.architecture,
        "energy": decision.energy,
        "changed": decision.changed,
        "samples": decision.samples,
        "min_psnr": decision.min_psnr,
        "psnr": {str(sample): value for sample, value in decision.psnr.items()},
        "feature_samples": decision.feature_samples,
        "seconds": round(decision.seconds, 4),
    }


def guard_dict(run: GuardRun) -> dict:
    return {
        "rankaudit_version": __version__,
        "model": run.model,
        "weights": run.weights,
        "data": run.data,
        "round": round_dict(run.round),
        "loss": run.loss,
        "guard": decision_dict(run.decision),
        "training_seconds": round(run.training_seconds, 4),
        "seconds": round(run.seconds, 3),
    }


def render_json(run: GuardRun) -> str:
    """Strict JSON, as every report's: a figure that is not finite is null, never NaN or Infinity."""
    return strict_dumps(guard_dict(run))


_HEADLINES = {
    "send": "send: no sample of the batch can be read from this update",
    "block": "block: nothing is sent this round",
    "drop": "drop: the update is sent without the rows that read samples",
    "noise": "noise: the update is sent with noise on the rows that read samples",
}


def render_table(run: GuardRun) -> str:
    """One short block: the action, why, and what was checked."""
    decision = run.decision
    lines = [f"rankaudit guard {run.model} at {run.weights}, {decision.samples} samples: {_HEADLINES[decision.action]}"]
    if decision.exact_samples:
        lines.append(
            f"  read: sample{'s' if len(decision.exact_samples) > 1 else ''} "
            + ", ".join(f"{sample} ({decision.psnr[sample]:.1f} dB)" for sample in decision.exact_samples)
        )
    if decision.feature_samples:
        lines.append(
            "  features read, the sample not: "
            + ", ".join(f"{sample} ({decision.psnr[sample]:.1f} dB)" for sample in decision.feature_samples)
        )
    lines += [f"  - {reason}" for reason in decision.reasons + decision.notes]
    checked = ", ".join(decision.layers_checked) if decision.layers_checked else "none"
    not_checkable = ", ".join(entry.split(":", 1)[0] for entry in decision.skipped)
    lines.append(
        f"  checked: {checked} (a readout at {decision.min_psnr:g} dB or more reads a sample)"
        + (f"; not checkable: {not_checkable} (--format json says why)" if not_checkable else "")
    )
    energy = decision.energy
    if energy is not None:
        lines.append(
            f"  visible energy: worst sample {energy['worst_sample']} hides {energy['hidden']:.1%}"
            if energy.get("measured")
            else f"  visible energy: {energy['note']}"
        )
    lines.append(
        f"  {decision.seconds:.3f} s guard, {run.training_seconds:.3f} s local training, {run.seconds:.2f} s in all"
    )
    return "\n".join(lines) + "\n"
