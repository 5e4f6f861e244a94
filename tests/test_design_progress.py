"""suggest's and compare's Fisher part report progress on stderr, as --verify does (rankaudit.verify.progress)."""

import textwrap

import pytest

from rankaudit.design import fisher_review

TABULAR = """
import torch.nn as nn

INPUT_SHAPE = (12,)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(12, {width})
        self.fc2 = nn.Linear({width}, 3)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())
"""


@pytest.fixture
def bars(monkeypatch):
    """Each progress bar the Fisher part opens: its label, its total and how far it got."""
    opened = []
    real = fisher_review.ProgressBar

    class Recorded(real):
        def __init__(self, total, label="", **options):
            super().__init__(total, label, **options)
            opened.append(self)

    monkeypatch.setattr(fisher_review, "ProgressBar", Recorded)
    return opened


def _model(tmp_path, name, width):
    path = tmp_path / name
    path.write_text(textwrap.dedent(TABULAR.format(width=width)))
    return path


def test_suggest_counts_each_design_it_measures(run_cli, tmp_path, bars):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    code, out, _ = run_cli("suggest", _model(tmp_path, "net.py", 16), "--psnr-target", "20")
    assert code == 0 and "Fisher floor (clip" in out
    (bar,) = bars
    # The model as it is and its two remove-bias edits: three designs, each counted once it is measured.
    assert bar.label == "Fisher floor, per design" and bar.total == bar.done == 3


def test_compare_under_noise_shows_each_designs_fisher_floor(run_cli, tmp_path, bars):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    first, second = _model(tmp_path, "a.py", 16), _model(tmp_path, "b.py", 8)
    code, _, _ = run_cli("compare", first, second, "--dp-noise", "1", "--fail-on", "never")
    assert code == 0
    assert [(bar.label, bar.total, bar.done) for bar in bars] == [
        (f"Fisher floor of {first}", 1, 1),
        (f"Fisher floor of {second}", 1, 1),
    ]
