"""A client that sends its state_dict sends its BatchNorms' running statistics: in training mode each step moves
them by the batch's mean and variance of the norm's input per channel, equations on the samples the server reads
beside the gradient. The bound counts them where they are sent, and the exact rank of everything sent stays under
it, with them and without them."""

from __future__ import annotations

import json

import pytest
import torch
from test_withheld_norms import NORM_FIRST

from rankaudit.audit import audit
from rankaudit.settings.round import Round
from rankaudit.verify.client import draw_labels
from rankaudit.verify.model import build_real_model
from rankaudit.verify.rank import jacobian as rank

# NORM_FIRST: BatchNorm2d(4) reads the 4x3x3 input (36 unknowns), a 1x1 convolution to 2 channels, a classifier.
# With the convolution and the norm's scale and shift kept on the client, the classifier's gradient reads the 18
# values after the convolution; the norm has already removed each channel's mean and scale from them (8
# directions), which are exactly what its running statistics move by.
KEPT = ["conv1", "bn1.weight", "bn1.bias"]


@pytest.fixture
def norm_first(tmp_path):
    path = tmp_path / "norm_first.py"
    path.write_text(NORM_FIRST)
    return path


def _exact(spec, withheld: list[str], with_statistics: bool) -> int:
    """rank of the Jacobian in one sample of what is sent, at real weights, the norm in training mode."""
    model, _ = build_real_model(str(spec), (4, 3, 3), 0)
    sample = torch.rand((1, 4, 3, 3), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    labels = draw_labels(1, "cross-entropy", 3, 0)
    shared = rank.shared_parameter_names(model, withheld_layers=withheld)
    statistics = rank.sent_statistics(model, withheld_layers=withheld) if with_statistics else []
    measured = rank.measure(model, sample, labels, shared, loss="cross-entropy", bn_mode="train", statistics=statistics)
    return measured.rank


def test_sent_running_statistics_close_a_deficit_and_the_bound_counts_them(norm_first):
    def bound(withheld):
        return audit(str(norm_first), withheld_layers=withheld).identifiability

    kept_local, sent = bound(["conv1", "bn1"]), bound(KEPT)  # bn1 names its running statistics too
    assert sent.sample.running_statistics == ["bn1.running_mean", "bn1.running_var"]
    assert kept_local.sample.running_statistics == []
    gradient_alone = _exact(norm_first, KEPT, with_statistics=False)
    with_statistics = _exact(norm_first, KEPT, with_statistics=True)
    # The gradient leaves a deficit the statistics' 8 equations close in part: the server reads more.
    assert gradient_alone == _exact(norm_first, ["conv1", "bn1"], with_statistics=False) == 16
    assert with_statistics == gradient_alone + 8 == 24
    # Each bound covers what it counts: 18 without the statistics would sit under the 24 the server reads.
    assert gradient_alone <= kept_local.rank_bound == 18
    assert with_statistics <= sent.rank_bound == kept_local.rank_bound + 8
    assert "bn1.running_mean" in sent.bottleneck and "bn1.running_var" in sent.bottleneck
    # In eval mode nothing moves them: the bound does not count them.
    evaluated = audit(str(norm_first), withheld_layers=KEPT, round_=Round(batch_size=1, bn_mode="eval"))
    assert evaluated.identifiability.sample.running_statistics == []
    assert evaluated.identifiability.rank_bound <= sent.rank_bound - 8


def test_the_rank_check_measures_the_statistics_a_client_sends(norm_first, run_cli):
    given = ("--withheld-layers", ",".join(KEPT), "-b", "2", "--verify", "rank", "--format", "json")
    code, out, err = run_cli(norm_first, *given, "--fail-on", "never")
    payload = json.loads(out)
    verification = payload["verification"]["rank"]
    assert any(
        note == "running statistics sent: bn1.running_mean, bn1.running_var (their exact Jacobian's rows join "
        "the sketch)"
        for note in verification["notes"]
    ), verification["notes"]
    assert verification["rank"] <= payload["identifiability"]["rank_bound"], err
    assert "Running statistics counted as sent (bn1)" in payload["identifiability"]["sample"]["covers"]
    code, out, err = run_cli(norm_first, *given, "--fail-on", "never", "--bn-mode", "eval")
    evaluated = json.loads(out)
    assert not any(note.startswith("running statistics") for note in evaluated["verification"]["rank"]["notes"])
    assert evaluated["identifiability"]["sample"]["running_statistics"] == []
