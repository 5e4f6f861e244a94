"""The attacks read what the client sends: with layers withheld, --verify dp's candidates' clipped gradients hold
only the sent parameters' entries, and the FedAvg inversion of a round fits the sent part of the update."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import SMALL_CNN

pytest.importorskip("scipy")

FC_VALUES = 4 * 8 * 8 * 10 + 10


@pytest.fixture
def small_cnn(tmp_path):
    path = tmp_path / "small.py"
    path.write_text(SMALL_CNN)
    return path


def test_the_sent_part_is_cut_from_the_clipped_gradient_or_clipped_as_sent(small_cnn):
    from rankaudit.settings.round import Round
    from rankaudit.verify.attacks.dp import client_updates, unit_gradients
    from rankaudit.verify.model import build_real_model

    model, _ = build_real_model(str(small_cnn), (3, 8, 8), 0)
    inputs = torch.rand((3, 1, 3, 8, 8), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.tensor([[1], [4], [7]])
    sent = ["fc.weight", "fc.bias"]
    whole = unit_gradients(model, inputs, labels, "cross-entropy", 0.01, "cpu")
    kept = unit_gradients(model, inputs, labels, "cross-entropy", 0.01, "cpu", sent)
    # DP-SGD clips every trained parameter's gradient together; the server reads the fc part of it.
    assert kept.shape == (3, FC_VALUES) and torch.equal(kept, whole[:, -FC_VALUES:])
    assert (kept.norm(dim=1) < 1).all()  # conv's share of the clipped norm is not sent
    updates = client_updates(model, Round(batch_size=1, lr=0.1), inputs, labels, "cross-entropy", 1e-3, "cpu", sent)
    # DP-FedAvg clips the update the client sends: the fc update alone, at norm c.
    assert updates.shape == (3, FC_VALUES)
    assert torch.allclose(updates.double().norm(dim=1), torch.ones(3, dtype=torch.float64), atol=1e-5)


def test_verify_dp_attacks_only_the_layers_sent(run_cli, small_cnn):
    given = ("--dp-noise", "2", "--verify", "dp", "--samples", "50", "--format", "json", "--fail-on", "never")
    code, out, err = run_cli(small_cnn, *given, "--withheld-layers", "conv")
    attack = json.loads(out)["verification"]["dp"]
    assert code == 0 and "internal error" not in err, err
    assert attack["shared_parameters"] == ["fc.weight", "fc.bias"]
    assert any(
        note.startswith(f"gradient size {FC_VALUES:,};") and "only the 2 parameters sent are attacked" in note
        for note in attack["notes"]
    ), attack["notes"]
    assert attack["interval"][0] <= attack["bound"]
    code, out, err = run_cli(small_cnn, *given)
    whole = json.loads(out)["verification"]["dp"]
    assert whole["shared_parameters"] is None
    assert any(note.startswith(f"gradient size {FC_VALUES + 4 * 3 * 9 + 4:,};") for note in whole["notes"])


def test_the_round_inversion_fits_the_update_the_client_sends(run_cli, small_cnn, monkeypatch):
    from rankaudit.verify.attacks import fedavg

    fitted = []
    real = fedavg.invert_round
    monkeypatch.setattr(fedavg, "invert_round", lambda *a, **k: fitted.append(k["shared"]) or real(*a, **k))
    given = ("--verify", "rgap", "--steps", "3", "--local-samples", "2", "--format", "json", "--fail-on", "never")
    code, out, err = run_cli(small_cnn, *given, "--withheld-layers", "conv")
    attack = json.loads(out)["verification"]["rgap"]
    assert fitted == [["fc.weight", "fc.bias"]], err
    assert "the update fitted is the part the client sends: 2 parameter tensors" in attack["notes"]
