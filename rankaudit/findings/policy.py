"""The exit-code policy: which findings fail the run (--fail-on, --min-ra, the token findings, --max-reconstruction)."""

from __future__ import annotations

from rankaudit.findings.meaning import (
    certifies_nothing,
    energy_percent,
    per_sample_view,
    ra_verdict,
    samples_like_yours,
)
from rankaudit.result import PolicyOutcome, Result
from rankaudit.settings.levels import DEFAULT_FAIL_ON, FAILING_VERDICTS, percent


def evaluate_policy(
    result: Result, fail_on: str = DEFAULT_FAIL_ON, min_ra: int | None = None, max_recoverable: float | None = None
) -> PolicyOutcome:
    """Exit-code policy: fail on a verdict level `fail_on` names (by default anything short of `protected`), on
    RA-i below `min_ra`, and on the token findings. `max_recoverable` is the ceiling the verdict level was
    computed with (method.md: verdicts); it is recorded here, the level already applies it."""
    reasons = []
    bound = result.identifiability
    each = bound is not None and bound.sample is not None and per_sample_view(result)
    carried_by = "structure" if fail_on != "never" else "none"
    if result.verdict in FAILING_VERDICTS[fail_on]:
        carried_by = "none"
        hidden = bound.sample.certified_hidden_energy if bound is not None and bound.sample else None
        if hidden is not None and result.verdict in ("partial", "exposed"):
            certified = (
                "nothing is certified hidden without --data (the input is not an image)"
                if certifies_nothing(bound)
                else f"{samples_like_yours(bound)} keep {energy_percent(hidden)} of their detail hidden"
                if hidden > 0
                else "nothing of a sample's detail is certified hidden"
            )
            reasons.append(
                f"verdict is {result.verdict}{' (each sample)' if each else ''}: {certified}, below the "
                f"{percent(1 - bound.max_recoverable)} protected asks (--fail-on {fail_on}; --max-recoverable sets "
                "the share, --fail-on exposed keeps the weaker gate)"
            )
        elif result.verdict == "partial" and bound is not None:
            fraction = bound.sample.recoverable_fraction if each else bound.recoverable_fraction
            whose = "each sample's" if each else "the input's"
            reasons.append(
                f"verdict is partial{' (each sample)' if each else ''}: up to {percent(fraction)} of "
                f"{whose} directions are recoverable, above the allowed {percent(bound.max_recoverable)} "
                f"(--fail-on {fail_on}; --max-recoverable sets the ceiling, --fail-on exposed fails "
                "only without a certified deficit)"
            )
        elif each:
            reasons.append(
                f"verdict is {result.verdict} (each sample): nothing certifies that any part of one "
                f"sample stays hidden (--fail-on {fail_on})"
            )
        else:
            reasons.append(f"verdict is {result.verdict} (--fail-on {fail_on})")
    if fail_on == "boundary" and ra_verdict(result.ra_i) != "protected":
        # The bound has no boundary case: the strictest level also asks R-GAP's closed form to stop somewhere.
        shown = "undefined (every layer dense)" if result.ra_i is None else str(result.ra_i)
        reasons.append(f"RA-i {shown} <= 0: R-GAP's closed form is not stopped (--fail-on boundary)")
    if min_ra is not None and (result.ra_i is None or result.ra_i < min_ra):
        shown = "undefined (every layer dense)" if result.ra_i is None else str(result.ra_i)
        reasons.append(f"RA-i {shown} is below the required minimum {min_ra} (--min-ra)")
    tokens = result.token_leakage
    if tokens is not None and tokens.exposed and fail_on != "never":
        reasons.append(
            f"the token set is exposed by the gradient of {', '.join(tokens.exposing)} "
            f"(--fail-on {fail_on}; withhold or freeze the embedding to pass)"
        )
    if tokens is not None and tokens.span_exposed and fail_on != "never":
        exposing = [layer for layer in tokens.layers if layer.exposed]
        first = exposing[0]
        reasons.append(
            f"the batch's tokens can be read from the gradient of {', '.join(layer.name for layer in exposing)} by "
            f"a span test (B·n = {first.tokens_per_batch} < d_in = {first.d_in}; DAGER) (--fail-on "
            f"{fail_on}; send at least {tokens.safe_tokens_per_batch} distinct tokens per gradient, e.g. "
            f"batch {tokens.safe_batch_size}, or withhold those layers' gradients to pass)"
        )
    ceiling = bound.max_recoverable if bound is not None else max_recoverable
    return PolicyOutcome(
        fail_on=fail_on,
        min_ra=min_ra,
        passed=not reasons,
        reasons=reasons,
        max_recoverable=ceiling,
        carried_by=carried_by,
    )


def short_reason(reason: str, width: int = 48) -> str:
    """A policy reason's head, for the one line --quiet prints per model: the reason up to its explanation (the
    reasons above each open with what failed, then ": " or " (" and the detail), at most `width` characters."""
    cuts = [at for at in (reason.find(": "), reason.find(" (")) if at > 0]
    head = reason[: min(cuts)] if cuts else reason
    return head if len(head) <= width else head[: width - 1].rstrip(" ,") + "…"


def _noise_that_would(result: Result) -> str:
    """Where no architecture reaches `protected` (method.md: energy), the least client noise that meets the DP rule, from the
    search `suggest` runs (dp.least_noise at this q, T and δ); elsewhere the pointer to `suggest`."""
    bound, dp = result.identifiability, result.dp
    hopeless = (
        bound is not None
        and bound.sample is not None
        and bound.protected_rank is not None
        and bound.protected_rank < bound.sample.rank_bound
    )
    if not hopeless or dp.noise_by != "client":
        return "`rankaudit suggest` with the same DP options names the least noise that meets it"
    from rankaudit.bound.dp import least_noise

    found = least_noise(dp.max_reconstruction, dp.prior, dp.sample_rate, dp.steps, dp.delta, dp.level)
    if found.noise_multiplier is None:
        return "no noise multiplier up to the search's ceiling meets it at this sampling rate and number of steps"
    return (
        f"no architecture change reaches protected on this input; a noise multiplier of at least "
        f"{found.noise_multiplier:g} would meet it at q {dp.sample_rate:g} and T {dp.steps:,}"
    )


def apply_dp(result: Result, settings) -> Result:
    """The DP bound for `settings` (a round.DPSettings) into result.dp; --max-reconstruction fails the policy when
    B(κ) exceeds it. The structural verdict is left as it is: noise bounds reconstruction, it does not remove the
    structural exposure."""
    from rankaudit.bound.dp import dp_bound

    result.dp = dp_bound(settings)
    result.dp.noise_by = getattr(settings, "noise_by", "client")
    policy = result.policy
    if result.dp.within_limit is False and policy is not None:
        policy.reasons.append(
            f"DP bound above --max-reconstruction {result.dp.max_reconstruction:g}: a reconstruction may succeed "
            f"with probability up to {result.dp.reconstruction_bound:.3g} at prior {result.dp.prior:g}; "
            f"{_noise_that_would(result)}"
        )
        policy.passed = False
    elif (
        result.dp.within_limit
        and policy is not None
        and policy.carried_by == "none"
        and result.verdict in FAILING_VERDICTS[policy.fail_on]
    ):
        # method.md: each sample + method.md: DP: the structure leaves the sample open; the noise may still bound every reconstruction.
        verdict_reason = next((r for r in policy.reasons if r.startswith(f"verdict is {result.verdict}")), None)
        if result.dp.noise_by == "client" and verdict_reason is not None:
            policy.reasons.remove(verdict_reason)
            policy.carried_by = "noise"
            policy.passed = not policy.reasons
        elif verdict_reason is not None:
            policy.reasons[policy.reasons.index(verdict_reason)] = (
                verdict_reason + "; the DP noise is added by the server (--noise-by server): it bounds what the "
                "released model reveals, not what the server sees, so it cannot carry the verdict"
            )
    return result
