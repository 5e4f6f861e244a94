"""Thin click layer: parse, call, print, exit code."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from rankaudit import __version__
from rankaudit.errors import RankauditError

EXIT_PASS, EXIT_POLICY, EXIT_USAGE, EXIT_MODEL = 0, 1, 2, 3
FORMATS = ("table", "json")


class _DefaultToCheck(click.Group):
    """`rankaudit model.py` means `rankaudit check model.py`."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["check", *args]
        return super().parse_args(ctx, args)


@click.group(cls=_DefaultToCheck, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="rankaudit")
def cli():
    """Predict from a PyTorch architecture whether a shared gradient lets a server reconstruct the input.

    \b
    rankaudit MODEL.py[:NAME] [options]     same as `rankaudit check ...`
    Exit codes: 0 pass, 1 policy failed, 2 usage or configuration, 3 model not loaded or traced.
    """


def _parse_shape(ctx, param, value):
    if value is None:
        return None
    from rankaudit.load import parse_input_shape

    return parse_input_shape(value)  # a UsageError reaches main() and becomes one line, exit 2


def _names(value: str | None) -> list[str] | None:
    return [name.strip() for name in value.split(",") if name.strip()] if value else None


@cli.command()
@click.argument("models", nargs=-1, required=True, metavar="MODEL.py[:NAME]...")
@click.option("--input-shape", callback=_parse_shape, metavar="C,H,W",
              help="Per-sample input shape, without the batch dimension (default: INPUT_SHAPE in the file).")
@click.option("--batch-size", "-b", type=click.IntRange(min=1), default=1, show_default=True,
              help="Samples summed into one shared gradient (spec §6).")
@click.option("--format", "output_format", type=click.Choice(FORMATS), default="table", show_default=True)
@click.option("--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Write the report here.")
@click.option("--fail-on", type=click.Choice(["never", "exposed", "boundary"]), default="exposed",
              show_default=True, help="Exit 1 when the verdict is this bad or worse.")
@click.option("--min-ra", type=int, default=None, help="Exit 1 unless RA-i >= N.")
@click.option("--shared-layers", callback=lambda ctx, param, value: _names(value), metavar="A,B",
              help="Only these layers' gradients are sent (label-leakage finding); default: all.")
@click.option("--withheld-layers", callback=lambda ctx, param, value: _names(value), metavar="A,B",
              help="These layers' gradients are kept back (encrypted or local); the rest are sent.")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
def check(models, input_shape, batch_size, output_format, output, fail_on, min_ra, shared_layers, withheld_layers,
          debug):
    """Count constraints per layer, find the critical layer and give a verdict."""
    from rankaudit.audit import audit

    results, exit_code = [], EXIT_PASS
    for spec in models:
        try:
            result = audit(spec, input_shape=input_shape, batch_size=batch_size, fail_on=fail_on, min_ra=min_ra,
                           shared_layers=shared_layers, withheld_layers=withheld_layers)
        except RankauditError as exc:
            if debug:
                raise
            _error(f"{spec}: {exc}")
            exit_code = max(exit_code, exc.exit_code)
            continue
        results.append(result)
        if not result.policy.passed:
            exit_code = max(exit_code, EXIT_POLICY)
    if results:
        _emit(results, output_format, output)
    return exit_code


def _emit(results, output_format: str, output: str | None):
    if output_format == "json":
        from rankaudit.report import json as renderer
    else:
        from rankaudit.report import table as renderer
    text = renderer.render(results)
    if output:
        Path(output).write_text(text, encoding="utf-8")
        for result in results:
            shown = "undefined" if result.ra_i is None else result.ra_i
            click.echo(f"rankaudit: {result.model}: {result.verdict}, RA-i {shown}; wrote {output}", err=True)
    else:
        click.echo(text, nl=False)


def _error(message: str):
    click.echo(f"rankaudit: error: {message}", err=True)


def main(argv: list[str] | None = None):
    """Console entry point: one-line errors and the documented exit codes."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args
    try:
        code = cli.main(args=args, prog_name="rankaudit", standalone_mode=False)
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
        _error(f"internal error while analysing: {type(exc).__name__}: {exc}; "
               "fix: rerun with --debug and report the traceback")
        sys.exit(EXIT_MODEL)
    sys.exit(code if isinstance(code, int) else EXIT_PASS)
