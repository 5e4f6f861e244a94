"""Verdict, policy and model-level caveats from the counted Result."""
from __future__ import annotations

from rankaudit.result import Caveat, PolicyOutcome, Result

FAIL_ON_CHOICES = ("never", "exposed", "boundary")

MEANING = {
    "exposed": "the gradients over-determine the input of every layer: a server can reconstruct the client's "
               "input completely",
    "boundary": "the critical layer has exactly as many constraints as unknowns: a complete reconstruction is "
                "on the edge of possible",
    "protected": "some layer has more unknowns than constraints: a complete reconstruction is impossible, though "
                 "a partial one may still leak (protected is not the same as private)",
}
ALL_DENSE_MEANING = ("every layer is dense (no weight sharing): each layer's input is recoverable from its own "
                     "gradient, so a server can reconstruct the client's input completely")


def verdict_for(ra_i: int | None) -> str:
    """Spec §4: RA-i < 0 exposed, = 0 boundary, > 0 protected; no non-dense layer at all is exposed."""
    if ra_i is None or ra_i < 0:
        return "exposed"
    return "boundary" if ra_i == 0 else "protected"


def _model_caveats(result: Result, non_injective_ops: list[str], fallback_reason: str | None) -> list[Caveat]:
    caveats = []
    if non_injective_ops:
        shown = ", ".join(non_injective_ops[:3]) + (" ..." if len(non_injective_ops) > 3 else "")
        caveats.append(Caveat("RA102", non_injective_ops[0], "relu",
                              f"ReLU-like maps ({shown}) are monotonic but not injective: a zero output removes a "
                              "weight constraint, so every count here is an upper bound on what an attacker gets"))
    if fallback_reason:
        caveats.append(Caveat("RA106", result.model_name, "trace",
                              f"traced with torch.export because {fallback_reason}"))
    return caveats


def evaluate_policy(result: Result, fail_on: str = "exposed", min_ra: int | None = None) -> PolicyOutcome:
    """Exit-code policy: fail on a verdict at or below `fail_on`, or on RA-i below `min_ra`."""
    reasons = []
    failing = {"never": (), "exposed": ("exposed",), "boundary": ("exposed", "boundary")}[fail_on]
    if result.verdict in failing:
        reasons.append(f"verdict is {result.verdict} (--fail-on {fail_on})")
    if min_ra is not None and (result.ra_i is None or result.ra_i < min_ra):
        shown = "undefined (every layer dense)" if result.ra_i is None else str(result.ra_i)
        reasons.append(f"RA-i {shown} is below the required minimum {min_ra} (--min-ra)")
    return PolicyOutcome(fail_on=fail_on, min_ra=min_ra, passed=not reasons, reasons=reasons)


def apply_findings(result: Result, *, non_injective_ops: list[str], fallback_reason: str | None,
                   fail_on: str = "exposed", min_ra: int | None = None) -> Result:
    result.verdict = verdict_for(result.ra_i)
    result.meaning = ALL_DENSE_MEANING if result.ra_i is None else MEANING[result.verdict]
    result.caveats = _model_caveats(result, non_injective_ops, fallback_reason) + result.caveats
    result.policy = evaluate_policy(result, fail_on, min_ra)
    return result
