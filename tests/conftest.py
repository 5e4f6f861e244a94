"""Shared helpers: analyse an in-memory model, and run the CLI in-process with its exit code."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from rankaudit.cli import main
from rankaudit.count.analysis import analyze
from rankaudit.count.calls import trace_and_count
from rankaudit.deploy.app import Overrides
from rankaudit.findings import apply as findings
from rankaudit.result import Result

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
APPS = Path(__file__).resolve().parent / "apps"
# What an app cannot say about its round: the local samples and that the input shape is given.
APP_GIVEN = Overrides(round={"local_samples": 32}, input_shape_given=True)


@pytest.fixture
def no_flower_configuration(monkeypatch, tmp_path):
    """The Flower configuration file is the user's; each app test states its own (or none)."""
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))


def psnr(readout: np.ndarray, sample: np.ndarray) -> float:
    """PSNR of a readout against the sample, the sample's own range (max - min) as the peak: the guard's unit."""
    mse = float(np.mean((readout - sample) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(float(sample.max() - sample.min()) ** 2 / mse)


class Lambda(nn.Module):
    """A function of the input as a module, for models spelled in a test."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


def setting_rows(deployment) -> dict[str, tuple[str, str]]:
    """What an app reading printed, each setting -> (value, source)."""
    return {setting: (value, source) for setting, value, source in deployment.settings}


def line_of(path: Path, text: str) -> int:
    """The first line of `path` holding `text` (1-based): where a value read from the app must point."""
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def no_default_source(rows: dict[str, tuple[str, str]]) -> None:
    """No setting fell back to rankaudit's default (argparse defaults of the app's own script are the app's)."""
    assert not [row for row in rows.values() if "default" in row[1] and "argparse" not in row[1]], rows


def analyse_module(build, input_shape, batch_size: int = 1) -> Result:
    """Build the model on meta (as the CLI does) and run the counting rules on it."""
    with torch.device("meta"):
        model = build()
    traced = trace_and_count(model, tuple(input_shape))
    result = analyze(traced, batch_size, model="test", model_name=type(model).__name__, input_shape=tuple(input_shape))
    return findings.apply_findings(result, traced)


_MEASURED: dict[tuple, tuple] = {}


def measured_rank(example: str, batch_size: int = 1, seed: int = 0):
    """An example's static Result and its measured rank(∂g/∂x) at uniform random inputs (method.md: numerical check), computed once
    per test session: the sketches of 3x32x32 models take most of a minute each on two cores."""
    key = (example, batch_size, seed)
    if key not in _MEASURED:
        from rankaudit.audit import audit
        from rankaudit.verify.client import draw_labels, loss_name_for
        from rankaudit.verify.model import build_real_model
        from rankaudit.verify.rank import jacobian as rank

        spec = str(EXAMPLES / f"{example}.py")
        result = audit(spec, batch_size=batch_size)
        model, _ = build_real_model(spec, result.input_shape, seed)
        generator = torch.Generator().manual_seed(seed)
        images = torch.rand((batch_size, *result.input_shape), generator=generator, dtype=torch.float64)
        with torch.no_grad():
            logits = model(images[:1])
        loss = loss_name_for(logits.numel())
        labels = draw_labels(batch_size, loss, logits.numel(), seed)
        _MEASURED[key] = result, rank.measure(model, images, labels, seed=seed, loss=loss)
    return _MEASURED[key]


_RANK_CHECKS: dict[tuple, tuple] = {}


def rank_check(example: str, *args: str):
    """`rankaudit EXAMPLE --verify rank ARGS` once per test session, with the JSON and the HTML report written to
    a session folder: (exit code, JSON payload, path of the HTML page). The sketch of a 3x32x32 model with its
    full SVD takes about a minute on two cores; the hidden-energy test and the browser test share it."""
    import json
    import tempfile

    key = (example, *args)
    if key not in _RANK_CHECKS:
        folder = Path(tempfile.mkdtemp(prefix="rankaudit-rank-check-"))
        report, page = folder / "report.json", folder / "report.html"
        with pytest.raises(SystemExit) as exit_info:
            main(
                [
                    str(EXAMPLES / f"{example}.py"),
                    "--verify",
                    "rank",
                    "--format",
                    "json",
                    "-o",
                    str(report),
                    "--html",
                    str(page),
                    "--quiet",
                    *args,
                ]
            )
        _RANK_CHECKS[key] = exit_info.value.code, json.loads(report.read_text(encoding="utf-8")), page
    return _RANK_CHECKS[key]


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


# A small tabular MLP (12 features, one hidden ReLU layer): full rank, so only DP noise protects its samples.
TABULAR_NET = """
import torch.nn as nn

INPUT_SHAPE = (12,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())
"""


# A small CNN on 3x8x8 (a convolution and a linear head): quick to train, attack and search noise for.
SMALL_CNN = """from torch import nn

INPUT_SHAPE = (3, 8, 8)


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.conv(x).relu().flatten(1))
"""
