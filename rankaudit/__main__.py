"""Entry point for `python -m rankaudit`."""

from rankaudit.cli import run

run()
