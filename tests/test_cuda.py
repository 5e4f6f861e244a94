"""The verifier's CUDA path: runs wherever a GPU is present, skipped cleanly where none is."""
import json

import pytest
import torch

from conftest import EXAMPLES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_rgap_on_cuda_reconstructs_cnn6(run_cli):
    code, out, _ = run_cli(EXAMPLES / "cnn6.py", "--verify", "rgap", "--device", "cuda", "--samples", "2",
                           "--format", "json")
    verification = json.loads(out)["verification"]["rgap"]
    assert verification["device"].startswith("cuda") and verification["median_mse"] < 1e-3
    assert [layer["local_deficit"] for layer in verification["layers"]] == [0] * 7


def test_gdbr_and_the_optimisation_attack_on_cuda(run_cli):
    code, out, _ = run_cli(EXAMPLES / "lenet10.py", "--withheld-layers", "fc2", "--verify", "gdbr", "-b", "64",
                           "--device", "cuda", "--format", "json")
    gdbr = json.loads(out)["verification"]["gdbr"]
    assert gdbr["device"].startswith("cuda") and gdbr["ins_acc"] > gdbr["chance_ins_acc"]
    code, out, _ = run_cli(EXAMPLES / "resnet18_w16.py", "--verify", "rgap", "--device", "cuda", "--samples", "1",
                           "--steps", "20", "--format", "json")
    assert json.loads(out)["verification"]["rgap"]["device"].startswith("cuda")
