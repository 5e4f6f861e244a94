"""--verify bias: the bias readout (Qian et al.) on the real update of the analysed batch or round."""

from __future__ import annotations

from rankaudit.verify.registry import Need, Verifier, VerifyContext


def run(context: VerifyContext) -> dict:
    """Which samples a unit's weight update divided by its bias update gives exactly."""
    from rankaudit.verify.attacks import bias

    return bias.verify_bias(
        context.result,
        context.spec,
        seed=context.seed,
        device=context.device,
        data=context.data,
        shared_layers=context.shared_layers,
        withheld_layers=context.withheld_layers,
    )


VERIFIER = Verifier(
    name="bias",
    help="the bias readout (Qian et al.): which samples of the batch or round a unit's weight update divided by its "
    "bias update gives exactly (rgap on a batch or a round runs it first).",
    needs=frozenset({Need.IMAGES, Need.ROUND, Need.GPU}),
    run=run,
    order=20,
)
