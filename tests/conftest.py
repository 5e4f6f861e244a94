"""Shared helpers: analyse an in-memory model, and run the CLI in-process with its exit code."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rankaudit import findings
from rankaudit.analysis import analyze
from rankaudit.cli import main
from rankaudit.result import Result
from rankaudit.trace import trace_model

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


def analyse_module(build, input_shape, batch_size: int = 1) -> Result:
    """Build the model on meta (as the CLI does) and run the counting rules on it."""
    with torch.device("meta"):
        model = build()
    traced = trace_model(model, tuple(input_shape))
    result = analyze(traced, batch_size, model="test", model_name=type(model).__name__,
                     input_shape=tuple(input_shape))
    return findings.apply_findings(result, traced)


def row(result: Result, name: str):
    matches = [r for r in result.layers if r.name == name]
    assert matches, f"no row {name}; rows: {[r.name for r in result.layers]}"
    return matches[0]


@pytest.fixture
def run_cli(capsys):
    """Run `rankaudit ARGS` in-process; return (exit code, stdout, stderr)."""

    def run(*args: str):
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        captured = capsys.readouterr()
        return exit_info.value.code, captured.out, captured.err

    return run
