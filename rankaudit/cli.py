"""Thin click layer: parse, call, print, exit code."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path

import click

from rankaudit import __version__, supervise
from rankaudit import output as report_files
from rankaudit.errors import Interrupted, ModelEndedProcess, NoModelInFile, RankauditError, UsageError
from rankaudit.levels import DEFAULT_FAIL_ON, FAIL_ON_CHOICES

EXIT_PASS, EXIT_POLICY, EXIT_USAGE, EXIT_MODEL = 0, 1, 2, 3
FORMATS = ("table", "json", "sarif", "html")


class _DefaultToCheck(click.Group):
    """`rankaudit model.py` means `rankaudit check model.py`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["check", *args]
        return super().parse_args(ctx, args)

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:  # before click turns it into Abort (exit 2, and a blank line)
            raise Interrupted("interrupted (Ctrl-C); no report was written") from exc


@click.group(cls=_DefaultToCheck, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rankaudit")
def cli():
    """Predict from a PyTorch architecture whether a shared gradient lets a server reconstruct the input.

    \b
    rankaudit MODEL.py[:NAME] [options]     same as `rankaudit check ...`
    Exit codes: 0 pass, 1 policy failed, 2 usage or configuration, 3 model not loaded, traced or verified (or it
    ended the process, or overran --timeout), 130 interrupted.
    """


def _parse_shape(ctx, param, value):
    if value is None:
        return None
    from rankaudit.load import parse_input_shape

    return parse_input_shape(value)  # a UsageError reaches main() and becomes one line, exit 2


def _parse_dtype(ctx, param, value):
    if value is None:
        return None
    from rankaudit.load import parse_input_dtype

    return parse_input_dtype(value)  # a UsageError reaches main() and becomes one line, exit 2


def _names(value: str | None) -> list[str] | None:
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
        help="Rounds of the whole training (default 1); DP composes over them.",
    ),
    click.option(
        "--available-clients",
        type=int,
        default=None,
        metavar="M",
        help="Clients the server samples each round's C from (default C); client-level DP's q = C/M.",
    ),
]
ROUND_FLAGS = (
    "local_samples",
    "local_epochs",
    "lr",
    "optimizer",
    "momentum",
    "clients",
    "server_rounds",
    "available_clients",
)


def _round_options(command):
    for option in reversed(_ROUND_OPTIONS):
        command = option(command)
    return command


# --- differential privacy (spec §13): the DP options of `check` and `suggest`, and how they merge with the config --


def _dp_options(command):
    """--dp-noise ... --max-reconstruction, on `check` and `suggest`. Values are checked by rankaudit.dp.check_option
    (one-line errors, exit 2); the names mirror [tool.rankaudit.dp] (without the --dp- prefix)."""
    options = [
        click.option(
            "--dp-noise",
            type=float,
            metavar="SIGMA",
            help="DP noise multiplier σ: noise std over the clip norm. Adds the DP section (spec §13).",
        ),
        click.option("--dp-clip", type=float, metavar="C", help="DP clip norm c (default 1.0)."),
        click.option(
            "--dp-sample-rate",
            type=float,
            metavar="Q",
            help="Poisson sampling rate of a unit per step (default 1: every step).",
        ),
        click.option(
            "--dp-steps",
            type=int,
            metavar="T",
            help="Steps (rounds at the client level) a unit can take part in (default 1).",
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


def _timeout_option(command):
    """--timeout: the limit on each of the model's import, build and trace (supervise.py ends one that overruns)."""
    return click.option(
        "--timeout",
        type=click.FloatRange(min=0, min_open=True),
        default=None,
        metavar="SECONDS",
        expose_value=False,
        is_eager=True,
        callback=lambda ctx, param, value: supervise.set_flag_timeout(value),
        help=f"Stop a model whose import, build or trace takes longer (default: [tool.rankaudit] "
        f"timeout, else {supervise.DEFAULT_TIMEOUT:g}); exit 3.",
    )(command)


def _round(
    ctx: click.Context,
    batch_size: int,
    configured: dict | None,
    dp_options: dict | None = None,
    dp_configured: dict | None = None,
):
    """The round from this command's flags and the configuration's table (flags win), with the DP settings from
    `dp_options` (the DP flags) over `dp_configured` ([tool.rankaudit.dp]): q and T follow the round unless given."""
    from rankaudit.dp import settings_from
    from rankaudit.round import build_round

    flags = {name: ctx.params.get(name) for name in ROUND_FLAGS}
    values = _dp_values(dp_options or {}, dp_configured)
    return build_round(
        {**flags, "batch_size": batch_size},
        configured,
        dp=settings_from(values),
        dp_given=_dp_sources(dp_options or {}, dp_configured),
    )


_DP_FLAGS = {
    "noise": "dp_noise",
    "clip": "dp_clip",
    "sample-rate": "dp_sample_rate",
    "steps": "dp_steps",
    "delta": "dp_delta",
    "level": "dp_level",
    "prior": "prior",
    "max-reconstruction": "max_reconstruction",
    "noise-by": "noise_by",
}


def _dp_values(options: dict, configured: dict | None) -> dict:
    """The DP options keyed as in [tool.rankaudit.dp]: the config's, then the flags' over them (flags win)."""
    from rankaudit.dp import check_option

    merged = dict(configured or {})
    for key, parameter in _DP_FLAGS.items():
        if options.get(parameter) is not None:
            merged[key] = check_option(key, options[parameter])
    return merged


def _dp_sources(options: dict, configured: dict | None) -> dict[str, str]:
    """Where q and T were given (DPSettings field -> the flag or the config key); absent ones follow the round."""
    sources = {}
    for key, field in (("sample-rate", "sample_rate"), ("steps", "steps")):
        if options.get(_DP_FLAGS[key]) is not None:
            sources[field] = f"--dp-{key}"
        elif configured and key in configured:
            sources[field] = f"[tool.rankaudit.dp] {key}"
    return sources


def _noise_suggestion(options: dict, configured: dict | None, round_=None):
    """`suggest` with DP options: the least σ meeting --max-reconstruction at q and T, from the round unless given
    (None without DP options)."""
    from rankaudit.dp import noise_search

    return noise_search(_dp_values(options, configured), round_, _dp_sources(options, configured))


def _deployment(ctx: click.Context, spec: str, options: dict, run_config: str | None, model_args: tuple[str, ...]):
    """`rankaudit DIR`: the app's round, DP and model (rankaudit.deploy), this command's flags over them; None for a
    model file."""
    if not Path(spec).is_dir():
        if run_config:
            raise UsageError(
                "--run-config overrides a Flower app's run config",
                "give the app's directory, e.g. `rankaudit . --run-config ...`, or drop --run-config",
            )
        return None
    from rankaudit.deploy import Overrides, read_deployment

    flags = {name: ctx.params.get(name) for name in ROUND_FLAGS}
    if ctx.get_parameter_source("batch_size") is click.core.ParameterSource.COMMANDLINE:
        flags["batch_size"] = ctx.params["batch_size"]
    return read_deployment(
        Path(spec),
        Overrides(
            round=flags,
            dp=_dp_values(options, None),
            run_config=run_config,
            model_args=model_args,
            input_shape_given=ctx.params.get("input_shape") is not None,
        ),
    )


def _as_layers(names: list[str] | None, result) -> list[str] | None:
    """State-dict keys (`fc1.weight`) as the layer names the verifiers match (`fc1`)."""
    from rankaudit.audit import layer_of

    layers = [row.name for row in result.layers]
    return [layer_of(name, layers) for name in names] if names else names


def _model_args(deployment, model_args: tuple[str, ...]) -> dict | None:
    """The factory's keyword arguments: the deployment's (resolved there), else --model-arg KEY=VALUE."""
    if deployment is not None:
        return deployment.model_args or None
    from rankaudit.deploy import parse_value

    parsed = {}
    for text in model_args:
        key, sep, value = text.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageError(f"--model-arg {text!r} is not KEY=VALUE", "write e.g. --model-arg num_classes=10")
        parsed[key.strip()] = parse_value(value.strip())
    return parsed or None


@cli.command()
@click.argument("models", nargs=-1, required=True, metavar="MODEL.py[:NAME]|APP_DIR...")
@click.option(
    "--input-shape",
    callback=_parse_shape,
    metavar="C,H,W",
    help="Per-sample input shape, without the batch dimension (default: config, then INPUT_SHAPE).",
)
@click.option(
    "--input-dtype",
    callback=_parse_dtype,
    metavar="DTYPE",
    help="Input dtype: int64 for token ids (unknowns start at the embedding), or NAME=DTYPE pairs for "
    "several inputs (default: INPUT_DTYPE, else float32).",
)
@click.option(
    "--batch-size",
    "-b",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Samples summed into one shared gradient (spec §6).",
)
@click.option("--format", "output_format", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Write the report here.")
@click.option(
    "--html",
    "html_path",
    type=click.Path(dir_okay=False, writable=True),
    help="Also write the self-contained HTML report here, next to the chosen format.",
)
@click.option(
    "--fail-on",
    type=click.Choice(FAIL_ON_CHOICES),
    default=DEFAULT_FAIL_ON,
    show_default=True,
    help="partial: exit 1 unless the verdict is protected; exposed: the old, weaker "
    "gate (exit 1 only without a certified deficit); boundary: partial, and also "
    "unless R-GAP's closed form stops (RA-i > 0); never: only other rules fail.",
)
@click.option("--min-ra", type=int, default=None, help="Exit 1 unless RA-i >= N.")
@click.option(
    "--max-recoverable",
    type=click.FloatRange(0, 1),
    default=None,
    metavar="F",
    help="The ceiling on each sample's recoverable fraction (rank bound / unknowns, spec §14) for the "
    "verdict protected; above it a certified deficit is only partial (default 0.5).",
)
@click.option(
    "--shared-layers",
    callback=lambda ctx, param, value: _names(value),
    metavar="A,B",
    help="Only these layers' gradients are sent (label-leakage finding); default: all.",
)
@click.option(
    "--withheld-layers",
    callback=lambda ctx, param, value: _names(value),
    metavar="A,B",
    help="These layers' gradients are kept back (encrypted or local); the rest are sent.",
)
@click.option("--quiet", "-q", is_flag=True, help="Print only errors and the verdict line.")
@click.option("--verbose", "-v", is_flag=True, help="Also print tracer details and the residual blocks found.")
@click.option(
    "--verify",
    "verify",
    multiple=True,
    type=click.Choice(["rgap", "gdbr", "rank", "dager", "dp", "bias"]),
    help="Also run the attack: rgap (input reconstruction; inverting gradients where R-GAP cannot go), "
    "gdbr (label recovery from one shared hidden layer) or rank (the numerical rank of the shared "
    "gradient's Jacobian in the input: the exact answer, any architecture). Needs the [verify] extra. "
    "dager: a language model's token set from the span of a first-block projection's gradient "
    "(DAGER's test; random token batches of the vocabulary). dp: the informed attack on the DP noise "
    "of --dp-noise ..., its success rate beside the bound B(1/M) (needs the [dp] extra). bias: the "
    "bias readout (Qian et al.): which samples of the batch or round a unit's weight update divided "
    "by its bias update gives exactly (rgap on a batch or a round runs it first).",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=4,
    show_default=True,
    help="Images to attack; --verify dp: trials (default 1000 there).",
)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--device",
    type=click.Choice(["auto", "cpu", "cuda"]),
    default="auto",
    show_default=True,
    help="auto: CUDA when available, else CPU.",
)
@click.option(
    "--data", metavar="DIR|FILE.npy", help="Images to attack (default: photographs shipped with scikit-learn)."
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=1000,
    show_default=True,
    help="Step budget of the optimisation attack.",
)
@click.option("--artifacts", type=click.Path(file_okay=False), help="Keep originals and reconstructions (npy, PNG).")
@click.option("--trials", type=click.IntRange(min=1), default=5, show_default=True, help="GDBR batches.")
@click.option(
    "--class-dist",
    type=click.Choice(["random", "uniform", "single", "imbalanced"]),
    default="random",
    show_default=True,
    help="Class mix of GDBR's victim batches.",
)
@click.option(
    "--aux",
    metavar="dummy|normal|digits|DIR|FILE.npy",
    help="GDBR's stand-in inputs (default: dummies uniform on [0,1], the images' range).",
)
@click.option(
    "--defense",
    "defenses",
    multiple=True,
    metavar="NAME[:PARAM]",
    help="Also run the --verify attacks against a defended gradient: noise[:sigma], prune[:fraction], "
    "adadefense[:beta2|eps]. Repeatable.",
)
@click.option(
    "--rank-precision",
    type=click.Choice(["auto", "float64", "float32"]),
    default="auto",
    show_default=True,
    help="--verify rank's arithmetic. auto: a float32 sketch, kept only when it shows full rank clearly "
    "above float32's error, else float64. float64: the reference. float32: unchecked.",
)
@click.option(
    "--skip-non-models",
    is_flag=True,
    help="Skip files that define no nn.Module (helper modules in a pre-commit run) instead of failing.",
)
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.option(
    "--run-config",
    metavar='"K=V K2=V2"',
    help="APP_DIR: override the Flower app's run config, as `flwr run --run-config` does.",
)
@click.option(
    "--model-arg",
    "model_args",
    multiple=True,
    metavar="KEY=VALUE",
    help="A keyword argument of the model class or factory (repeatable); in an app, VALUE may name a "
    "run-config key (num_classes=num-classes).",
)
@_dp_options
@_round_options
@_timeout_option
@click.pass_context
def check(
    ctx,
    models,
    input_shape,
    batch_size,
    output_format,
    output,
    html_path,
    fail_on,
    min_ra,
    max_recoverable,
    shared_layers,
    withheld_layers,
    quiet,
    verbose,
    verify,
    samples,
    seed,
    device,
    data,
    steps,
    artifacts,
    trials,
    class_dist,
    aux,
    defenses,
    rank_precision,
    skip_non_models,
    debug,
    input_dtype,
    dp_candidates,
    run_config,
    model_args,
    **options,
):
    """Count constraints per layer, find the critical layer and give a verdict.

    Settings come from the command line, else from [tool.rankaudit] in the nearest pyproject.toml above the
    model file, else from the defaults. APP_DIR (a Flower app, an NVFlare job): the model, the round and its DP are
    read from the app, each with its source; flags and [tool.rankaudit.*] win over what is read.
    """
    from rankaudit.audit import audit
    from rankaudit.config import load_settings
    from rankaudit.load import split_model_spec

    if defenses and not set(verify) - {"dp"}:
        raise UsageError("--defense needs an attack to defend against", "add --verify rgap and/or --verify gdbr")
    if dp_candidates is not None and "dp" not in verify:
        raise UsageError(
            "--dp-candidates sets the candidates of --verify dp", "add --verify dp or drop --dp-candidates"
        )
    report_files.check_outputs(output, html_path, artifacts)
    given = {
        name
        for name in (
            "input_shape",
            "batch_size",
            "fail_on",
            "min_ra",
            "max_recoverable",
            "shared_layers",
            "withheld_layers",
        )
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }
    results, exit_code = [], EXIT_PASS
    for spec in models:
        try:
            deployment = _deployment(ctx, spec, options, run_config, model_args)
            spec = deployment.model if deployment is not None else spec
            settings = load_settings(split_model_spec(spec)[0])
            supervise.set_config_timeout(settings.timeout)

            def pick(name, value, settings=settings):
                # A flag given on the command line wins; else the model's [tool.rankaudit] value, if it has one.
                return value if name in given or getattr(settings, name) is None else getattr(settings, name)

            # One value for the whole run: the round, with its DP settings, handed to every step.
            round_ = (
                deployment.round
                if deployment is not None
                else _round(ctx, pick("batch_size", batch_size), settings.round, options, settings.dp)
            )
            withheld = pick("withheld_layers", withheld_layers)
            if deployment is not None and not withheld and not pick("shared_layers", shared_layers):
                withheld = deployment.withheld_layers  # NVFlare's ExcludeVars
            arguments = _model_args(deployment, model_args)
            if arguments and verify:
                raise UsageError(
                    "--verify builds the model without the factory's arguments (not supported yet)",
                    "verify through a zero-argument factory that passes them: PATH:factory",
                )
            result = audit(
                spec,
                input_shape=pick("input_shape", input_shape),
                round_=round_,
                batch_size=round_.batch_size,
                fail_on=pick("fail_on", fail_on),
                min_ra=pick("min_ra", min_ra),
                max_recoverable=pick("max_recoverable", max_recoverable),
                shared_layers=pick("shared_layers", shared_layers),
                withheld_layers=withheld,
                input_dtype=input_dtype,
                model_args=arguments,
            )
            if deployment is not None:
                from rankaudit.result import DeploymentRead

                result.deployment = DeploymentRead(
                    deployment.kind, os.path.relpath(deployment.root), deployment.settings, deployment.notes
                )
            if "dp" in verify:
                _run_dp_attack(
                    result,
                    spec,
                    round_.dp,
                    candidates=dp_candidates,
                    seed=seed,
                    device=device,
                    data=data,
                    trials=samples
                    if ctx.get_parameter_source("samples") is click.core.ParameterSource.COMMANDLINE
                    else None,
                )
            if set(verify) - {"dp"}:
                _run_verifiers(
                    result,
                    spec,
                    [attack for attack in verify if attack != "dp"],
                    samples=samples,
                    seed=seed,
                    device=device,
                    data=data,
                    steps=steps,
                    artifacts=artifacts,
                    trials=trials,
                    class_dist=class_dist,
                    aux=aux,
                    defenses=defenses,
                    several=len(models) > 1,
                    show_progress=not quiet,
                    shared_layers=_as_layers(pick("shared_layers", shared_layers), result),
                    withheld_layers=_as_layers(withheld, result),
                    rank_precision=rank_precision,
                )
        except Exception as raised:
            exc = raised if isinstance(raised, RankauditError) else _model_fault(raised)
            if exc is None or (debug and not isinstance(raised, RankauditError)):
                raise
            if skip_non_models and isinstance(exc, NoModelInFile):
                if verbose:
                    click.echo(f"rankaudit: skipped {spec}: {exc.problem}", err=True)
                continue
            if debug:
                raise
            _error(f"{spec}: {exc}")
            exit_code = max(exit_code, exc.exit_code)
            continue
        results.append(result)
        if not result.policy.passed:
            exit_code = max(exit_code, EXIT_POLICY)
    if results:
        _emit(results, output_format, output, quiet=quiet, verbose=verbose)
        if html_path:
            from rankaudit.report import html

            report_files.write_file(html_path, html.render(results))
            if not quiet:
                click.echo(f"rankaudit: wrote the HTML report to {html_path}", err=True)
    return exit_code


@cli.command("suggest")
@click.argument("model", metavar="MODEL.py[:NAME]")
@click.option("--input-shape", callback=_parse_shape, metavar="C,H,W")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--top", type=click.IntRange(min=1), default=None, help="Show the N best edits.")
@click.option(
    "--max-recoverable",
    type=click.FloatRange(0, 1),
    default=None,
    metavar="F",
    help="The ceiling on the recoverable fraction for protected (default 0.5).",
)
@click.option(
    "--format",
    "output_format",
    type=click.Choice(["table", "json", "html"]),
    default="table",
    show_default=True,
    help="html: the model's full report with the suggestions as a section.",
)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True))
@click.option("--debug", is_flag=True)
@_dp_options
@_round_options
@_timeout_option
@click.pass_context
def suggest_command(
    ctx, model, input_shape, batch_size, top, max_recoverable, output_format, output, debug, dp_candidates, **options
):
    """Single architectural edits, re-bounded and ranked by each sample's recoverable fraction they reach (spec
    §14); the batch sizes at which the batch as a whole is certified and protected (no batch size protects a
    sample; accuracy is not measured); with DP options and --max-reconstruction, also the least noise multiplier
    that meets it, and when only noise can protect a sample, it says so.

    With a round (--local-samples, --local-epochs, --clients, ... or [tool.rankaudit.round]): also the N, E and C
    at which each sample is protected (N and C never are; the round as a whole is reported beside).
    """
    from rankaudit.config import load_settings
    from rankaudit.load import split_model_spec
    from rankaudit.report import design
    from rankaudit.suggest import suggest

    if dp_candidates is not None:
        raise UsageError(
            "--dp-candidates sets the candidates of --verify dp, which suggest does not run", "drop --dp-candidates"
        )
    report_files.check_outputs(output)
    settings = load_settings(split_model_spec(model)[0])
    supervise.set_config_timeout(settings.timeout)
    # As `check` reads them: the flag where given, else [tool.rankaudit] (its [[tool.rankaudit.models]] input shape,
    # its batch-size or [tool.rankaudit.round]'s), else the default.
    commandline = {
        name
        for name in ("input_shape", "batch_size", "max_recoverable")
        if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
    }

    def pick(name, value):
        return value if name in commandline or getattr(settings, name) is None else getattr(settings, name)

    input_shape, batch_size = pick("input_shape", input_shape), pick("batch_size", batch_size)
    max_recoverable = pick("max_recoverable", max_recoverable)
    whole_round = _round(ctx, batch_size, settings.round)
    noise = _noise_suggestion(options, settings.dp, whole_round)
    given = any(options.get(name) is not None for name in ROUND_FLAGS) or settings.round
    round_ = whole_round if given else None
    report = dataclasses.replace(
        suggest(model, input_shape=input_shape, batch_size=batch_size, max_recoverable=max_recoverable, round_=round_),
        noise=noise,
    )
    if output_format == "html":
        from rankaudit.audit import audit
        from rankaudit.report import html

        result = audit(
            model, input_shape=input_shape, batch_size=batch_size, max_recoverable=max_recoverable, round_=round_
        )
        shown = dataclasses.replace(report, suggestions=report.suggestions[:top])
        text = html.render([result], suggestions={result.model: shown})
    else:
        text = (
            design.render_json(design.suggest_dict(report, top))
            if output_format == "json"
            else design.suggest_table(report, top)
        )
    _write(text, output)
    return EXIT_PASS


@cli.command("compare")
@click.argument("first", metavar="A.py[:NAME]")
@click.argument("second", metavar="B.py[:NAME]")
@click.option("--input-shape", callback=_parse_shape, metavar="C,H,W")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--fail-on", type=click.Choice(FAIL_ON_CHOICES), default=DEFAULT_FAIL_ON, show_default=True)
@click.option("--min-ra", type=int, default=None)
@click.option(
    "--max-recoverable",
    type=click.FloatRange(0, 1),
    default=None,
    metavar="F",
    help="The ceiling on the recoverable fraction for protected (default 0.5).",
)
@click.option("--format", "output_format", type=click.Choice(["table", "json"]), default="table", show_default=True)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True))
@click.option("--debug", is_flag=True)
@_timeout_option
@click.pass_context
def compare_command(
    ctx, first, second, input_shape, batch_size, fail_on, min_ra, max_recoverable, output_format, output, debug
):
    """Two designs side by side; the exit code is the policy applied to the second (B).

    Each model's settings come from the command line, else from [tool.rankaudit] in the nearest pyproject.toml above
    its file (as `check` reads them), else from the defaults.
    """
    from rankaudit.audit import audit
    from rankaudit.config import load_settings
    from rankaudit.load import split_model_spec
    from rankaudit.report import design

    report_files.check_outputs(output)
    given = {
        "input_shape": input_shape,
        "batch_size": batch_size,
        "fail_on": fail_on,
        "min_ra": min_ra,
        "max_recoverable": max_recoverable,
    }
    results = []
    for spec in (first, second):
        settings = load_settings(split_model_spec(spec)[0])  # a malformed pyproject is a one-line exit 2
        supervise.set_config_timeout(settings.timeout)
        chosen = {
            name: value
            if ctx.get_parameter_source(name) is click.core.ParameterSource.COMMANDLINE
            or getattr(settings, name, None) is None
            else getattr(settings, name)
            for name, value in given.items()
        }
        results.append(
            audit(spec, **chosen, shared_layers=settings.shared_layers, withheld_layers=settings.withheld_layers)
        )
    text = (
        design.render_json(design.compare_dict(*results)) if output_format == "json" else design.compare_table(*results)
    )
    _write(text, output)
    return EXIT_PASS if results[1].policy.passed else EXIT_POLICY


def _write(text: str, output: str | None):
    if output:
        report_files.write_file(output, text)
        click.echo(f"rankaudit: wrote {output}", err=True)
    else:
        supervise.write_stdout(text)


def _run_dp_attack(result, spec, dp_settings, *, candidates, seed, device, data, trials):
    """--verify dp: the informed attack on the DP noise; the interval above the bound is an internal error."""
    if dp_settings is None:
        raise UsageError(
            "--verify dp attacks the DP noise, but no noise multiplier is given",
            "add --dp-noise σ (and --dp-clip, --dp-sample-rate, --dp-steps as trained)",
        )
    from rankaudit.verify.attacks import dp as dp_attack

    measured = dp_attack.verify_dp(
        result,
        spec,
        dp_settings,
        candidates=dp_attack.DEFAULT_CANDIDATES if candidates is None else candidates,
        trials=dp_attack.DEFAULT_TRIALS if trials is None else trials,
        seed=seed,
        device=device,
        data=data,
    )
    if measured.get("internal_error"):
        _error(f"{spec}: {measured['internal_error']}")  # on stderr, never hidden by --quiet or -o


def _run_verifiers(
    result,
    spec,
    attacks,
    *,
    samples,
    seed,
    device,
    data,
    steps,
    artifacts,
    trials,
    class_dist,
    aux,
    defenses,
    several,
    show_progress,
    shared_layers=None,
    withheld_layers=None,
    rank_precision="auto",
):
    supervise.enter(f"--verify {', '.join(attacks)} of {spec}")
    round_ = result.round
    if round_ is not None and not round_.fedsgd:
        _verify_round(
            result,
            spec,
            attacks,
            seed=seed,
            device=device,
            data=data,
            steps=steps,
            artifacts=artifacts,
            defenses=defenses,
            show_progress=show_progress,
            shared_layers=shared_layers,
            withheld_layers=withheld_layers,
        )
        return
    if defenses and not {"rgap", "gdbr"} & set(attacks):
        raise UsageError(
            "--defense applies to the rgap and gdbr attacks; --verify rank measures the undefended gradient",
            "add --verify rgap and/or --verify gdbr, or drop --defense",
        )
    if "dager" in attacks:
        # Token batches need neither images nor Pillow: DAGER runs before the image attacks' extras are checked.
        if data:
            raise UsageError(
                "--verify dager draws random token batches from the vocabulary and reads no --data",
                "leave out --data with --verify dager",
            )
        from rankaudit.verify import runner

        runner.verify_tokens(result, spec, seed=seed, device=device, show_progress=show_progress)
        attacks = [attack for attack in attacks if attack != "dager"]
        if not attacks:
            return
    try:
        import PIL  # noqa: F401 - the verifier's images need Pillow

        from rankaudit.verify import runner
    except ImportError as exc:
        raise UsageError(
            f"--verify needs the verifier's extras ({exc.name} is missing)", 'pip install "rankaudit[verify]"'
        ) from exc
    if artifacts and several:
        artifacts = str(Path(artifacts) / Path(spec.rsplit(":", 1)[0]).stem)
    parsed = []
    if defenses:
        from rankaudit.verify.defenses import parse_defense

        parsed = [parse_defense(text) for text in defenses]  # a bad spec is a UsageError: exit 2
    _bias_readout(
        result,
        spec,
        attacks,
        seed=seed,
        device=device,
        data=data,
        shared_layers=shared_layers,
        withheld_layers=withheld_layers,
    )
    # Each attack runs once undefended; its defended runs reuse the same model, images and batches.
    if "rgap" in attacks:
        runner.verify_inputs(
            result,
            spec,
            samples=samples,
            seed=seed,
            device=device,
            data=data,
            steps=steps,
            artifacts=artifacts,
            show_progress=show_progress,
            defenses=parsed,
        )
    if "gdbr" in attacks:
        runner.verify_labels(
            result,
            spec,
            trials=trials,
            class_dist=class_dist,
            aux=aux,
            device=device,
            seed=seed,
            show_progress=show_progress,
            defenses=parsed,
        )
    if "rank" in attacks:
        measured = runner.verify_rank(
            result,
            spec,
            samples=samples,
            seed=seed,
            device=device,
            data=data,
            artifacts=artifacts,
            show_progress=show_progress,
            shared_layers=shared_layers,
            withheld_layers=withheld_layers,
            precision=rank_precision,
        )
        if measured.get("internal_error"):
            _error(f"{spec}: {measured['internal_error']}")  # on stderr too: never hidden by --quiet or -o
    if parsed:
        runner.verify_training_cost(result, parsed, seed=seed, show_progress=show_progress)


def _verify_round(
    result,
    spec,
    attacks,
    *,
    seed,
    device,
    data,
    steps,
    artifacts,
    defenses,
    show_progress,
    shared_layers,
    withheld_layers,
):
    """A round that is not FedSGD: the rank of its update and the FedAvg inversion; the one-gradient attacks refuse."""
    single = [attack for attack in attacks if attack in ("gdbr", "dager")]
    if single or defenses:
        what = f"--verify {single[0]}" if single else "--defense"
        from rankaudit.levels import count

        raise UsageError(
            f"{what} reads one shared gradient, and this round sends the update of "
            f"{count(result.round.steps, 'local step')} from {count(result.round.clients, 'client')}",
            "verify this round with --verify rank or --verify rgap (the FedAvg inversion), or drop the "
            "round's flags to check one gradient",
        )
    try:
        import PIL  # noqa: F401 - the verifier's images need Pillow
        import scipy  # noqa: F401 - the attack matches reconstructions to originals

        from rankaudit.verify import round_runner
    except ImportError as exc:
        raise UsageError(
            f"--verify needs the verifier's extras ({exc.name} is missing)", 'pip install "rankaudit[verify]"'
        ) from exc
    if "rgap" in attacks:  # refused up front, before the bias readout that runs first spends its time
        round_runner.check_attack_round_size(result.round, tuple(result.input_shape), steps, 2)
    _bias_readout(
        result,
        spec,
        attacks,
        seed=seed,
        device=device,
        data=data,
        shared_layers=shared_layers,
        withheld_layers=withheld_layers,
    )
    if "rgap" in attacks:
        round_runner.verify_round_inputs(
            result,
            spec,
            seed=seed,
            device=device,
            data=data,
            steps=steps,
            artifacts=artifacts,
            show_progress=show_progress,
        )
    if "rank" in attacks:
        measured = round_runner.verify_round_rank(
            result,
            spec,
            seed=seed,
            device=device,
            data=data,
            artifacts=artifacts,
            show_progress=show_progress,
            shared_layers=shared_layers,
            withheld_layers=withheld_layers,
        )
        if measured.get("internal_error"):
            _error(f"{spec}: {measured['internal_error']}")


def _bias_readout(result, spec, attacks, *, seed, device, data, shared_layers, withheld_layers):
    """--verify bias, and the readout --verify rgap runs first on a batch (B > 1) or a round (spec §14)."""
    round_ = result.round
    batch = result.batch_size > 1 or (round_ is not None and not round_.fedsgd)
    if "bias" in attacks or ("rgap" in attacks and batch):
        from rankaudit.verify.attacks import bias

        measured = bias.verify_bias(
            result,
            spec,
            seed=seed,
            device=device,
            data=data,
            shared_layers=shared_layers,
            withheld_layers=withheld_layers,
        )
        if measured.get("internal_error"):
            _error(f"{spec}: {measured['internal_error']}")  # on stderr too: never hidden by --quiet or -o


def _use_color() -> bool:
    """Colour only on a terminal (the report's stdout), and never when NO_COLOR is set (https://no-color.org)."""
    return supervise.stdout_isatty() and not os.environ.get("NO_COLOR")


def _emit(results, output_format: str, output: str | None, *, quiet: bool = False, verbose: bool = False):
    if output_format == "table":
        from rankaudit.report import table

        if quiet:
            text = "".join(f"{result.model}: {result.summary}{_dp_clause(result)}\n" for result in results)
        else:
            color = output is None and _use_color()
            text = table.render(results, color=color, verbose=verbose)
    else:
        # Only the chosen renderer: the HTML one pulls in jinja2 and networkx (a tenth of a second).
        renderer = importlib.import_module(f"rankaudit.report.{output_format}")
        text = renderer.render(results)
    if quiet and output_format == "html":
        # The page is the output (stdout or -o); --quiet's one verdict line per model goes to stderr beside it.
        for result in results:
            click.echo(f"{result.model}: {result.summary}{_dp_clause(result)}", err=True)
    if output:
        report_files.write_file(output, text)
        if not quiet:
            for result in results:
                shown = "undefined" if result.ra_i is None else result.ra_i
                click.echo(f"rankaudit: {result.model}: {result.verdict}, RA-i {shown}; wrote {output}", err=True)
    else:
        supervise.write_stdout(text)


def _dp_clause(result) -> str:
    """The DP sentence after the verdict line (--quiet), so a DP policy failure is visible there too."""
    if result.dp is None:
        return ""
    from rankaudit.findings import carried_by_sentence, dp_sentence

    carried = carried_by_sentence(result)
    return f" {dp_sentence(result.dp)}." + (f" Policy passes, {carried}." if carried else "")


def _model_fault(exc: BaseException):
    from rankaudit.load import model_fault

    return model_fault(exc)


def _error(message: str):
    click.echo(f"rankaudit: error: {message}", err=True)


def main(argv: list[str] | None = None):
    """Console entry point: one-line errors and the documented exit codes."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        try:
            code = cli.main(args=args, prog_name="rankaudit", standalone_mode=False)
        except SystemExit as exc:  # nothing of ours raises it in a command: the model's sys.exit (exit 3, not its code)
            raise _ended_process(exc) from exc
    except click.exceptions.Exit as exc:  # --help, --version
        sys.exit(exc.exit_code)
    except click.exceptions.NoArgsIsHelpError as exc:
        click.echo(exc.ctx.get_help() if exc.ctx else str(exc), err=True)
        sys.exit(EXIT_USAGE)
    except click.ClickException as exc:
        _error(f"{exc.format_message()}; fix: see 'rankaudit --help'")
        sys.exit(EXIT_USAGE)
    except click.Abort:
        _error("aborted")
        sys.exit(EXIT_USAGE)
    except RankauditError as exc:
        if debug:
            raise
        _error(str(exc))
        sys.exit(exc.exit_code)
    except Exception as exc:  # a bug of ours or an unforeseen model: still one line unless --debug
        if debug:
            raise
        fault = _model_fault(exc)
        if fault is not None:  # the model's own code raised (suggest, compare): its error, exit 3
            _error(str(fault))
            sys.exit(fault.exit_code)
        _error(
            f"internal error while analysing: {type(exc).__name__}: {exc}; "
            "fix: rerun with --debug and report the traceback"
        )
        sys.exit(EXIT_MODEL)
    sys.exit(code if isinstance(code, int) else EXIT_PASS)


def _ended_process(exc: SystemExit) -> ModelEndedProcess:
    """The model's SystemExit as one line: its code and the line that raised it (the deepest frame not of
    rankaudit, click or the standard library; the deepest of all when every frame is)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    ours = (os.path.dirname(os.path.abspath(__file__)), os.path.dirname(click.__file__), os.path.dirname(os.__file__))
    foreign = [frame for frame in frames if not os.path.abspath(frame[0]).startswith(ours)]
    where = (foreign or frames or [None])[-1]
    at = f" at {supervise.source_location(*where)}" if where is not None else ""
    phase = supervise.take_exit_phase()
    during = f" during {phase}" if phase else ""
    return ModelEndedProcess(
        f"the model file ended the process (SystemExit({exc.code!r}){at}){during}; no report was written",
        'a model file must not end the process: remove the exit call, or guard it with `if __name__ == "__main__":`',
    )


def run():
    """The `rankaudit` command (and `python -m rankaudit`): main() in a supervised child process (supervise.py), so
    that the model's code can neither end the process unseen, nor hang it, nor print into the report.

    The exit is os._exit: with torch loaded, Python's orderly shutdown takes about 0.3 s and does nothing a finished
    command needs (here the parent never loaded torch, and the child has handed back its report).
    """
    args = sys.argv[1:]
    if supervise.can_supervise() and not supervise.needs_no_child(args):
        code = supervise.run_supervised(main, args)
    else:
        try:
            main(args)
            code = EXIT_PASS
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
