"""Issue 21: every PSNR the input attacks report stands beside a flat grey and a mean-colour image, and the best
image beside the median; a reconstruction that does not beat both baselines is never called recovered."""

import json
import math

import pytest
import torch
from conftest import EXAMPLES

from rankaudit.verify import baselines


def _psnr(mse: float) -> float:
    return 10 * math.log10(1 / mse)


def test_the_baselines_on_constructed_images():
    # Image 0: left half 0.2, right half 0.6 (one channel): grey MSE mean(0.09, 0.01) = 0.05, its mean colour 0.4
    # is off by 0.2 everywhere: MSE 0.04. Image 1: flat 0.9: grey MSE 0.16, mean colour exact (infinite PSNR).
    first = torch.tensor([[[0.2, 0.6], [0.2, 0.6]]])
    images = torch.stack([first, torch.full((1, 2, 2), 0.9)])
    scored = baselines.score(images, images.clone())
    assert scored[0].grey_psnr == pytest.approx(_psnr(0.05))
    assert scored[0].mean_colour_psnr == pytest.approx(_psnr(0.04))
    assert scored[1].grey_psnr == pytest.approx(_psnr(0.16)) and scored[1].mean_colour_psnr is None
    # An exact reconstruction (PSNR None: infinite) beats a finite baseline, but not an exact one.
    assert scored[0].recovered and not scored[1].recovered
    assert baselines.outcome(scored) == baselines.PARTLY


def test_a_reconstruction_below_grey_fails_and_the_best_image_is_named():
    from rankaudit.bound.images import load_images

    images = load_images(None, (3, 8, 8), 3, 0)[0].double()
    inverted = 1 - images  # MSE 4 x the grey image's: 6.02 dB below it on every image
    scored = baselines.score(images, inverted)
    for entry in scored:
        assert entry.psnr == pytest.approx(entry.grey_psnr - 10 * math.log10(4))
        assert entry.mean_colour_psnr >= entry.grey_psnr and not entry.recovered
    # One image nearly exact: it is the best, the only one recovered; the others still fail.
    inverted[1] = images[1] + 0.001
    summary = baselines.summary(baselines.score(images, inverted))
    assert summary["best"]["index"] == 1 and summary["best"]["psnr"] == pytest.approx(60.0)
    assert summary["best"]["recovered"] and summary["recovered_samples"] == 1
    assert summary["outcome"] == "partly recovered"
    assert math.isfinite(summary["grey_psnr_median"]) and math.isfinite(summary["mean_colour_psnr_median"])
    assert baselines.summary(scored)["outcome"] == "failed"


def _tiny_cnn(tmp_path):
    model = tmp_path / "tiny.py"
    model.write_text(
        "import torch.nn as nn\nINPUT_SHAPE = (1, 6, 6)\n\n\n"
        "class Tiny(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.conv = nn.Conv2d(1, 2, 3, padding=1)\n        self.fc = nn.Linear(72, 3)\n\n"
        "    def forward(self, x):\n        return self.fc(nn.functional.leaky_relu(self.conv(x), 0.2).flatten(1))\n",
        encoding="utf-8",
    )
    return model


def test_a_round_attack_below_the_grey_image_is_reported_as_failed(run_cli, tmp_path, monkeypatch):
    """The FedAvg inversion's output replaced by the inverted originals (6 dB below grey on every image): the JSON,
    the judgement and the table say failed, with both baselines and the best image beside the median."""
    from rankaudit.verify.attacks import fedavg

    monkeypatch.setattr(fedavg, "_match", lambda found, originals, labels: 1 - originals)
    model = _tiny_cnn(tmp_path)
    _, out, _ = run_cli(
        model, "--local-samples", 2, "--batch-size", 1, "--verify", "rgap", "--steps", 3, "--format", "json", "-q"
    )
    attack = json.loads(out)["verification"]["rgap"]
    assert attack["attack"] == "fedavg-inversion" and attack["dtype"] == "float64"
    assert attack["outcome"] == "failed" and attack["recovered_samples"] == 0
    assert "the attack failed" in attack["judgement"]
    assert attack["median_psnr"] < attack["grey_psnr_median"] <= attack["mean_colour_psnr_median"]
    for sample in attack["samples"]:
        assert sample["recovered"] is False and math.isfinite(sample["grey_psnr"])
        assert sample["psnr"] == pytest.approx(sample["grey_psnr"] - 10 * math.log10(4))
    best = max(attack["samples"], key=lambda s: s["psnr"])
    assert attack["best"]["index"] == best["index"] and attack["best"]["psnr"] == pytest.approx(best["psnr"])
    assert all(b <= last for b, last in zip(attack["restart_best_distances"], attack["restart_last_distances"]))
    _, out, _ = run_cli(model, "--local-samples", 2, "--batch-size", 1, "--verify", "rgap", "--steps", 3)
    assert "0 of 2 image(s) beat both: failed" in out and "best image" in out and ": failed), " in out


def test_the_single_gradient_attack_reports_baselines_and_its_best_image(run_cli):
    _, out, _ = run_cli(EXAMPLES / "lenet_leaky.py", "--verify", "rgap", "--samples", 2, "--format", "json")
    attack = json.loads(out)["verification"]["rgap"]
    assert attack["outcome"] == "recovered" and attack["recovered_samples"] == 2
    assert math.isfinite(attack["grey_psnr_median"]) and math.isfinite(attack["mean_colour_psnr_median"])
    assert attack["best"]["psnr"] is None or attack["best"]["psnr"] > attack["best"]["mean_colour_psnr"] + 30
    assert all(sample["recovered"] and sample["ssim"] > 0.99 for sample in attack["samples"])
    assert "the attack failed" not in attack["judgement"]


def test_defended_rows_carry_the_baselines(run_cli):
    _, out, _ = run_cli(
        EXAMPLES / "lenet_leaky.py", "--verify", "rgap", "--samples", 1, "--defense", "noise:0.1", "--format", "json"
    )
    verification = json.loads(out)["verification"]
    (row,) = verification["defenses"]
    assert row["grey_psnr_median"] == pytest.approx(verification["rgap"]["grey_psnr_median"])
    assert math.isfinite(row["mean_colour_psnr_median"]) and row["outcome_without"] == "recovered"
    assert row["outcome_with"] in ("recovered", "partly recovered", "failed")
