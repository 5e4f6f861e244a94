"""The command-line options that reach the model's process: its time and memory limits (--timeout, --memory-limit),
its import stand-ins (--stand-in, --no-stand-ins) and its input dtype."""

from __future__ import annotations

import click

from rankaudit.model import supervise
from rankaudit.settings.limits import DEFAULT_TIMEOUT, MAX_GIB, MAX_SECONDS


def parse_dtype(ctx, param, value):
    if value is None:
        return None
    from rankaudit.model.input_shape import parse_input_dtype

    return parse_input_dtype(value)  # a UsageError reaches main() and becomes one line, exit 2


def _set_timeout(ctx, param, value):
    if value is not None:
        try:
            supervise.check_seconds(value, "--timeout")
        except ValueError as exc:
            raise click.BadParameter(
                f"must be a positive, finite number of seconds up to {MAX_SECONDS:,.0f}, e.g. 300"
            ) from exc
    supervise.set_flag_timeout(value)


def _set_memory_limit(ctx, param, value):
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
        callback=lambda ctx, param, value: import_standins.set_flags(added=value),
        help="Import the model file with a stand-in for MODULE when it is not installed (repeatable; data, "
        "logging and FL packages have one already).",
    )(command)
    return click.option(
        "--no-stand-ins",
        is_flag=True,
        expose_value=False,
        callback=lambda ctx, param, value: import_standins.set_flags(added=None, forbidden=value),
        help="Fail on any import the model file makes of a module that is not installed.",
    )(command)
