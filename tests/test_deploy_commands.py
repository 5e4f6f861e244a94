"""`suggest` and `compare` on app folders read the app as `check` does: the same round flags, the app's DP
(kept, not proposed again), the model's arguments, and a next `check` line that keeps the app's round."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import APPS

from rankaudit.deploy.app import Overrides, read_deployment

pytestmark = pytest.mark.usefixtures("no_flower_configuration")


def test_suggest_keeps_an_opacus_apps_dp_and_its_check_line_keeps_the_round(run_cli, monkeypatch):
    monkeypatch.chdir(APPS)
    code, out, err = run_cli("suggest", "opacus", "--local-samples", "128")
    assert code == 0, err
    # The app's make_private(noise_multiplier=1.1) at client_app.py: the noise it already adds, not a proposal.
    assert "Noise the client adds (DP-SGD, local DP) is the way" not in out
    assert "The round's own DP noise, added on the client (σ 1.1, clip 1, each sample)" in out
    assert "`rankaudit check opacus --local-samples 128` gives the policy's exit code" in out
    code, out, err = run_cli("suggest", "opacus", "--local-samples", "128", "--format", "json")
    payload = json.loads(out)
    assert payload["round_dp"] == {"noise_multiplier": 1.1, "clip": 1.0, "level": "sample", "noise_by": "client"}
    assert payload["check_command"] == "rankaudit check opacus --local-samples 128"
    # The line it prints runs, and reads the same round: N = 128 over the app's batch 32, its 2 epochs, 5 rounds.
    code, out, err = run_cli(*payload["check_command"].split()[1:], "--format", "json")
    checked = json.loads(out)
    assert code in (0, 1), err
    assert (checked["round"]["local_samples"], checked["round"]["batch_size"]) == (128, 32)
    assert (checked["dp"]["noise_multiplier"], checked["dp"]["sample_rate"], checked["dp"]["steps"]) == (1.1, 0.25, 40)


def test_suggest_max_reconstruction_on_an_app_without_dp_searches_at_the_apps_round(run_cli, monkeypatch):
    monkeypatch.chdir(APPS)
    code, out, err = run_cli("suggest", "quickstart", "--max-reconstruction", "0.05", "--format", "json")
    assert code == 0, err
    noise = json.loads(out)["dp_noise"]
    round_ = read_deployment(APPS / "quickstart").round  # batch 32 of 64 samples, 1 epoch, 3 server rounds
    assert (noise["sample_rate"], noise["steps"]) == (32 / 64, 2 * 3)
    sigma = noise["noise_multiplier"]
    # What the accountant of `check` says at the σ found: the ceiling is met, and 1 % less noise misses it.
    for scale, meets in ((1.0, True), (0.99, False)):
        code, out, err = run_cli(
            "quickstart", "--dp-noise", f"{sigma * scale:.6g}", "--max-reconstruction", "0.05", "--format", "json"
        )
        dp = json.loads(out)["dp"]
        assert (dp["sample_rate"], dp["steps"]) == (32 / round_.local_samples, 6)
        assert (dp["reconstruction_bound"] <= 0.05) is meets, (scale, dp["reconstruction_bound"])
    # The same request on the app's model file, with the app's round given as flags: the same answer.
    code, out, err = run_cli(
        "suggest",
        "quickstart/quickstart_app/task.py:Net",
        "--input-shape",
        "1,8,8",
        "-b",
        "32",
        "--local-samples",
        "64",
        "--server-rounds",
        "3",
        "--max-reconstruction",
        "0.05",
        "--format",
        "json",
    )
    assert code == 0, err
    assert json.loads(out)["dp_noise"]["noise_multiplier"] == sigma


def test_compare_of_two_opacus_apps_reads_their_dp_and_takes_the_round_flags(run_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for name in ("a", "b"):
        shutil.copytree(APPS / "opacus", tmp_path / name)
    code, out, err = run_cli("compare", "a", "b", "--local-samples", "128", "--format", "json")
    assert code == 1, err  # B fails the policy as `check b` does; no "no DP mechanism" and no unknown option
    payload = json.loads(out)
    checked = read_deployment(tmp_path / "b", Overrides(round={"local_samples": 128})).round
    for side in ("a", "b"):
        dp = payload[side]["dp"]
        assert (dp["noise_multiplier"], dp["clip"]) == (checked.dp.noise_multiplier, checked.dp.clip) == (1.1, 1.0)
        assert (dp["sample_rate"], dp["steps"]) == (checked.dp.sample_rate, checked.dp.steps) == (0.25, 40)
        assert payload[side]["round"]["local_samples"] == 128
    code, out, err = run_cli("compare", "a", "b")
    assert code == 1 and "Fisher floor at σ 1.1" in out, err  # the app's σ, as check reads it


def test_compare_and_suggest_build_a_hydra_apps_model_with_its_arguments(run_cli, monkeypatch):
    monkeypatch.chdir(APPS)
    given = ("--input-shape", "1,8,8", "--local-samples", "64")
    code, out, err = run_cli("compare", "hydra_defaults", "hydra_defaults", *given, "--format", "json")
    assert code in (0, 1), err
    payload = json.loads(out)
    # CNN(hidden=24, num_classes=5) from bench/conf/model/cnn.yaml: the classifier's 5 outputs, not the default's.
    assert payload["b"]["model"].endswith("bench/models.py:CNN")
    assert payload["b"]["layers"][-1]["weights"] == 24 * 5 + 5  # fc2: Linear(hidden=24, num_classes=5)
    assert payload["b"]["parameters"] == (4 * 9 + 4) + (4 * 6 * 6 * 24 + 24) + (24 * 5 + 5)  # not 1,290 at the defaults
    code, out, err = run_cli("suggest", "hydra_defaults", *given, "--format", "json")
    assert code == 0, err
    assert json.loads(out)["check_command"] == "rankaudit check hydra_defaults --input-shape 1,8,8 --local-samples 64"
