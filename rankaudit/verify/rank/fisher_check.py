"""--verify fisher: each sample's Fisher information under the client's DP noise, beside the bound B(κ)."""

from __future__ import annotations

from rankaudit.errors import UsageError
from rankaudit.verify.progress import ProgressBar
from rankaudit.verify.registry import Need, Verifier, VerifyContext


def check_settings(dp, what: str = "--verify fisher") -> None:
    """One-line refusals: no noise, noise the server adds, or client-level DP (whose unit is a client's update)."""
    if dp is None:
        raise UsageError(
            f"{what} reads what the DP noise leaves of each sample, but no noise multiplier is given",
            "add --dp-noise σ and --dp-clip C as trained (or noise and clip in [tool.rankaudit.dp])",
        )
    if dp.noise_by != "client":
        raise UsageError(
            f"{what}: noise the server adds after aggregation hides nothing from the server itself",
            "measure the noise the client adds (--noise-by client)",
        )
    if dp.level != "sample":
        raise UsageError(
            f"{what} measures DP-SGD's per-sample noise; at --dp-level client the noised unit is a client's update",
            "use --dp-level sample, or --verify dp for client-level DP",
        )


def run(context: VerifyContext) -> dict:
    """The Fisher line of the first --samples samples at the DP settings the round carries."""
    from rankaudit.verify.rank.fisher import line_for

    check_settings(context.dp)
    result = context.result
    if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
        raise UsageError(
            "--verify fisher differentiates each sample's gradient with respect to one real-valued input, and this "
            "model takes several or token ids",
            "verify a model with a single float input",
        )
    round_ = result.round
    with ProgressBar(context.samples, "Fisher information", enabled=context.show_progress) as bar:
        return line_for(
            context.spec,
            tuple(result.input_shape),
            context.dp,
            psnr_target=context.psnr_target,
            data=context.data,
            samples=context.samples,
            seed=context.seed,
            device=context.device,
            shared_layers=context.shared_layers,
            withheld_layers=context.withheld_layers,
            progress=bar,
            bn_mode=round_.bn_mode if round_ is not None else "train",
            batch_size=round_.batch_size if round_ is not None else result.batch_size,
            rank_seconds=context.rank_budget,
        )


VERIFIER = Verifier(
    name="fisher",
    help="each sample's Fisher information under the DP noise of --dp-noise/--dp-clip: the MSE floor and PSNR "
    "ceiling of any unbiased reconstruction, at these weights (needs the [verify] extra).",
    needs=frozenset({Need.IMAGES, Need.ROUND, Need.GPU, Need.TRAINABLE}),
    run=run,
    order=40,
    preflight=lambda context: check_settings(context.dp),
    flags={"--psnr-target": "the PSNR target of the least σ"},
)
