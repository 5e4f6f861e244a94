"""One image given with --data: it is the image the verifiers attack, and the certificate falls back to the shipped
reference, said in one line (no torchvision, no scikit-learn: CI runs this file where neither is installed)."""

import json

import numpy as np
import pytest

BIAS_MLP = """from torch import nn

INPUT_SHAPE = (1, 8, 8)


class BiasMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.act = nn.LeakyReLU(0.2)
        self.fc2 = nn.Linear(32, 1, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x.flatten(1))))
"""

FALLBACK = (
    "holds 1 sample: it is what the verifiers attack, and the certificate uses the shipped photographs' reference"
)


@pytest.fixture
def one_image(tmp_path):
    model = tmp_path / "bias_mlp.py"
    model.write_text(BIAS_MLP)
    image = tmp_path / "one.npy"
    np.save(image, np.random.default_rng(0).random((1, 1, 8, 8)))
    return model, image


@pytest.mark.parametrize("verifier", ["rank", "rgap"])
def test_one_image_is_attacked_and_the_reference_falls_back_to_the_shipped_one(verifier, one_image, run_cli):
    model, image = one_image
    code, out, err = run_cli(model, "--data", image, "--verify", verifier, "--format", "json", "--fail-on", "never")
    assert code == 0, err
    payload = json.loads(out)
    bound = payload["identifiability"]
    assert FALLBACK in bound["reference_note"] and bound["spectrum"].startswith("photographs' per-sample reference")
    assert bound["sample"]["certified_hidden_energy"] is not None
    record = payload["verification"][verifier]
    if verifier == "rank":
        hidden = [entry["hidden_energy"] for sample in record["samples"] for entry in sample["inputs"]]
        assert len(hidden) == 1 and "1 image" in json.dumps(record)
    else:
        # R-GAP reads a Linear with a bias exactly: the one image comes back
        assert len(record["samples"]) == 1 and record["samples"][0]["mse"] < 1e-12


def test_the_fallback_is_said_in_the_table(one_image, run_cli):
    model, image = one_image
    code, out, _ = run_cli(model, "--data", image, "--fail-on", "never")
    assert code == 0 and FALLBACK in out and out.count(FALLBACK) == 1
