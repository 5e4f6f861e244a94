"""The command-line flags of check, suggest and compare: each option, its parse and its group."""

from __future__ import annotations

import os

import click

from rankaudit.settings.levels import DEFAULT_FAIL_ON, DEFAULT_PSNR_TARGET, FAIL_ON_CHOICES
from rankaudit.settings.limits import MAX_SECONDS, PSNR_TARGET_DB
from rankaudit.settings.run import ROUND_FLAGS

FORMATS = ("table", "json", "sarif", "html")


def _names(value: str | None) -> list[str] | None:
    return [name.strip() for name in value.split(",") if name.strip()] if value else None


# ---- the federated round (method.md: the round): flags, then [tool.rankaudit.round], validated by round.build_round ----------
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
_BATCH_SIZE_HELP = "Samples summed into one shared gradient."
_OUTPUT_HELP = "Write the report to this file instead of stdout."
_DEBUG_HELP = "Show tracebacks instead of one-line errors."
_MIN_RA_HELP = "Exit 1 unless RA-i >= N."


def round_flags(ctx: click.Context) -> dict:
    return {name: ctx.params.get(name) for name in ROUND_FLAGS}


def parse_shape(ctx, param, value):
    """--input-shape's callback: C,H,W (or any per-sample shape), checked."""
    if value is None:
        return None
    from rankaudit.settings.model_spec import parse_input_shape

    return parse_input_shape(value)  # a UsageError reaches main() and becomes one line, exit 2


def _stacked(command, options):
    """`command` with `options` applied as decorators written in this order (the first listed first in --help)."""
    for option in reversed(options):
        command = option(command)
    return command


def round_options(command):
    return _stacked(command, _ROUND_OPTIONS)


# --- differential privacy (method.md: DP): the DP options of `check` and `suggest`, and how they merge with the config --


def dp_options(command):
    """--dp-noise ... --max-reconstruction, on `check` and `suggest`. Values are checked by
    rankaudit.settings.dp_options.check_option (one-line errors, exit 2); the names mirror [tool.rankaudit.dp] (without
    the --dp- prefix)."""
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
    return _stacked(command, options)


def psnr_target_option(command):
    """--psnr-target, on `check`, `suggest` and `compare`: the PSNR ceiling the Fisher floor's least σ keeps."""
    return click.option(
        "--psnr-target",
        type=float,
        callback=_psnr_in_range,
        default=DEFAULT_PSNR_TARGET,
        show_default=True,
        metavar="DB",
        help="With DP noise: the least σ keeping the PSNR of any unbiased reconstruction at or below DB "
        "(--verify fisher, suggest, compare; `psnr-target` in [tool.rankaudit]).",
    )(command)


def _psnr_in_range(ctx, param, value):
    low, high = PSNR_TARGET_DB
    if value is not None and not low <= value <= high:  # nan fails both comparisons
        raise click.BadParameter(f"{value} is not a PSNR in dB from {low:g} to {high:g}; give e.g. 20")
    return value


def _seconds(ctx, param, value):
    """A number of seconds that keeps a limit: nan and inf would remove it."""
    if value is not None and not 0 < value <= MAX_SECONDS:
        raise click.BadParameter(f"{value} is not a number of seconds above 0 and up to {MAX_SECONDS:g}")
    return value


def verifier_flags(ctx) -> dict:
    """The verifiers' own flags as given on the command line (None where not given): each is refused without its
    verifier, so that a setting that would change nothing is said."""
    given = {"--dp-candidates": "dp_candidates", "--psnr-target": "psnr_target", "--rank-budget": "rank_budget"}
    commandline = click.core.ParameterSource.COMMANDLINE
    return {
        flag: ctx.params.get(name) if ctx.get_parameter_source(name) is commandline else None
        for flag, name in given.items()
    }


def _level_options(command):
    """--max-recoverable, --exposed-below and --certificate-quantile: the thresholds every command reads its levels
    on (energy), and the share of samples the certificate speaks for."""
    command = click.option(
        "--certificate-quantile",
        type=click.FloatRange(0, 1, min_open=True, max_open=True),
        default=None,
        metavar="Q",
        help="The certificate speaks for this share of samples like yours: at least Q of them keep the certified "
        "share of their detail hidden (default 0.9).",
    )(command)
    command = click.option(
        "--exposed-below",
        type=click.FloatRange(0, 1),
        default=None,
        metavar="F",
        help="exposed when 90 % of samples like yours keep less than F of their detail (their difference from the "
        "average sample) certified hidden (default 0.05).",
    )(command)
    return click.option(
        "--max-recoverable",
        type=click.FloatRange(0, 1),
        default=None,
        metavar="F",
        help="protected asks that 90 % of samples like yours keep at least 1 - F of their detail hidden from any weights "
        "(default 0.5: half); below that the verdict is partial or exposed.",
    )(command)


def check_options(command):
    """--batch-size ... --verbose, on `check`: the batch, the report's format and files, the policy, the layers sent."""
    options = [
        click.option(
            "--batch-size",
            "-b",
            type=click.IntRange(min=1),
            default=1,
            show_default=True,
            help=_BATCH_SIZE_HELP,
        ),
        click.option(
            "--format",
            "output_format",
            type=click.Choice(FORMATS),
            default="table",
            show_default=True,
            help="table: for people; json: stable keys for scripts; sarif: code scanning; html: a self-contained page.",
        ),
        click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help=_OUTPUT_HELP),
        click.option(
            "--html",
            "html_path",
            type=click.Path(dir_okay=False, writable=True),
            help="Also write the self-contained HTML report here, next to the chosen format.",
        ),
        click.option(
            "--fail-on",
            type=click.Choice(FAIL_ON_CHOICES),
            default=DEFAULT_FAIL_ON,
            show_default=True,
            help="partial: exit 1 unless the verdict is protected; exposed: the weaker gate (exit 1 only when less "
            "than --exposed-below of the samples' detail is certified hidden); boundary: partial, and also "
            "unless R-GAP's closed form stops (RA-i > 0); never: only other rules fail.",
        ),
        click.option("--min-ra", type=int, default=None, help=_MIN_RA_HELP),
        _level_options,
        click.option(
            "--shared-layers",
            callback=lambda ctx, param, value: _names(value),
            metavar="A,B",
            help="Only these layers' gradients are sent (label-leakage finding); default: all.",
        ),
        click.option(
            "--withheld-layers",
            callback=lambda ctx, param, value: _names(value),
            metavar="A,B",
            help="These layers' gradients are kept back (encrypted or local); the rest are sent. A name is a layer, "
            "a normalisation (bn1), any module, or one parameter (fc1.bias).",
        ),
        click.option("--quiet", "-q", is_flag=True, help="Print only errors and the verdict line."),
        click.option("--verbose", "-v", is_flag=True, help="Also print tracer details and the residual blocks found."),
    ]
    return _stacked(command, options)


def attack_options(command):
    """--samples ... --rank-precision, on `check`: what the --verify attacks run on, and how."""
    options = [
        click.option(
            "--samples",
            type=click.IntRange(min=1),
            default=4,
            show_default=True,
            help="Images to attack; --verify dp: trials (default 1000 there).",
        ),
        click.option(
            "--seed",
            type=int,
            default=0,
            show_default=True,
            help="Seed of the weights, images and labels the attacks use.",
        ),
        click.option(
            "--device",
            type=click.Choice(["auto", "cpu", "cuda"]),
            default="auto",
            show_default=True,
            help="auto: CUDA when available, else CPU.",
        ),
        click.option(
            "--data",
            metavar="DIR|FILE.npy",
            help="Samples like yours: the reference distribution of the energy certificate (default: a photograph "
            "spectrum shipped with rankaudit for C,H,W inputs; other inputs certify nothing without it) and the images to attack (default: "
            "photographs shipped with scikit-learn).",
        ),
        click.option(
            "--steps",
            type=click.IntRange(min=1),
            default=1000,
            show_default=True,
            help="Step budget of the optimisation attack.",
        ),
        click.option(
            "--artifacts", type=click.Path(file_okay=False), help="Keep originals and reconstructions (npy, PNG)."
        ),
        click.option(
            "--weights",
            "weights_file",
            metavar="FILE",
            help="Run every verifier at these weights (a state dict, or a checkpoint holding one, saved by torch.save) "
            "instead of the seeded initialisation: the weights the server sends.",
        ),
        click.option("--trials", type=click.IntRange(min=1), default=5, show_default=True, help="GDBR batches."),
        click.option(
            "--class-dist",
            type=click.Choice(["random", "uniform", "single", "imbalanced"]),
            default="random",
            show_default=True,
            help="Class mix of GDBR's victim batches.",
        ),
        click.option(
            "--aux",
            metavar="dummy|normal|digits|DIR|FILE.npy",
            help="GDBR's stand-in inputs (default: dummies uniform on [0,1], the images' range).",
        ),
        click.option(
            "--defense",
            "defenses",
            multiple=True,
            metavar="NAME[:PARAM]",
            help="Also run the --verify attacks against a defended gradient: noise[:sigma], prune[:fraction], "
            "adadefense[:beta2|eps]. Repeatable.",
        ),
        click.option(
            "--rank-precision",
            type=click.Choice(["auto", "float64", "float32"]),
            default="auto",
            show_default=True,
            help="--verify rank's arithmetic. auto: a float32 sketch, kept only when it shows full rank clearly "
            "above float32's error, else float64. float64: the reference. float32: unchecked.",
        ),
        click.option(
            "--rank-method",
            type=click.Choice(["auto", "dense", "matrix-free"]),
            default="auto",
            show_default=True,
            help="--verify rank's method. dense: a Gaussian sketch of the whole Jacobian, then its SVD. "
            "matrix-free: block Lanczos on JᵀJ from products with J and Jᵀ (one sample at a time; memory grows with "
            "the rank, not the square of the input; fastest when the rank is low). auto: dense where its sketch "
            "fits the device's memory, else matrix-free.",
        ),
        click.option(
            "--rank-budget",
            type=float,
            callback=_seconds,
            default=None,
            metavar="SECONDS",
            help="--verify rank's matrix-free check: stop each sample after this many seconds and report what was "
            "measured (the rank from below, the sample's hidden share from above) instead of the exact answer. "
            "Default: run until exact, or until its basis would outgrow the device's memory. --verify fisher: the "
            "same limit on each sample's rank check for its line with a prior.",
        ),
    ]
    return _stacked(command, options)


# How the model is built, on `check` and `suggest` (a next step's suggest command gives them again).
_RUN_CONFIG_OPTION = click.option(
    "--run-config",
    metavar='"K=V K2=V2"',
    help="APP_DIR: override the Flower app's run config, as `flwr run --run-config` does.",
)
_MODEL_ARG_OPTION = click.option(
    "--model-arg",
    "model_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="A keyword argument of the model class or factory (repeatable); in an app, VALUE may name a "
    "run-config key (num_classes=num-classes).",
)


def check_run_options(command):
    """--skip-non-models ... --model-arg, on `check`: the files it skips, its tracebacks, an app's run config and the
    model's arguments."""
    options = [
        click.option(
            "--skip-non-models",
            is_flag=True,
            help="Skip files that define no nn.Module (helper modules in a pre-commit run) instead of failing.",
        ),
        click.option("--debug", is_flag=True, help=_DEBUG_HELP),
        _RUN_CONFIG_OPTION,
        _MODEL_ARG_OPTION,
    ]
    return _stacked(command, options)


def suggest_options(command):
    """--batch-size ... --debug, on `suggest`: the batch, the edits shown, the levels, the data and the output."""
    options = [
        click.option(
            "--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True, help=_BATCH_SIZE_HELP
        ),
        click.option("--top", type=click.IntRange(min=1), default=None, help="Show the N best edits."),
        _RUN_CONFIG_OPTION,
        _MODEL_ARG_OPTION,
        click.option(
            "--target-epsilon",
            type=float,
            metavar="EPS",
            help="Also the least noise multiplier whose ε at --dp-delta is at most EPS at the round's q and T, with "
            "the Opacus line that trains to it (make_private_with_epsilon).",
        ),
        _level_options,
        click.option(
            "--data",
            metavar="DIR|FILE.npy",
            help="Samples like yours: the reference distribution the levels are read on, as in check (default: a "
            "photograph spectrum shipped with rankaudit for C,H,W inputs; other inputs certify nothing without it).",
        ),
        click.option(
            "--format",
            "output_format",
            type=click.Choice(["table", "json", "html"]),
            default="table",
            show_default=True,
            help="html: the model's full report with the suggestions as a section.",
        ),
        click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help=_OUTPUT_HELP),
        click.option("--debug", is_flag=True, help=_DEBUG_HELP),
    ]
    return _stacked(command, options)


def compare_options(command):
    """--batch-size ... --debug, on `compare`: the batch, the policy on B, the levels, the data, the output, and
    the round (as `check` takes it, for model files and over what an app folder states)."""
    options = [
        click.option(
            "--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True, help=_BATCH_SIZE_HELP
        ),
        click.option(
            "--fail-on",
            type=click.Choice(FAIL_ON_CHOICES),
            default=DEFAULT_FAIL_ON,
            show_default=True,
            help="Exit 1 when the second model fails this policy (as `check` would).",
        ),
        click.option("--min-ra", type=int, default=None, help=_MIN_RA_HELP),
        _level_options,
        click.option(
            "--data",
            metavar="DIR|FILE.npy",
            help="Samples like yours: the reference distribution both verdicts are read on, as in check (default: a "
            "photograph spectrum shipped with rankaudit for C,H,W inputs; other inputs certify nothing without it).",
        ),
        click.option(
            "--format",
            "output_format",
            type=click.Choice(["table", "json"]),
            default="table",
            show_default=True,
            help="table: for people; json: stable keys for scripts.",
        ),
        click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help=_OUTPUT_HELP),
        click.option("--debug", is_flag=True, help=_DEBUG_HELP),
        *_ROUND_OPTIONS,
    ]
    return _stacked(command, options)


def guard_options(command):
    """--weights ... --debug, on `guard`: the received weights, the client's batch, what the guard does, the output."""
    from rankaudit.settings.guard_options import ACTIONS, DEFAULT_MIN_PSNR, FEATURE_ACTIONS

    options = [
        click.option(
            "--weights",
            required=True,
            metavar="W.pt",
            help="The weights the client received this round (a state dict or checkpoint saved by torch.save).",
        ),
        click.option(
            "--data",
            required=True,
            metavar="BATCH.npz|X.npy",
            help="The client's local samples: a .npz with x and y, or a .npy of samples with --labels.",
        ),
        click.option("--labels", metavar="Y.npy", help="One integer label per sample of a .npy --data."),
        click.option(
            "--batch-size",
            "-b",
            type=click.IntRange(min=1),
            default=None,
            help="Samples per local step (default: all of --data, one step).",
        ),
        click.option(
            "--action",
            type=click.Choice(ACTIONS),
            default=None,
            help="What an update that reads a sample gets: block (default) sends nothing; drop sends it without "
            "the rows that read one; noise adds Gaussian noise to those rows.",
        ),
        click.option(
            "--min-psnr",
            type=float,
            default=None,
            metavar="DB",
            help=f"A readout at or above this PSNR against a sample reads it (default {DEFAULT_MIN_PSNR:g} dB).",
        ),
        click.option(
            "--feature-action",
            type=click.Choice(FEATURE_ACTIONS),
            default=None,
            help="A readout of features that show less of the sample than --min-psnr: send it (default; logged), "
            "drop its rows, or block.",
        ),
        click.option("--tolerance", type=float, default=None, hidden=True),  # replaced by --min-psnr: says so
        click.option(
            "--noise-scale",
            type=float,
            default=None,
            metavar="F",
            help="--action noise: the noise's norm over each offending row's own update norm (default 1).",
        ),
        click.option(
            "--energy-budget",
            type=float,
            default=None,
            metavar="SECONDS",
            help="Also measure each sample's visible energy at these weights when it fits in this time (default 0: "
            "off).",
        ),
        click.option(
            "--min-hidden",
            type=float,
            default=None,
            metavar="F",
            help="With --energy-budget: block when a sample hides less than this share of its energy (default 0.05).",
        ),
        click.option("--log", metavar="FILE", help="Append the decision as one JSON line to this file."),
        click.option(
            "--format",
            "output_format",
            type=click.Choice(["table", "json"]),
            default="table",
            show_default=True,
            help="table: for people; json: stable keys for scripts.",
        ),
        click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help=_OUTPUT_HELP),
        click.option("--debug", is_flag=True, help=_DEBUG_HELP),
    ]
    return _stacked(command, options)


def mistyped_command(word: str, commands) -> str | None:
    """`rankaudit sugest m.py`: a first word close to a command's name that names no file (not a model path)."""
    import difflib

    if word.startswith("-") or os.path.exists(word) or word.endswith(".py") or "/" in word or ":" in word:
        return None
    close = difflib.get_close_matches(word, list(commands), n=1, cutoff=0.6)
    return close[0] if close else None
