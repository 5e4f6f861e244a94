"""benchmarks/bench_soundness.py over examples/ (the CI-sized run): 0 unsound rows, 0 false protected verdicts."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from conftest import REPO, measured_rank

# As in tests/test_soundness.py: above this many parameters a 3x32x32 sketch takes minutes on two cores.
CHEAP_PARAMETERS = 300_000


def _bench():
    spec = importlib.util.spec_from_file_location("bench_soundness", REPO / "benchmarks" / "bench_soundness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_soundness", module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_every_cheap_example_is_sound_and_none_is_falsely_protected(capsys):
    """The measurements come from the session cache tests/test_soundness.py fills (seed 0, float64): every cheap
    example's exact rank, half an hour on two loaded cores when nothing else measured them first, so it runs with
    the slow cases."""
    bench = _bench()

    def cached(spec, result):
        return measured_rank(spec.rsplit("/", 1)[-1][:-3])[1]

    rows = bench.main(["--only", "examples", "--max-params", str(CHEAP_PARAMETERS)], measure=cached)
    out = capsys.readouterr().out
    measured = [row for row in rows if row.status != "skipped"]
    mobile = {
        f"examples/{name}" for name in ("mobilenetv3_tiny", "lcnet_tiny", "efficientnet_tiny", "mobilenetv2_tiny")
    }
    assert len(measured) >= 19 and mobile <= {r.name for r in measured}
    assert all(row.reason.startswith(("", "gap under")) for row in measured)
    skipped = [row for row in rows if row.status == "skipped"]
    assert all("above --max-params" in row.reason for row in skipped)
    assert "unsound rows (measured rank above the bound): 0" in out
    assert "false protected verdicts (protected, but full measured rank): 0" in out
    assert all(row.status == "ok" for row in measured)


def test_the_script_measures_names_its_precision_and_the_absent_zoos(capsys):
    bench = _bench()
    rows = bench.main(["--only", "examples", "--only", "torchvision", "--only", "timm", "--filter", "mixer_tiny"])
    out = capsys.readouterr().out
    (row,) = rows
    assert (row.status, row.unknowns, row.rank, row.rank_bound, row.verdict) == ("ok", 768, 768, 768, "exposed")
    assert row.precision in ("float32", "float64") and row.seconds > 0
    absent = [name for name in ("torchvision", "timm") if importlib.util.find_spec(name) is None]
    if absent:
        assert "zoos absent: " + ", ".join(f"{name} (not installed)" for name in absent) in out


def test_a_model_that_cannot_take_32_px_is_skipped_with_the_reason(tmp_path):
    bench = _bench()
    path = tmp_path / "big_only.py"
    path.write_text(
        "import torch.nn as nn\nINPUT_SHAPE = (3, 32, 32)\n\n\nclass Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(3 * 64 * 64, 10)\n\n"
        "    def forward(self, x):\n        return self.fc(x.flatten(1))\n"
    )
    row = bench.soundness_row(bench.Entry("zoo/big_only", "zoo", str(path)), measure=None, max_params=None)
    assert row.status == "skipped" and row.reason.startswith("analysis failed: ") and len(row.reason) > 20
