"""Result -> a readable terminal table: the header and the per-layer rows, the critical row marked; then the rest."""

from __future__ import annotations

import re

from rankaudit import __version__
from rankaudit.report.table_findings import (
    caveat_lines,
    conclusion_lines,
    dp_lines,
    label_lines,
    next_step_lines,
    policy_lines,
    readout_lines,
    round_lines,
    span_lines,
    token_lines,
)
from rankaudit.report.table_verify import defense_lines, verification_lines
from rankaudit.result import LayerRow, Result

HEADERS = ("", "layer", "op", "|x|", "|W|", "|z|", "V", "RA_i", "")
RIGHT_ALIGNED = {3, 4, 5, 6, 7}
VERDICT_COLOR = {"exposed": "31", "partial": "33", "boundary": "33", "protected": "32"}  # ANSI red, yellow, green


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color and text else text


def _notes(row: LayerRow) -> str:
    notes = []
    if row.critical:
        notes.append("<- critical")
    if row.dense:
        notes.append("dense (always recoverable)")
    if row.side:
        notes.append("side branch (gate or statistic)")
    if row.folded:
        notes.append("|W| includes " + ", ".join(row.folded))
    return "; ".join(notes)


def _round_header(result: Result) -> str:
    """The round on the header line; nothing for FedSGD, whose header the batch size already says."""
    from rankaudit.settings.round import describe

    return "" if result.round is None or result.round.fedsgd else f"  {describe(result.round)}"


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


def _input_text(result: Result) -> str:
    """3x32x32 for one float input; token ids and several inputs say what each one is."""
    if len(result.inputs) <= 1 and all(info.role == "data" for info in result.inputs):
        return _shape(result.input_shape)
    parts = []
    for info in result.inputs:
        what = {"tokens": "token ids", "mask": "mask", "ids": "ids"}.get(info.role, info.dtype)
        name = f"{info.name} " if len(result.inputs) > 1 else ""
        parts.append(f"{name}{_shape(info.shape)} {what} ({info.dtype})")
    return ", ".join(parts)


def _input_rows(result: Result) -> list[tuple[str, ...]]:
    """Token inputs start their unknowns at the embedding: a row that says so, above the counted layers."""
    rows = []
    for info in result.inputs:
        if info.role == "tokens" and info.unknowns_at and info.unknowns:
            rows.append(
                (
                    "",
                    info.unknowns_at,
                    "Embedding",
                    "-",
                    "-",
                    f"{result.batch_size * info.unknowns}",
                    "-",
                    "-",
                    f"input: {info.name} -> unknowns start here",
                )
            )
    return rows


_BUILDS = {
    "meta-parameters": "parameters on the meta device, the constructor's own arithmetic on the CPU",
    "meta": "everything on the meta device (building with CPU arithmetic failed)",
    "small-cpu": "real weights on the CPU, moved to the meta device before tracing: torch's own code needs weight "
    "values while it builds, which the meta device lacks (a CPU build is capped at 256 MB)",
}


def _verbose_lines(result: Result) -> list[str]:
    from rankaudit.settings.levels import count

    lines = [
        "",
        f"Traced with {result.tracer} in {result.seconds:.3f} s; {count(len(result.layers), 'counted layer')}, "
        f"{count(len(result.blocks), 'residual block')}.",
    ]
    if result.build in _BUILDS and result.build != "small-cpu":  # small-cpu is said on every run
        lines.append(f"Built with {_BUILDS[result.build]}.")
    if result.call_notes:
        lines.append(
            f"forward() called with {', '.join(result.call_notes)} (the logits carry the loss; caches "
            "and other outputs are not counted)."
        )
    for block in result.blocks:
        shortcut = ", ".join(block.shortcut_layers) or "identity"
        lines.append(f"  block {block.name}: main {', '.join(block.main_layers)}; shortcut {shortcut} ({block.kind})")
    uncounted = [(row.name, row.reported_params) for row in result.layers if row.reported_params]
    for name, params in uncounted:
        lines.append(f"  {name}: {params} parameters reported, not counted")
    return lines


def _deployment_lines(result: Result, width: int = 118) -> list[str]:
    """`rankaudit DIR`: each setting read and its source, wrapped; the reader's notes one per line."""
    read = result.deployment
    stood_in = (
        [
            f"Imported with stand-ins for {', '.join(result.stand_ins)} (not installed; the model does not use "
            "them). --stand-in MODULE adds one, --no-stand-ins forbids them."
        ]
        if result.stand_ins
        else []
    )
    if result.build == "small-cpu":  # the one build that allocates real weights: said on every run
        stood_in.append(f"Built with {_BUILDS[result.build]}.")
    if read is None:
        return stood_in
    items = [f"{setting} {value} ({source})" for setting, value, source in read.settings]
    lines, line = [], f"Read from the {'Flower app' if read.kind == 'flower' else 'NVFlare job'} {read.root}:"
    for item in items:
        if len(line) + len(item) + 2 > width:
            lines.append(line + ";" if not line.endswith(":") else line)
            line = "  " + item
        else:
            line += (" " if line.endswith(":") else "; ") + item
    lines.append(line)
    return stood_in + lines + [f"  note: {note}" for note in read.notes]


# Past this many layer rows the table hides rows that repeat an earlier row (same name up to its numbers, same op
# and counts): a model of many identical blocks prints its first block and one line for the rest (-v prints all).
MAX_TABLE_ROWS = 40


def _row_pattern(row: LayerRow) -> tuple:
    """What makes a row worth printing again: its name with the numbers taken out, its op and its counts."""
    return (
        re.sub(r"\d+", "#", row.name),
        row.op,
        row.inputs,
        row.weights,
        row.outputs,
        row.virtual,
        row.ra_i,
        row.dense,
        row.side,
        tuple(re.sub(r"\d+", "#", name) for name in row.folded),
    )


def _visible_rows(result: Result, verbose: bool) -> list[LayerRow | tuple[int, str, str]]:
    """The rows to print: every row, or (past MAX_TABLE_ROWS) the critical row and each first of its pattern, with
    (hidden count, first hidden, last hidden) standing for each run of repeats."""
    if verbose or len(result.layers) <= MAX_TABLE_ROWS:
        return list(result.layers)
    seen, shown, run = set(), [], []

    def close_run():
        # One hidden row would cost the line that says so: print it instead.
        shown.extend(run if len(run) == 1 else [(len(run), run[0].name, run[-1].name)] if run else [])
        run.clear()

    for row in result.layers:
        pattern = _row_pattern(row)
        if pattern in seen and not row.critical:
            run.append(row)
            continue
        seen.add(pattern)
        close_run()
        shown.append(row)
    close_run()
    return shown


def _hidden_rows_text(count: int, first: str, last: str) -> str:
    return (
        f"   ... {count:,} more rows, {first} to {last}, each repeating a row above (the same op and counts, "
        "the name up to its numbers; -v lists every row)"
    )


def render_one(result: Result, color: bool = False, verbose: bool = False) -> str:
    lines = [
        f"rankaudit {__version__}  {result.model} ({result.model_name})  input {_input_text(result)}  "
        f"batch {result.batch_size}  traced with {result.tracer}  {result.parameters:,} parameters"
        + _round_header(result),
        *_deployment_lines(result),
        *next_step_lines(result),
        "",
    ]
    visible = _visible_rows(result, verbose)
    cells = (
        [HEADERS]
        + _input_rows(result)
        + [
            (
                ">" if row.critical else "",
                row.name,
                row.op,
                f"{row.inputs}",
                f"{row.weights}",
                f"{row.outputs}",
                f"{row.virtual}",
                f"{row.ra_i}",
                _notes(row),
            )
            if isinstance(row, LayerRow)
            else row
            for row in visible
        ]
    )
    widths = [max(len(line[i]) for line in cells if len(line) == len(HEADERS)) for i in range(len(HEADERS))]
    warn = VERDICT_COLOR.get(result.verdict, "0")
    for index, line in enumerate(cells):
        if len(line) != len(HEADERS):
            lines.append(_hidden_rows_text(*line))
            continue
        padded = [cell.rjust(widths[i]) if i in RIGHT_ALIGNED else cell.ljust(widths[i]) for i, cell in enumerate(line)]
        text = "  ".join(padded).rstrip()
        if index == 0:
            text = _paint(text, "1", color)
        elif line[0] == ">":
            text = _paint(text, f"1;{warn}", color)
        lines.append(text)
    lines.append("")
    lines.extend(conclusion_lines(result, _paint(result.verdict, f"1;{warn}", color)))
    lines.extend(round_lines(result))
    lines.extend(readout_lines(result))
    if verbose:
        lines.extend(_verbose_lines(result))
    lines.extend(label_lines(result, verbose))
    lines.extend(token_lines(result))
    lines.extend(span_lines(result))
    lines.extend(dp_lines(result))
    lines.extend(verification_lines(result))
    lines.extend(defense_lines(result))
    lines.extend(caveat_lines(result, verbose))
    lines.extend(policy_lines(result))
    return "\n".join(lines) + "\n"


def render(results: list[Result], color: bool = False, verbose: bool = False) -> str:
    return "\n".join(render_one(result, color, verbose) for result in results)
