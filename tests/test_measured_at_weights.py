"""The measured side of the energy verdict: verifiers at the weights that are sent (--weights), the rank check's
hidden energy judged on the energy levels and held against the certificate, one judgement per attack section, and
the FedAvg attack's flat start and true median."""

import json
import math
import os

import pytest
import torch
from conftest import EXAMPLES

from rankaudit.settings.levels import energy_level

MLP = (
    "import torch.nn as nn\nINPUT_SHAPE = (1, 4, 4)\n\n\n"
    "class Small(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.fc1 = nn.Linear(16, 4)\n        self.fc2 = nn.Linear(4, 3)\n\n"
    "    def forward(self, x):\n        return self.fc2(nn.functional.relu(self.fc1(x.flatten(1))))\n"
)


@pytest.fixture
def small_mlp(tmp_path):
    path = tmp_path / "small.py"
    path.write_text(MLP, encoding="utf-8")
    return path


def _dead_state(seed: int = 0) -> dict:
    """The MLP's weights with every first-layer unit dead (bias -1e3 against inputs in [0, 1]): nothing of the input
    reaches the gradient, whatever the input."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential()
    model.fc1, model.fc2 = torch.nn.Linear(16, 4), torch.nn.Linear(4, 3)
    state = model.state_dict()
    state["fc1.bias"] = torch.full((4,), -1e3)
    return state


def test_energy_levels_on_the_default_thresholds():
    assert energy_level(0.049) == "exposed" and energy_level(0.05) == "partial"
    assert energy_level(0.499) == "partial" and energy_level(0.5) == "protected"
    assert energy_level(0.3, max_recoverable=0.8) == "protected"


def test_the_rank_check_runs_at_the_weights_in_a_checkpoint(run_cli, small_mlp, tmp_path):
    """Seeded: a 16-pixel input behind 4 live ReLU units and a bias; the gradient determines it (rank 16, nothing
    hidden). At a checkpoint whose first-layer units are all dead, the same check measures rank 0 and 100 % hidden."""
    checkpoint = tmp_path / "ckpt.pt"
    torch.save({"state_dict": _dead_state(), "epoch": 3}, checkpoint)
    _, out, _ = run_cli(small_mlp, "--verify", "rank", "--samples", 2, "--format", "json", "-q")
    seeded = json.loads(out)["verification"]["rank"]
    assert seeded["weights"].startswith("random") and seeded["rank"] == 16
    assert seeded["energy"]["weights"] == "at the seeded initialisation"
    assert seeded["energy"]["worst_hidden_energy"] == pytest.approx(0.0, abs=1e-9)
    assert seeded["energy"]["level"] == "exposed"
    code, out, err = run_cli(
        small_mlp, "--verify", "rank", "--samples", 2, "--weights", checkpoint, "--format", "json", "-q"
    )
    rank = json.loads(out)["verification"]["rank"]
    assert rank["weights"] == "the weights in ckpt.pt" and rank["rank"] == 0
    assert rank["energy"]["worst_hidden_energy"] == pytest.approx(1.0)
    assert rank["energy"]["level"] == "protected"
    assert rank["energy"]["line"].startswith("at the weights in ckpt.pt, the worst sample hides 100 %")
    _, out, _ = run_cli(
        small_mlp, "--verify", "rank", "--samples", 2, "--weights", checkpoint, "--html", tmp_path / "report.html"
    )
    assert "at the weights in ckpt.pt, the worst sample hides 100 %" in out
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "At the weights in ckpt.pt, the worst sample hides 100 %" in page


def test_weights_errors_are_one_line_with_their_exit_codes(run_cli, small_mlp, tmp_path):
    code, _, err = run_cli(small_mlp, "--verify", "rank", "--weights", tmp_path / "missing.pt")
    assert code == 2 and "missing.pt: no such file" in err and err.count("\n") == 1
    code, _, err = run_cli(small_mlp, "--weights", tmp_path / "missing.pt")
    assert code == 2 and "--weights sets the weights the verifiers run at" in err
    # A pipe (whose read would block) or a folder is said for what it is, not "no such file".
    os.mkfifo(tmp_path / "pipe.pt")
    for named, kind in ((tmp_path / "pipe.pt", "a FIFO"), (tmp_path, "a folder")):
        code, _, err = run_cli(small_mlp, "--verify", "rank", "--weights", named)
        assert code == 2 and err.count("\n") == 1, err
        assert f"--weights {named} is {kind}, not a regular file; fix: save the weights to a file" in err
    # The same for --data: a FIFO named like a .npy, of images and of other inputs.
    tabular = tmp_path / "tabular.py"
    tabular.write_text(MLP.replace("INPUT_SHAPE = (1, 4, 4)", "INPUT_SHAPE = (16,)"), encoding="utf-8")
    os.mkfifo(tmp_path / "pipe.npy")
    for model in (small_mlp, tabular):
        code, _, err = run_cli(model, "--data", tmp_path / "pipe.npy")
        assert code == 2 and err.count("\n") == 1 and f"{tmp_path / 'pipe.npy'} is a FIFO, not a regular file" in err
    state = _dead_state()
    renamed = {("layer" + name[2:]): tensor for name, tensor in state.items()}
    torch.save(renamed, tmp_path / "renamed.pt")
    code, _, err = run_cli(small_mlp, "--verify", "rank", "--weights", tmp_path / "renamed.pt")
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err
    assert "does not match the model's keys: missing fc1.weight, fc1.bias, fc2.weight and 1 more" in err
    state["fc1.weight"] = torch.zeros(5, 16)
    torch.save({"model": state}, tmp_path / "shapes.pt")
    code, _, err = run_cli(small_mlp, "--verify", "rank", "--weights", tmp_path / "shapes.pt")
    assert code == 3 and "does not match the model's shapes (file vs model): fc1.weight (5, 16) vs (4, 16)" in err
    torch.save({"epoch": 3}, tmp_path / "empty.pt")
    code, _, err = run_cli(small_mlp, "--verify", "rank", "--weights", tmp_path / "empty.pt")
    assert code == 3 and "holds no state dict (a dict with keys epoch)" in err


def test_the_attack_runs_at_the_weights_given(run_cli, small_mlp, tmp_path):
    """--weights reaches every verifier: R-GAP names the file it ran at."""
    torch.save(_dead_state(1), tmp_path / "w.pt")
    _, out, _ = run_cli(
        small_mlp, "--verify", "rgap", "--samples", 1, "--weights", tmp_path / "w.pt", "--format", "json"
    )
    assert json.loads(out)["verification"]["rgap"]["weights"] == "the weights in w.pt"


def _reading(level: str, hidden: list[float], certified: float | None = None, expected: float | None = None):
    """A rank check's record after the worst-sample reading, and a Result whose per-sample bound says `level`."""
    from types import SimpleNamespace

    entries = [
        {"index": i, "hidden_energy": h, "visible_psnr": 20.0 + i, "visible_ssim": 0.5} for i, h in enumerate(hidden)
    ]
    verification = {
        "worst_first": sorted(entries, key=lambda e: e["hidden_energy"]),
        "sample_level": level,
        "confirms": True,
        "agreement": f"confirms {level}",
        "judgement": f"confirms {level} (each sample)",
        "internal_error": None,
    }
    sample = SimpleNamespace(certified_hidden_energy=certified, expected_hidden_energy=expected)
    result = SimpleNamespace(identifiability=SimpleNamespace(sample=sample, max_recoverable=0.5, exposed_below=0.05))
    return verification, result


def test_protected_is_not_confirmed_when_the_worst_sample_hides_less_than_half():
    """The issue's case: protected by count, but at the weights sent the worst sample hides 5.3 % (23.4 dB)."""
    from rankaudit.verify.rank.energy import read_energy

    verification, result = _reading("protected", [0.9, 0.053, 0.8])
    verification["worst_first"][0]["visible_psnr"] = 23.4
    read_energy(verification, result, "at the seeded initialisation")
    assert verification["confirms"] is False and "confirms protected" not in verification["judgement"]
    assert verification["judgement"].startswith(
        "does not confirm protected: at the seeded initialisation, the worst sample hides 5.3 % (23.4 dB): "
        "partial on energy"
    )
    assert verification["energy"]["level"] == "partial" and verification["internal_error"] is None
    verification, result = _reading("protected", [0.9, 0.6, 0.8])
    read_energy(verification, result, "at the seeded initialisation")
    assert verification["confirms"] is True and verification["energy"]["level"] == "protected"


def test_a_mean_below_the_expected_share_beyond_three_standard_errors_is_an_internal_error():
    """Measured 0.20, 0.30, 0.40: mean 0.30, standard error 0.0577; mean + 3 stderr = 0.473. An expected share of 0.45
    is within it (consistent), one of 0.50 is not (internal error)."""
    from rankaudit.verify.rank.energy import read_energy

    verification, result = _reading("partial", [0.2, 0.3, 0.4], expected=0.45)
    read_energy(verification, result, "at the seeded initialisation")
    energy = verification["energy"]
    assert energy["mean_hidden_energy"] == pytest.approx(0.3) and energy["stderr"] == pytest.approx(0.1 / math.sqrt(3))
    assert energy["consistent"] is True and verification["internal_error"] is None
    verification, result = _reading("partial", [0.2, 0.3, 0.4], expected=0.5)
    read_energy(verification, result, "at the seeded initialisation")
    assert verification["energy"]["consistent"] is False
    assert "internal error: the mean measured hidden share 30 %" in verification["internal_error"]
    verification, result = _reading("partial", [0.2], expected=0.5)  # one sample: no standard error, no check
    read_energy(verification, result, "at the seeded initialisation")
    assert verification["energy"]["consistent"] is None and verification["internal_error"] is None


def test_too_many_samples_below_the_certified_share_is_an_internal_error():
    """The certificate lets each sample fall below it with probability 10 %: 1 of 4 below is ordinary (P = 34 %),
    3 of 4 is not (P = 0.37 %, still above 0.1 %: consistent), 4 of 4 is (P = 0.01 %)."""
    from rankaudit.verify.rank.energy import below_is_surprising, read_energy

    assert not below_is_surprising(1, 4, 0.9) and not below_is_surprising(3, 4, 0.9) and below_is_surprising(4, 4, 0.9)
    assert not below_is_surprising(0, 100, 0.9) and below_is_surprising(25, 100, 0.9)
    verification, result = _reading("partial", [0.1, 0.2, 0.3, 0.8], certified=0.5)
    read_energy(verification, result, "at the seeded initialisation")
    assert verification["energy"]["below_certified"] == 3 and verification["energy"]["consistent"] is True
    verification, result = _reading("partial", [0.1, 0.2, 0.3, 0.4], certified=0.5)
    read_energy(verification, result, "at the seeded initialisation")
    assert verification["energy"]["consistent"] is False
    assert "4 of 4 measured samples hide less than the certified 50 %" in verification["internal_error"]


def test_a_measurement_below_the_certificate_exits_3_after_the_report(run_cli, small_mlp, monkeypatch):
    """The seeded MLP hides nothing of its inputs (rank 16 of 16); a certificate claiming 90 % hidden cannot hold."""
    from rankaudit import audit as audit_module

    real_audit = audit_module.audit

    def audit_with_a_wrong_certificate(*args, **kwargs):
        result = real_audit(*args, **kwargs)
        result.identifiability.sample.certified_hidden_energy = 0.9
        return result

    monkeypatch.setattr(audit_module, "audit", audit_with_a_wrong_certificate)
    code, out, err = run_cli(small_mlp, "--verify", "rank", "--samples", 4, "--fail-on", "never")
    assert code == 3 and "Rank check" in out
    assert "internal error: 4 of 4 measured samples hide less than the certified 90 %" in err


def test_one_judgement_per_attack_section():
    """A reconstruction above both flat baselines is a recovery: never 'confirms protected' beside it."""
    from rankaudit.verify import scoring

    recovered = {"outcome": "recovered", "recovered_samples": 1, "samples_scored": 1}
    confirms, judgement = scoring.judge_attack("protected", 0.02, recovered)
    assert confirms is False and "confirms protected" not in judgement.replace("does not confirm protected", "")
    assert judgement.startswith("does not confirm protected: 1 of 1 reconstruction(s) beat both")
    assert "rule: protected is confirmed when the median MSE is above 0.01 and no reconstruction" in judgement
    failed = {"outcome": "failed", "recovered_samples": 0, "samples_scored": 2}
    confirms, judgement = scoring.judge_attack("protected", 0.02, failed)
    assert confirms is True and judgement.startswith("confirms protected: median MSE 0.02 > 0.01")
    confirms, judgement = scoring.judge_attack("protected", 0.005, failed)
    assert confirms is False and judgement.startswith("disagrees: the analysis says protected")
    confirms, judgement = scoring.judge_attack("exposed", 1e-5, {**recovered, "recovered_samples": 1})
    assert confirms is True and "rule: exposed is confirmed when the median MSE is below 0.001" in judgement


def test_the_round_attack_starts_one_restart_flat_and_reports_a_true_median():
    """An update that carries nothing of the input (every first-layer unit dead): no candidate fits it better than
    another, so each restart keeps its start and the flat one wins the tie; the reconstruction is the grey image,
    exactly at the grey baseline, never below it. Two images: the median is the mean of their two PSNRs."""
    from rankaudit.bound.images import load_images
    from rankaudit.settings.round import build_round
    from rankaudit.verify import baselines
    from rankaudit.verify.attacks import fedavg

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    with torch.no_grad():
        model[1].bias.fill_(-1e3)
    model = model.double()
    images = load_images(None, (3, 4, 4), 2, 0)[0].double().reshape(1, 2, 3, 4, 4)
    labels = torch.tensor([[0, 1]])
    round_ = build_round({"local_samples": 2, "batch_size": 1})
    attack = fedavg.invert_round(model, images, labels, round_, "cross-entropy", steps=3, restarts=2)
    assert torch.equal(attack.reconstructions, torch.full_like(images, baselines.GREY_LEVEL))
    grey = [s.grey_psnr for s in baselines.score(images[0], attack.reconstructions[0])]
    assert attack.psnr[0] == pytest.approx(grey)
    assert attack.median_psnr == pytest.approx((grey[0] + grey[1]) / 2)
    assert attack.median_mse == pytest.approx((attack.mse[0][0] + attack.mse[0][1]) / 2)
    assert fedavg._median([1.0, 4.0, 2.0, 3.0]) == 2.5 and fedavg._median([3.0, 1.0, 2.0]) == 2.0


def test_gdbr_runs_at_the_weights_given(run_cli, tmp_path):
    """GDBR's paper initialisation gives way to the deployed weights."""
    from rankaudit.model.load import load_model

    module = load_model(str(EXAMPLES / "lenet10.py"), None, device="cpu").module
    torch.save(module.state_dict(), tmp_path / "lenet10.pt")
    _, out, _ = run_cli(
        EXAMPLES / "lenet10.py",
        "--verify",
        "gdbr",
        "--trials",
        1,
        "--weights",
        tmp_path / "lenet10.pt",
        "--format",
        "json",
    )
    assert json.loads(out)["verification"]["gdbr"]["weights"] == "the weights in lenet10.pt"
