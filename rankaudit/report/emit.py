"""Results -> the chosen format, written to stdout or the --output file."""

from __future__ import annotations

import importlib
import os

import click

from rankaudit.model import supervise
from rankaudit.report import files as report_files


def write(text: str, output: str | None):
    if output:
        report_files.write_file(output, text)
        click.echo(f"rankaudit: wrote {output}", err=True)
    else:
        supervise.write_stdout(text)


def _use_color() -> bool:
    """Colour only on a terminal (the report's stdout), and never when NO_COLOR is set (https://no-color.org)."""
    return supervise.stdout_isatty() and not os.environ.get("NO_COLOR")


def emit(results, output_format: str, output: str | None, *, quiet: bool = False, verbose: bool = False):
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
    from rankaudit.findings.meaning import carried_by_sentence, dp_sentence

    carried = carried_by_sentence(result)
    return f" {dp_sentence(result.dp)}." + (f" Policy passes, {carried}." if carried else "")
