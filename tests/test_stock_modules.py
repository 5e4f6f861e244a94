"""Models PyTorch ships that the meta device alone cannot build or trace: each analyses, and its bound is at
least the rank of ∂g/∂x measured on real float64 tensors."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from metamorphic import measured_rank  # noqa: E402

ORTHOGONAL_CONV = """
import torch
from torch import nn
from torch.nn.utils.parametrizations import orthogonal

INPUT_SHAPE = (3, 6, 6)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = orthogonal(nn.Conv2d(3, 4, 3))  # registration checks the weight's values (torch.allclose)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))
"""

RNN_CELL_LOOP = """
import torch
from torch import nn

INPUT_SHAPE = (5, 4)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.RNNCell(4, 3)
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = torch.zeros(x.shape[0], 3, dtype=x.dtype)  # no device: the CPU when the model runs there
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return self.fc(h)
"""


def _analyse_and_measure(tmp_path, name: str, source: str):
    from rankaudit.audit import audit

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    result = audit(str(path))
    namespace: dict = {}
    exec(compile(source, str(path), "exec"), namespace)
    measured = measured_rank(namespace["Net"], namespace["INPUT_SHAPE"])
    assert measured.reliable, measured.gap
    return result, measured.rank


def test_an_orthogonal_parametrisation_builds_on_the_cpu_and_its_bound_holds(run_cli, tmp_path):
    result, rank = _analyse_and_measure(tmp_path, "orthogonal_conv", ORTHOGONAL_CONV)
    assert result.build == "small-cpu"
    code, out, err = run_cli(tmp_path / "orthogonal_conv.py")  # the real weights are said on every run
    assert code in (0, 1) and "Built with real weights on the CPU" in out and "capped at 256 MB" in out
    bound = result.identifiability.sample.rank_bound
    assert rank <= bound <= result.identifiability.unknowns
    assert {layer.name for layer in result.layers} >= {"conv", "fc"}


def test_an_rnn_cell_stepped_with_a_device_less_initial_state_traces(tmp_path):
    result, rank = _analyse_and_measure(tmp_path, "rnn_cell_loop", RNN_CELL_LOOP)
    assert result.tracer == "torch.export" and result.build == "meta-parameters"
    assert [layer.name for layer in result.layers if layer.op == "RNNCell"] == [
        "cell",
        "cell#2",
        "cell#3",
        "cell#4",
        "cell#5",
    ]
    assert rank <= result.identifiability.sample.rank_bound


def test_a_cpu_build_past_its_cap_stops_before_allocating(run_cli, tmp_path):
    """The CPU build is for small models: one whose tensors would go past the cap gets the meta device's error,
    and the big weight is never allocated in rankaudit's process (the plain-PyTorch check runs apart, capped)."""
    path = tmp_path / "large.py"
    path.write_text(
        textwrap.dedent("""
        from torch import nn
        from torch.nn.utils.parametrizations import orthogonal
        INPUT_SHAPE = (4,)

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.wide = nn.Linear(4, 80_000_000)  # 1.6 GB of weights and bias
                self.rotation = orthogonal(nn.Linear(4, 4))

            def forward(self, x):
                return self.rotation(x) + self.wide(x)[:, :4]
        """)
    )
    from rankaudit.model import meta_device

    allocated = []
    original = meta_device._CappedCPUBuild.charge

    def charge(self, size):
        original(self, size)
        allocated.append(self.allocated)

    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(meta_device._CappedCPUBuild, "charge", charge)
    try:
        code, out, err = run_cli(path, "--memory-limit", "1")
    finally:
        monkeypatch.undo()
    assert code == 3 and len(err.strip().splitlines()) == 1 and "meta" in err
    assert all(total <= meta_device.SMALL_CPU_BYTES for total in allocated)


def test_factory_sizes_are_read_before_the_call():
    from rankaudit.model.meta_device import _requested_bytes

    assert _requested_bytes("zeros", (2, 3), {}) == _requested_bytes("zeros", ((2, 3),), {}) == 24
    assert _requested_bytes("full", ((2, 3), 1.0), {"dtype": torch.float64}) == 48
    assert _requested_bytes("empty", (), {"size": (10,)}) == 40
    assert _requested_bytes("new_zeros", (torch.zeros(1, dtype=torch.int8), (4, 4)), {}) == 16
    assert _requested_bytes("zeros_like", (torch.zeros(3),), {}) == 12
    assert _requested_bytes("add", (torch.zeros(3), 1), {}) == 0
