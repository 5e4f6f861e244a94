"""What a user reads speaks the user's words: no spec sections, issue numbers or talk of how the project was made,
in the documentation, `--help`, or a report."""

import re

import pytest
from click.testing import CliRunner
from conftest import EXAMPLES, REPO

from rankaudit.cli import cli

# The spec is not shipped, issues are the project's history (CHANGELOG.md holds it), and the rest is process talk.
_NOT_THE_READERS = re.compile(
    r"spec §|§ ?\d|\bissues? #?\d+|\(#\d+\)|the old gate|old, weaker|lent to this task|no GPU (?:was |machine was )?lent"
    r"|\bthis task\b|\bthe issue's\b|^issue$",
    re.I,
)


def _offending(text: str, where: str) -> list[str]:
    return [f"{where}: {line.strip()[:160]}" for line in text.splitlines() if _NOT_THE_READERS.search(line)]


def test_the_pattern_catches_what_it_should():
    for line in (
        "see spec §14",
        "(§9 at batch size 1)",
        "since issue 21",
        "the old gate",
        "no GPU was lent to this task",
    ):
        assert _offending(line, "x"), line
    assert not _offending("each sample's level; `RA010` warning 7.0", "x")


def test_docs_and_readme_speak_the_readers_words():
    pages = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
    found = [hit for page in pages for hit in _offending(page.read_text(encoding="utf-8"), page.name)]
    assert found == []


def test_help_of_every_command_speaks_the_readers_words():
    found = []
    for args in ([], *([name] for name in cli.commands)):
        text = CliRunner().invoke(cli, [*args, "--help"], terminal_width=400).output
        assert "Usage:" in text
        found += _offending(text, " ".join(["rankaudit", *args, "--help"]))
    assert found == []


@pytest.mark.parametrize(
    "args",
    [
        ("examples/cnn6.py", "--format", "table"),
        ("examples/cnn6.py", "--format", "sarif"),
        ("examples/cnn6.py", "--format", "html"),
        ("examples/fig2_e.py", "--local-samples", "4", "--batch-size", "2"),
        ("examples/cnn6.py", "--dp-noise", "1.0", "--max-reconstruction", "0.05"),
        ("suggest", "examples/cnn6.py"),
    ],
    ids=["table", "sarif", "html", "round", "dp", "suggest"],
)
def test_reports_speak_the_readers_words(run_cli, args):
    code, out, err = run_cli(*(a.replace("examples/", f"{EXAMPLES}/") for a in args))
    assert code in (0, 1), err
    assert len(out) > 500  # a whole report, not an error line
    assert _offending(out + err, " ".join(args)) == []
