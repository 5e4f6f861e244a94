"""`--verify` through the command line: the JSON contract, the thresholds of the issues, the errors."""

import json

import pytest
from conftest import EXAMPLES

GDBR_KEYS = {"shared_layer", "batch_size", "ins_acc", "cls_acc", "trials", "seconds", "recovered", "true"}


@pytest.mark.parametrize(
    "example, flags, layer",
    [
        ("mlp6.py", ("--shared-layers", "fc1,fc2", "--aux", "digits"), "fc2"),
        ("lenet10.py", ("--withheld-layers", "fc2"), "fc1"),
    ],
)
def test_gdbr_recovers_most_labels_of_a_64_batch_from_one_hidden_layer(run_cli, example, flags, layer):
    code, out, err = run_cli(EXAMPLES / example, *flags, "--verify", "gdbr", "--batch-size", "64", "--format", "json")
    payload = json.loads(out)
    gdbr = payload["verification"]["gdbr"]
    assert GDBR_KEYS <= gdbr.keys() and gdbr["shared_layer"] == layer and gdbr["batch_size"] == 64
    assert gdbr["ins_acc"] >= 0.80 and gdbr["cls_acc"] >= 0.95
    # A random 64-batch gives an equal-count guess about 83 %: the attack must clearly beat that.
    assert gdbr["beats_chance"] and gdbr["ins_acc"] >= gdbr["chance_ins_acc"] + 0.08
    assert sum(gdbr["recovered"].values()) == 64 and sum(gdbr["true"].values()) == 64
    assert gdbr["trials"] == 5 and payload["label_leakage"]["risk"] == "high"


def test_gdbr_says_when_it_does_no_better_than_chance(run_cli):
    """MLP6's fc2 with uniform dummies as stand-ins: InsAcc 82.8 %, exactly an equal-count guess's score."""
    code, out, _ = run_cli(EXAMPLES / "mlp6.py", "--shared-layers", "fc1,fc2", "--verify", "gdbr", "-b", "64")
    assert "GDBR does no better, so this run does not show label leakage." in out


def test_gdbr_needs_a_shared_hidden_layer(run_cli):
    code, _, err = run_cli(EXAMPLES / "mlp6.py", "--shared-layers", "classifier", "--verify", "gdbr")
    assert code == 2 and "no shared hidden layer" in err and "classifier is shared" in err


def test_cuda_requested_without_a_gpu_is_a_usage_error(run_cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, _, err = run_cli(EXAMPLES / "lenet10.py", "--verify", "gdbr", "--device", "cuda", "--trials", "1")
    assert code == 2 and "no CUDA device" in err


RGAP_KEYS = {"attack", "device", "median_mse", "median_psnr", "seconds", "confirms", "samples", "layers"}


def test_rgap_reconstructs_cnn6_and_confirms_exposed(run_cli, tmp_path):
    code, out, _ = run_cli(
        EXAMPLES / "cnn6.py", "--verify", "rgap", "--samples", "2", "--format", "json", "--artifacts", tmp_path / "art"
    )
    verification = json.loads(out)["verification"]["rgap"]
    assert RGAP_KEYS <= verification.keys()
    assert verification["attack"] == "rgap" and verification["device"] == "cpu"
    assert verification["median_mse"] < 1e-3 and verification["confirms"] is True
    assert [layer["local_deficit"] for layer in verification["layers"]] == [0] * 7
    assert "random" in verification["weights"] and "photographs" in verification["images"]
    for sample in verification["samples"]:
        assert {"index", "mse", "psnr", "seconds"} <= sample.keys() and sample["mse"] < 1e-3
        for key in ("original_png", "reconstruction_png"):
            assert (tmp_path / "art" / sample[key].rsplit("/", 1)[-1]).stat().st_size > 100
    assert (tmp_path / "art" / "reconstruction_0.npy").exists()


@pytest.mark.slow  # an end-to-end attack of about a minute on two cores
def test_rgap_on_cnn6_d_shows_the_deficit_and_the_disagreement(run_cli):
    code, out, _ = run_cli(EXAMPLES / "cnn6_d.py", "--verify", "rgap", "--samples", "2", "--format", "json")
    payload = json.loads(out)
    verification = payload["verification"]["rgap"]
    conv2 = next(layer for layer in verification["layers"] if layer["name"] == "conv2")
    assert (conv2["unknowns"], conv2["rank"], conv2["local_deficit"]) == (4332, 4052, 280)
    assert verification["median_mse"] > 0.1 and verification["confirms"] is False
    assert "disagrees" in verification["judgement"] and "deficit 280" in verification["judgement"]
    assert payload["ra_i"] == -708 and payload["verdict"] == "exposed"  # the count stays as counted


def test_resnet_falls_back_to_the_optimisation_attack_with_a_reason(run_cli):
    code, out, _ = run_cli(
        EXAMPLES / "resnet18_w16.py", "--verify", "rgap", "--samples", "1", "--steps", "20", "--format", "json"
    )
    verification = json.loads(out)["verification"]["rgap"]
    assert verification["attack"] == "inverting-gradients" and verification["layers"] == []
    assert "R-GAP stops at layer1.0" in verification["note"] and "residual" in verification["note"]
    assert verification["samples"][0]["mse"] > 0  # a real, imperfect reconstruction at 20 steps


def test_user_data_and_bad_data(run_cli, tmp_path):
    import numpy as np

    images = (np.random.default_rng(0).random((2, 28, 28, 1)) * 255).astype(np.uint8)
    np.save(tmp_path / "digits.npy", images)
    code, out, _ = run_cli(
        EXAMPLES / "lenet_leaky.py",
        "--verify",
        "rgap",
        "--data",
        tmp_path / "digits.npy",
        "--samples",
        "2",
        "--format",
        "json",
    )
    verification = json.loads(out)["verification"]["rgap"]
    assert "digits.npy" in verification["images"] and verification["median_mse"] < 1e-8
    code, _, err = run_cli(EXAMPLES / "lenet_leaky.py", "--verify", "rgap", "--data", tmp_path / "missing")
    assert code == 2 and err.startswith("rankaudit: error:") and len(err.strip().splitlines()) == 1


def test_defense_flag_errors(run_cli):
    code, _, err = run_cli(EXAMPLES / "cnn6.py", "--defense", "noise")
    assert code == 2 and "--defense needs an attack" in err
    code, _, err = run_cli(EXAMPLES / "cnn6.py", "--verify", "rgap", "--defense", "prune:90")
    assert code == 2 and "prune:0.9" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(EXAMPLES / "cnn6.py", "--verify", "rgap", "--defense", "blur")
    assert code == 2 and err.startswith("rankaudit: error:")


@pytest.mark.slow  # an end-to-end attack of about a minute on two cores
def test_adadefense_defeats_gdbr_on_lenet10_and_shows_the_training_cost(run_cli):
    code, out, _ = run_cli(
        EXAMPLES / "lenet10.py",
        "--withheld-layers",
        "fc2",
        "--verify",
        "gdbr",
        "-b",
        "64",
        "--defense",
        "adadefense",
        "--format",
        "json",
    )
    verification = json.loads(out)["verification"]
    row = next(r for r in verification["defenses"] if r["defense"] == "adadefense" and r["attack"] == "gdbr")
    assert row["without"] >= 0.9 and row["with"] < row["chance"] < row["without"] and row["degrades"]
    training = verification["adadefense_training"]
    assert training["accuracy_without"] > 0.95 and abs(training["accuracy_with"] - training["accuracy_without"]) < 0.02
