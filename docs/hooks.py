"""mkdocs hooks: the CLI reference written from the click commands, and CHANGELOG.md included as a page.

Both run at build time, offline, and import no torch: `rankaudit.cli` loads torch only inside a command.
`python docs/hooks.py` prints the CLI reference (what the build puts into docs/cli.md).
"""

from __future__ import annotations

import html
import inspect
import re
import sys
from pathlib import Path

import click

CLI_MARKER = "<!-- cli-reference -->"
CHANGELOG_MARKER = "<!-- changelog -->"
ROOT = Path(__file__).resolve().parent.parent


def _text(value: str) -> str:
    """Help text as Markdown that shows it literally (click's \\b no-rewrap marks dropped)."""
    value = value.replace("\b\n", "").replace("\b", "")
    value = html.escape(value, quote=False)
    return re.sub(r"([\\`*_\[\]])", r"\\\1", value)


def _command_markdown(command: click.Command, path: list[str], level: int) -> list[str]:
    ctx = click.Context(command, info_name=" ".join(path))
    lines = [f"{'#' * level} `{' '.join(path)}`", ""]
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines += ["```", f"{' '.join(path)} {usage}".rstrip(), "```", ""]
    if command.help:
        # click's \b line keeps the next paragraph as written: drop the marker, keep the paragraph.
        help_text = inspect.cleandoc(re.sub("[ \t]*\b\n", "", command.help))
        lines += ["```text", help_text, "```", ""]
    params = command.get_params(ctx)  # with click's own -h/--help
    arguments = [p for p in params if isinstance(p, click.Argument)]
    options = [p for p in params if isinstance(p, click.Option)]
    if arguments:
        lines += ["Arguments: " + ", ".join(f"`{a.make_metavar(ctx)}`" for a in arguments), ""]
    if options:
        from rankaudit.settings.help import EXIT_CODES, GROUPS, UNGROUPED, examples_text, group_of

        by_group: dict[str, list[str]] = {}
        for option in options:
            record = option.get_help_record(ctx)
            if record is None:  # a hidden option
                continue
            names, help_text = record
            cell = _text(help_text).replace("|", "\\|").replace("\n", " ")
            by_group.setdefault(group_of(option), []).append(f"| `{names}` | {cell} |")
        for group in (*GROUPS, UNGROUPED):
            if by_group.get(group):
                lines += [f"**{group}**", "", "| option | what it does |", "|---|---|", *by_group[group], ""]
        if command.name in EXIT_CODES:
            lines += [f"Exit codes: {_text(EXIT_CODES[command.name])}", ""]
        if examples_text(command.name):
            lines += ["Examples:", "", "```text", examples_text(command.name), "```", ""]
    if isinstance(command, click.Group):
        for name in sorted(command.commands):
            lines += _command_markdown(command.commands[name], [*path, name], level + 1)
    return lines


def cli_reference() -> str:
    """Every command of `rankaudit.cli.cli`, its usage, help and options, as Markdown."""
    if str(ROOT) not in sys.path:  # document this checkout, installed or not (mkdocs may run outside its venv)
        sys.path.insert(0, str(ROOT))
    from rankaudit.cli import cli

    return "\n".join(_command_markdown(cli, ["rankaudit"], 2)) + "\n"


def changelog() -> str:
    """CHANGELOG.md, its links to docs/ pages made relative to the site."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    return text.replace("](docs/", "](")


def on_page_markdown(markdown: str, page, config, files) -> str:
    if CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if CHANGELOG_MARKER in markdown:
        markdown = markdown.replace(CHANGELOG_MARKER, changelog())
    return markdown


if __name__ == "__main__":
    print(cli_reference(), end="")
