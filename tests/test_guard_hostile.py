"""`rankaudit guard` with a model file that attacks the guard itself: the decision is made in the process that
started the command, where the model's code never ran, from the samples and weights that process read."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_guard import MLP, batch, imprint

REPO = Path(__file__).resolve().parents[1]
HOSTILE = REPO / "tests" / "hostile"


@pytest.fixture
def imprinted(tmp_path):
    """Robbing the Fed's imprint in fc1 of the hostile files' MLP, and the batch it bins."""
    torch.manual_seed(0)
    x, y = batch(8)
    torch.save(imprint(MLP(width=16), x).state_dict(), tmp_path / "imprint.pt")
    np.savez(tmp_path / "batch.npz", x=x.numpy(), y=y.numpy())
    return tmp_path


def guard(model: Path, folder: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rankaudit", "guard", f"{model}:MLP", "--weights", folder / "imprint.pt"]
    command += ["--data", folder / "batch.npz", "--format", "json"]
    return subprocess.run([str(part) for part in command], capture_output=True, text=True, timeout=240, cwd=REPO)


def test_a_model_that_rewrites_the_decision_still_blocks_an_imprint(imprinted):
    done = guard(HOSTILE / "guard_rewrites_the_decision.py", imprinted)
    assert done.returncode == 1, done.stderr  # before: exit 0, send
    report = json.loads(done.stdout)["guard"]
    assert report["action"] == "block" and len(report["exact_samples"]) >= 2


def test_a_forward_that_forges_its_measurements_cannot_hide_the_input_readouts(imprinted):
    done = guard(HOSTILE / "guard_forges_its_measurements.py", imprinted)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)["guard"]
    assert report["action"] == "block" and len(report["exact_samples"]) >= 2
    assert all(readout["reads_input"] for readout in report["readouts"] if readout["leaks"])


def test_the_json_report_is_strict_whatever_the_figures():
    from rankaudit.report.guard import render_json
    from rankaudit.result import GuardDecision, GuardRun
    from rankaudit.settings.round import Round

    decision = GuardDecision("send", [], [], [], [], [], None, float("nan"), 8, float("inf"), energy={"hidden": -1e999})
    run = GuardRun("net.py", "w.pt", "b.npz", Round(), "cross-entropy", decision, float("inf"), 0.0)
    text = render_json(run)
    report = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in the report"))
    assert report["guard"]["min_psnr"] is None and report["guard"]["energy"]["hidden"] is None
