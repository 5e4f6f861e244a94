"""`--verify` through the command line: the JSON contract, the thresholds of the issues, the errors."""
import json

import pytest

from conftest import EXAMPLES

GDBR_KEYS = {"shared_layer", "batch_size", "ins_acc", "cls_acc", "trials", "seconds", "recovered", "true"}


@pytest.mark.parametrize("example, flags, layer", [
    ("mlp6.py", ("--shared-layers", "fc1,fc2"), "fc2"),
    ("lenet10.py", ("--withheld-layers", "fc2"), "fc1"),
])
def test_gdbr_recovers_most_labels_of_a_64_batch_from_one_hidden_layer(run_cli, example, flags, layer):
    code, out, err = run_cli(EXAMPLES / example, *flags, "--verify", "gdbr", "--batch-size", "64", "--format", "json")
    payload = json.loads(out)
    gdbr = payload["verification"]["gdbr"]
    assert GDBR_KEYS <= gdbr.keys() and gdbr["shared_layer"] == layer and gdbr["batch_size"] == 64
    assert gdbr["ins_acc"] >= 0.80 and gdbr["cls_acc"] >= 0.95
    assert sum(gdbr["recovered"].values()) == 64 and sum(gdbr["true"].values()) == 64
    assert gdbr["trials"] == 5 and payload["label_leakage"]["risk"] == "high"


def test_gdbr_needs_a_shared_hidden_layer(run_cli):
    code, _, err = run_cli(EXAMPLES / "mlp6.py", "--shared-layers", "classifier", "--verify", "gdbr")
    assert code == 2 and "no shared hidden layer" in err and "classifier is shared" in err


def test_cuda_requested_without_a_gpu_is_a_usage_error(run_cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code, _, err = run_cli(EXAMPLES / "lenet10.py", "--verify", "gdbr", "--device", "cuda", "--trials", "1")
    assert code == 2 and "no CUDA device" in err
