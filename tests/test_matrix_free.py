"""The matrix-free rank check (block Lanczos on JᵀJ) against the dense sketch, on nets small enough for both."""

import pytest
import torch
from torch import nn

from rankaudit.verify.rank import jacobian as dense
from rankaudit.verify.rank.check import OverallProgress
from rankaudit.verify.rank.gram import as_rank_measurement, measure_matrix_free
from rankaudit.verify.rank.hidden import centred


def _pooling_mlp():
    # Average-pool 4 before an MLP: each sample's Jacobian sees only the 12 pooled values (a low rank).
    return nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 10))


def _strided_cnn():
    return nn.Sequential(nn.Conv2d(3, 2, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(32, 10))


def _hidden_share(invisible, x):
    c = centred(x).reshape(-1).double()
    return float((torch.as_tensor(invisible).reshape(-1) ** 2).sum() / (c**2).sum())


@pytest.mark.parametrize("make", [_pooling_mlp, _strided_cnn])
def test_exact_reading_matches_the_dense_sketch(make):
    torch.manual_seed(0)
    net, x, y = make(), torch.rand(1, 3, 8, 8), torch.tensor([3])
    reference = dense.measure(net, x, y, hidden=True)
    reading = measure_matrix_free(net, x, y, block=16)
    assert reading.exact
    assert reading.rank_at_least == reference.rank
    names = [name for name, _ in net.named_parameters()]
    measured = as_rank_measurement(reading, x, shared=names, shared_size=1, loss="cross-entropy", device="cpu")
    assert measured.rank == reference.rank
    assert _hidden_share(measured.invisible, x) == pytest.approx(_hidden_share(reference.invisible, x), abs=1e-6)
    assert reading.hidden_share_at_most == pytest.approx(_hidden_share(reference.invisible, x), abs=1e-6)


def test_small_eigenvalues_are_not_mistaken_for_an_invariant_basis():
    # At 3x16x16 a pooled MLP's spectrum spans many decades: A V shrinks its small directions below rounding, and
    # only a probe from the basis's complement finds them (the rank must still be the dense sketch's, give or take
    # singular values under the Gram matrix's coarser tolerance).
    torch.manual_seed(0)
    net = nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(48, 16), nn.ReLU(), nn.Linear(16, 10))
    x, y = torch.rand(1, 3, 16, 16), torch.tensor([1])
    reference = dense.measure(net, x, y, hidden=True)
    reading = measure_matrix_free(net, x, y)
    assert reading.exact
    assert reference.rank - 2 <= reading.rank_at_least <= reference.rank
    assert reading.hidden_share_at_most == pytest.approx(_hidden_share(reference.invisible, x), abs=1e-6)


def test_a_stopped_reading_bounds_the_rank_from_below_and_the_hidden_share_from_above():
    torch.manual_seed(1)
    net, x, y = _strided_cnn(), torch.rand(1, 3, 8, 8), torch.tensor([2])
    reference = dense.measure(net, x, y, hidden=True)
    hidden = _hidden_share(reference.invisible, x)
    reading = measure_matrix_free(net, x, y, block=8, budget_seconds=0.0)  # one block of products, then stop
    assert not reading.exact and reading.stopped == "budget" and reading.basis == 8
    assert reading.rank_at_least <= reference.rank
    assert reading.hidden_share_at_most >= hidden - 1e-9
    with pytest.raises(Exception, match="lower bound|not yet the exact answer"):
        as_rank_measurement(reading, x, shared=[], shared_size=0, loss="cross-entropy", device="cpu")


def test_the_check_stops_before_its_basis_outgrows_the_memory_it_may_use_and_says_both_bounds():
    from rankaudit.errors import UsageError
    from rankaudit.verify.rank.krylov import basis_bytes

    torch.manual_seed(1)
    net, x, y = _strided_cnn(), torch.rand(1, 3, 8, 8), torch.tensor([2])
    reference = dense.measure(net, x, y, hidden=True)
    allowed = basis_bytes(24, x.numel(), 8)  # room for three blocks of 8
    reading = measure_matrix_free(net, x, y, block=8, memory_bytes=allowed)
    assert reading.stopped == "memory" and reading.basis == 24 and not reading.exact
    assert reading.rank_at_least <= reference.rank
    assert reading.hidden_share_at_most >= _hidden_share(reference.invisible, x) - 1e-9
    with pytest.raises(UsageError, match="outgrow the device's memory") as refused:
        as_rank_measurement(reading, x, shared=[], shared_size=0, loss="cross-entropy", device="cpu")
    assert "lower --input-shape" in refused.value.fix


def test_progress_never_moves_backwards_when_a_sketch_is_redone():
    seen = []
    overall = OverallProgress(lambda done, total: seen.append((done, total)), parts=2)
    first = overall.part(0)
    for done in (10, 20, 30):  # a float32 sketch of 30 rows ...
        first(done, 30)
    for done in (10, 20, 30):  # ... redone in float64
        first(done, 30)
    overall.finish(overall.last_total)
    second = overall.part(1)
    for done in (15, 30):  # the next sample's float32 sketch is kept
        second(done, 30)
    overall.finish(overall.last_total)
    counts = [done for done, _ in seen]
    assert counts == sorted(counts)
    assert all(done <= total for done, total in seen)
    assert seen[-1][0] == seen[-1][1] == 90


STRIDED_SOURCE = """
import torch.nn as nn

INPUT_SHAPE = (3, 8, 8)


class Strided(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 2, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x)
"""


def test_a_rank_budget_reports_bounds_that_the_dense_check_sits_inside(run_cli, tmp_path):
    import json

    model = tmp_path / "strided.py"
    model.write_text(STRIDED_SOURCE)
    common = ("--verify", "rank", "--samples", "1", "--format", "json")
    code, out, _ = run_cli(model, *common, "--rank-method", "dense", "--rank-budget", "5")
    dense_record = json.loads(out)["verification"]["rank"]
    assert "--rank-budget applies to the matrix-free check; the dense sketch ran to the end" in dense_record["notes"]
    code, out, _ = run_cli(model, *common, "--rank-method", "matrix-free", "--rank-budget", "1e-9")
    partial = json.loads(out)["verification"]["rank"]
    assert partial["exact"] is False and partial["stopped"] == ["budget"] and partial["internal_error"] is None
    assert partial["samples"][0]["directions"] == 32  # one block of products, then the budget is spent
    # The independent measurement sits inside the bounds: its rank above the lower bound, its hidden share under
    # the upper one.
    assert partial["rank_at_least"] <= dense_record["rank"]
    assert partial["hidden_share_at_most"] >= dense_record["samples"][0]["inputs"][0]["hidden_energy"] - 1e-9
    page = tmp_path / "report.html"
    code, out, _ = run_cli(
        model,
        "--verify",
        "rank",
        "--samples",
        "1",
        "--rank-method",
        "matrix-free",
        "--rank-budget",
        "1e-9",
        "--html",
        page,
    )
    assert "Measured, not finished: rank at least 32 of 192" in page.read_text()
    line = next(line for line in out.splitlines() if line.startswith("Rank check"))
    assert line.startswith(
        "Rank check (∂g/∂x, 1 image, matrix-free, stopped: its time budget was spent): rank ≥ 32 / 192"
    )
    assert "inconclusive, not the exact rank" in line
