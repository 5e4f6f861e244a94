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


_MEASURED: dict[tuple, tuple] = {}


def measured_rank(example: str, batch_size: int = 1, seed: int = 0):
    """An example's static Result and its measured rank(∂g/∂x) at uniform random inputs (spec §10), computed once
    per test session: the sketches of 3x32x32 models take most of a minute each on two cores."""
    key = (example, batch_size, seed)
    if key not in _MEASURED:
        from rankaudit.audit import audit
        from rankaudit.verify import rank
        from rankaudit.verify.runner import build_real_model

        spec = str(EXAMPLES / f"{example}.py")
        result = audit(spec, batch_size=batch_size)
        model, _ = build_real_model(spec, result.input_shape, seed)
        generator = torch.Generator().manual_seed(seed)
        images = torch.rand((batch_size, *result.input_shape), generator=generator, dtype=torch.float64)
        with torch.no_grad():
            logits = model(images[:1])
        loss = rank.loss_name_for(logits.numel())
        labels = rank.draw_labels(batch_size, loss, logits.numel(), seed)
        _MEASURED[key] = result, rank.measure(model, images, labels, seed=seed, loss=loss)
    return _MEASURED[key]


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
