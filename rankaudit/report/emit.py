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
            text = "".join(quiet_line(result) + "\n" for result in results)
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
            click.echo(quiet_line(result), err=True)
    if output:
        report_files.write_file(output, text)
        if not quiet:
            for result in results:
                shown = "undefined" if result.ra_i is None else result.ra_i
                click.echo(f"rankaudit: {result.model}: {result.verdict}, RA-i {shown}; wrote {output}", err=True)
    else:
        supervise.write_stdout(text)


def quiet_line(result) -> str:
    """--quiet's one short line per model: the verdict, the share of each sample's detail certified hidden (what the
    verdict reads), DP's bound where DP options were given, and the exit code with its reason. The full output
    has the sentences behind each."""
    from rankaudit.findings.meaning import energy_percent, per_sample_view
    from rankaudit.findings.next_step import next_step
    from rankaudit.findings.policy import short_reason
    from rankaudit.settings.levels import percent

    bound = result.identifiability
    sample = bound.sample if bound is not None else None
    each = " (each sample)" if sample is not None and per_sample_view(result) else ""
    parts = [f"{result.model}: {result.verdict}{each}"]
    if sample is not None and sample.certified_hidden_energy is not None:
        parts.append(
            f", {energy_percent(sample.certified_hidden_energy)} of the detail of "
            f"{percent(bound.certificate_quantile)} of samples certified hidden"
        )
    elif bound is not None:
        parts.append(f", rank <= {bound.rank_bound:,} of {bound.unknowns:,}")
    if result.dp is not None:
        parts.append(f"; DP: reconstruction <= {result.dp.reconstruction_bound:.3g} at prior {result.dp.prior:g}")
    policy = result.policy
    if policy is None:
        return "".join(parts)
    if policy.passed:
        carried = ", carried by the DP noise" if policy.carried_by == "noise" else ""
        parts.append(f"; exit 0: pass{carried}")
    else:
        heads = list(dict.fromkeys(short_reason(reason) for reason in policy.reasons))
        more = f", +{len(heads) - 1} more reason{'s' if len(heads) > 2 else ''}" if len(heads) > 1 else ""
        parts.append(f"; exit 1 (--fail-on {policy.fail_on}): {heads[0]}{more}")
        step = next_step(result)
        if step is not None:
            parts.append(f"; next: {step.command}")
    return "".join(parts)
