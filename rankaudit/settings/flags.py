"""The command-line flags shared by check, suggest and compare: each option, its parse and its group."""

from __future__ import annotations

import click

from rankaudit.settings.run import ROUND_FLAGS


def names(value: str | None) -> list[str] | None:
    return [name.strip() for name in value.split(",") if name.strip()] if value else None


# ---- the federated round (spec §12): flags, then [tool.rankaudit.round], validated by round.build_round ----------
_ROUND_OPTIONS = [
    click.option(
        "--local-samples",
        type=int,
        default=None,
        metavar="N",
        help="Samples each client trains on per round (default: the batch size: FedSGD).",
    ),
    click.option("--local-epochs", type=int, default=None, metavar="E", help="Local epochs per round (default 1)."),
    click.option("--lr", type=float, default=None, metavar="F", help="Local learning rate (default 0.1)."),
    click.option("--optimizer", type=str, default=None, metavar="sgd|adam", help="Local optimizer (default sgd)."),
    click.option("--momentum", type=float, default=None, metavar="F", help="SGD momentum in [0, 1) (default 0)."),
    click.option(
        "--clients",
        type=int,
        default=None,
        metavar="C",
        help="Clients summed by secure aggregation (default 1: none); the server sees only the sum.",
    ),
    click.option(
        "--server-rounds",
        type=int,
        default=None,
        metavar="R",
        help="Server rounds the client's updates reach the server in; the per-sample bound and DP add up over "
        "them (default: not known, the verdict covers one round).",
    ),
    click.option(
        "--available-clients",
        type=int,
        default=None,
        metavar="M",
        help="Clients the server samples each round's C from (default C); client-level DP's q = C/M.",
    ),
    click.option(
        "--bn-mode",
        type=click.Choice(["train", "eval"]),
        default=None,
        help="How the client's BatchNorm normalises while it trains: train (default) on the batch's own "
        "statistics, which couple the samples of a batch; eval on its running statistics.",
    ),
]


# Help shared by the commands that take the same option.
INPUT_SHAPE_HELP = "Per-sample input shape, without the batch dimension (default: config, then INPUT_SHAPE)."
BATCH_SIZE_HELP = "Samples summed into one shared gradient."
OUTPUT_HELP = "Write the report to this file instead of stdout."
DEBUG_HELP = "Show tracebacks instead of one-line errors."
MIN_RA_HELP = "Exit 1 unless RA-i >= N."


def round_flags(ctx: click.Context) -> dict:
    return {name: ctx.params.get(name) for name in ROUND_FLAGS}


def round_options(command):
    for option in reversed(_ROUND_OPTIONS):
        command = option(command)
    return command


# --- differential privacy (spec §13): the DP options of `check` and `suggest`, and how they merge with the config --


def dp_options(command):
    """--dp-noise ... --max-reconstruction, on `check` and `suggest`. Values are checked by rankaudit.settings.dp_options.check_option
    (one-line errors, exit 2); the names mirror [tool.rankaudit.dp] (without the --dp- prefix)."""
    options = [
        click.option(
            "--dp-noise",
            type=float,
            metavar="SIGMA",
            help="DP noise multiplier σ: noise std over the clip norm. Adds the DP section to the report.",
        ),
        click.option("--dp-clip", type=float, metavar="C", help="DP clip norm c (default 1.0)."),
        click.option(
            "--dp-sample-rate",
            type=float,
            metavar="Q",
            help="Poisson sampling rate of a unit per step (default: from the round: B/N for DP-SGD, C/M for "
            "client-level DP; 1 in FedSGD).",
        ),
        click.option(
            "--dp-steps",
            type=int,
            metavar="T",
            help="Steps a unit can take part in (default: from the round: E·⌈N/B⌉ local steps × server rounds "
            "for DP-SGD, the server rounds for client-level DP; 1 in one FedSGD round).",
        ),
        click.option("--dp-delta", type=float, metavar="DELTA", help="δ at which ε is reported (default 1e-5)."),
        click.option(
            "--dp-level",
            type=str,
            metavar="sample|client",
            help="sample: DP-SGD, the unit is a sample; client: DP-FedAvg, the unit is a client's update "
            "(default sample).",
        ),
        click.option(
            "--prior",
            type=float,
            metavar="KAPPA",
            help="An attack's success probability without the update, κ (default 0.01).",
        ),
        click.option(
            "--max-reconstruction",
            type=float,
            metavar="P",
            help="Exit 1 when the DP bound on any reconstruction, B(κ), exceeds P; `suggest`: the least "
            "noise meeting P.",
        ),
        click.option(
            "--noise-by",
            type=str,
            metavar="client|server",
            help="Who adds the DP noise (default client). Server-added noise bounds what the released "
            "model reveals, not what the server sees.",
        ),
        click.option(
            "--dp-candidates",
            type=int,
            default=None,
            metavar="M",
            help="--verify dp: candidates the attacker chooses among, κ = 1/M (default 10).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def level_options(command):
    """--max-recoverable and --exposed-below: the two thresholds every command reads its levels on (energy)."""
    command = click.option(
        "--exposed-below",
        type=click.FloatRange(0, 1),
        default=None,
        metavar="F",
        help="exposed when less than F of a typical sample's energy is certified hidden (default 0.05).",
    )(command)
    return click.option(
        "--max-recoverable",
        type=click.FloatRange(0, 1),
        default=None,
        metavar="F",
        help="protected asks that at least 1 - F of a typical sample's energy stays hidden from any weights "
        "(default 0.5: half); below that the verdict is partial or exposed.",
    )(command)
