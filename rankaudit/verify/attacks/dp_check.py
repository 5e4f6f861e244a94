"""--verify dp: the informed attack on the DP noise of --dp-noise ..., its success rate beside the bound B(1/M)."""

from __future__ import annotations

from rankaudit.errors import UsageError
from rankaudit.verify.registry import Need, Verifier, VerifyContext


def run(context: VerifyContext) -> dict:
    """The attack on the settings the round carries; the interval above the bound is its record's internal error."""
    if context.dp is None:
        raise UsageError(
            "--verify dp attacks the DP noise, but no noise multiplier is given",
            "add --dp-noise σ (and --dp-clip, --dp-sample-rate, --dp-steps as trained)",
        )
    from rankaudit.verify.attacks import dp as dp_attack

    return dp_attack.verify_dp(
        context.result,
        context.spec,
        context.dp,
        candidates=dp_attack.DEFAULT_CANDIDATES if context.dp_candidates is None else context.dp_candidates,
        trials=context.samples if context.samples_given else dp_attack.DEFAULT_TRIALS,
        seed=context.seed,
        device=context.device,
        data=context.data,
        shared_layers=context.shared_layers,
        withheld_layers=context.withheld_layers,
    )


VERIFIER = Verifier(
    name="dp",
    help="the informed attack on the DP noise of --dp-noise ..., its success rate beside the bound B(1/M) (needs "
    "the [dp] extra).",
    needs=frozenset({Need.DP_NOISE, Need.GPU}),
    run=run,
    order=0,
    flags={"--dp-candidates": "the candidates"},
)
