"""The command-line options that reach the model's process: its time and memory limits (--timeout, --memory-limit),
its import stand-ins (--stand-in, --no-stand-ins) and its input dtype; and which options a model's reading took, for
the commands printed for the same model."""

from __future__ import annotations

import click

from rankaudit.model import supervise
from rankaudit.settings.limits import DEFAULT_TIMEOUT, MAX_GIB, MAX_SECONDS

# Where the limit and stand-in options keep their command-line values: they are not passed to the command, and a
# command printed for the same model (the next step) gives them again.
_GIVEN = "rankaudit.given"


def _remember(ctx, param, value) -> None:
    if ctx.get_parameter_source(param.name) is click.core.ParameterSource.COMMANDLINE:
        ctx.meta.setdefault(_GIVEN, {})[param.name] = value


def parse_dtype(ctx, param, value):
    _remember(ctx, param, value)  # as written: a printed command gives it again
    if value is None:
        return None
    from rankaudit.model.input_shape import parse_input_dtype

    return parse_input_dtype(value)  # a UsageError reaches main() and becomes one line, exit 2


def _set_timeout(ctx, param, value):
    _remember(ctx, param, value)
    if value is not None:
        try:
            supervise.check_seconds(value, "--timeout")
        except ValueError as exc:
            raise click.BadParameter(
                f"must be a positive, finite number of seconds up to {MAX_SECONDS:,.0f}, e.g. 300"
            ) from exc
    supervise.set_flag_timeout(value)


def _set_memory_limit(ctx, param, value):
    _remember(ctx, param, value)
    if value is not None and not 0 <= value <= MAX_GIB:
        raise click.BadParameter(f"must be a number of GiB up to {MAX_GIB:,.0f}, e.g. 8 (0: no limit)")
    supervise.set_flag_memory_limit(value)


def limit_options(command):
    """--timeout: the limit on each of the model's import, build and trace (supervise.py ends one that overruns);
    --memory-limit: the model's process's memory (supervise.py sets it)."""
    command = click.option(
        "--memory-limit",
        type=float,
        default=None,
        metavar="GIB",
        expose_value=False,
        is_eager=True,
        callback=_set_memory_limit,
        help="Memory the model's process may take, in GiB (default: [tool.rankaudit] memory-limit, else 8 or "
        "half the machine's memory, whichever is less; 0: no limit); exceeding it is exit 3.",
    )(command)
    return click.option(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        expose_value=False,
        is_eager=True,
        callback=_set_timeout,
        help=f"Stop a model whose import, build or trace takes longer (default: [tool.rankaudit] "
        f"timeout, else {DEFAULT_TIMEOUT:g}); exit 3.",
    )(command)


def stand_in_options(command):
    """--stand-in MODULE / --no-stand-ins: what the model file may import without it being installed."""
    from rankaudit.model import standins as import_standins

    command = click.option(
        "--stand-in",
        multiple=True,
        metavar="MODULE",
        expose_value=False,
        callback=lambda ctx, param, value: _remember(ctx, param, value) or import_standins.set_flags(added=value),
        help="Import the model file with a stand-in for MODULE when it is not installed (repeatable; data, "
        "logging and FL packages have one already).",
    )(command)
    return click.option(
        "--no-stand-ins",
        is_flag=True,
        expose_value=False,
        callback=lambda ctx, param, value: (
            _remember(ctx, param, value) or import_standins.set_flags(added=None, forbidden=value)
        ),
        help="Fail on any import the model file makes of a module that is not installed.",
    )(command)


# The options a model's reading takes (beside the round and DP, which the result carries), in the order printed.
_READING = (
    ("input_shape", "--input-shape"),
    ("input_dtype", "--input-dtype"),
    ("model_args", "--model-arg"),
    ("run_config", "--run-config"),
    ("shared_layers", "--shared-layers"),
    ("withheld_layers", "--withheld-layers"),
    ("data", "--data"),
    ("max_recoverable", "--max-recoverable"),
    ("exposed_below", "--exposed-below"),
    ("certificate_quantile", "--certificate-quantile"),
    ("psnr_target", "--psnr-target"),
    ("stand_in", "--stand-in"),
    ("no_stand_ins", "--no-stand-ins"),
    ("timeout", "--timeout"),
    ("memory_limit", "--memory-limit"),
    ("batch_size", "--batch-size"),
    ("local_samples", "--local-samples"),
    ("local_epochs", "--local-epochs"),
    ("lr", "--lr"),
    ("optimizer", "--optimizer"),
    ("momentum", "--momentum"),
    ("clients", "--clients"),
    ("server_rounds", "--server-rounds"),
    ("available_clients", "--available-clients"),
    ("bn_mode", "--bn-mode"),
)


def _words(flag: str, value) -> list[tuple[str, str | None]]:
    if value is True:
        return [(flag, None)]  # a switch
    if flag in ("--input-shape", "--shared-layers", "--withheld-layers"):
        return [(flag, ",".join(str(part) for part in value))]
    if isinstance(value, (tuple, list)):  # repeatable: --model-arg K=V --model-arg K2=V2
        return [(flag, str(item)) for item in value]
    return [(flag, f"{value:g}" if isinstance(value, float) else str(value))]


def reading_flags(ctx: click.Context) -> list[tuple[str, str | None]]:
    """The options given on the command line that decide how the model was read and judged, as (flag, value)
    pairs (value None for a switch): a command printed for the same model carries them, so that it runs as pasted."""
    remembered = ctx.meta.get(_GIVEN, {})
    given = []
    for name, flag in _READING:
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.COMMANDLINE:
            continue
        value = remembered[name] if name in remembered else ctx.params.get(name)
        if value is not None and value is not False and value != ():
            given += _words(flag, value)
    return given
