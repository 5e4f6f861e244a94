"""The static gradient-bridge rule (GDBR Theorems 1-2, Eq. 16-19) on nets whose answer is known by hand."""

import json

from conftest import EXAMPLES, analyse_module
from torch import nn


def bridges(result):
    return {b.name: (b.bridge, b.blocked_by, b.kind) for b in result.label_leakage.layers}


def test_mlp6_every_layer_bridges_to_the_logits(run_cli):
    code, out, _ = run_cli(EXAMPLES / "mlp6.py", "--format", "json")
    leakage = json.loads(out)["label_leakage"]
    assert leakage["risk"] == "high"
    assert [(layer["name"], layer["bridge"], layer["blocked_by"]) for layer in leakage["layers"]] == [
        (name, True, None) for name in ("fc1", "fc2", "fc3", "fc4", "fc5", "fc6", "classifier")
    ]
    assert [layer["direct"] for layer in leakage["layers"]] == [False] * 6 + [True]


def test_a_widening_layer_blocks_the_bridge_below_it():
    def build():
        return nn.Sequential(
            nn.Linear(32, 64),
            nn.ReLU(),
            nn.Linear(64, 16),
            nn.ReLU(),
            nn.Linear(16, 48),
            nn.ReLU(),
            nn.Linear(48, 10),
        )

    result = analyse_module(build, (32,))
    assert bridges(result) == {
        "0": (False, "4", "widens"),  # 64 -> 16 narrows, then 16 -> 48 widens: blocked at "4"
        "2": (False, "4", "widens"),
        "4": (True, None, "bridge"),  # its own width does not matter; 48 -> 10 after it narrows
        "6": (True, None, "direct"),
    }
    assert result.label_leakage.risk == "high"


def test_sigmoid_on_the_way_blocks_but_leaky_relu_does_not():
    sigmoid = analyse_module(lambda: nn.Sequential(nn.Linear(8, 6), nn.Sigmoid(), nn.Linear(6, 3)), (8,))
    leaky = analyse_module(lambda: nn.Sequential(nn.Linear(8, 6), nn.LeakyReLU(), nn.Linear(6, 3)), (8,))
    assert bridges(sigmoid)["0"] == (False, "1", "activation")
    assert bridges(leaky)["0"] == (True, None, "bridge")


def test_conv_with_spatial_output_cannot_start_a_bridge_but_a_1x1_output_can():
    def build():
        return nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.ReLU(),
            nn.Conv2d(8, 6, 4),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(6, 4),
        )

    result = analyse_module(build, (3, 6, 6))
    assert bridges(result) == {"0": (False, "0", "positions"), "2": (True, None, "bridge"), "5": (True, None, "direct")}


def test_withholding_the_last_layers_leaves_the_risk_to_the_bridge(run_cli):
    code, out, _ = run_cli(EXAMPLES / "mlp6.py", "--withheld-layers", "fc6,classifier", "--format", "json")
    leakage = json.loads(out)["label_leakage"]
    shared = {layer["name"] for layer in leakage["layers"] if layer["shared"]}
    assert shared == {"fc1", "fc2", "fc3", "fc4", "fc5"} and leakage["risk"] == "high"
    code, out, _ = run_cli(EXAMPLES / "cnn6.py", "--withheld-layers", "fc", "--format", "json")
    assert json.loads(out)["label_leakage"]["risk"] == "low"
    code, out, _ = run_cli(EXAMPLES / "cnn6.py", "--format", "json")
    assert json.loads(out)["label_leakage"]["risk"] == "high"  # the logits layer itself is shared


def test_shared_layers_flag_names_must_exist(run_cli):
    code, _, err = run_cli(EXAMPLES / "mlp6.py", "--shared-layers", "fc1,fc9")
    assert code == 2 and "no layer, module or parameter named fc9" in err and "fc1, fc2" in err
    code, _, err = run_cli(EXAMPLES / "mlp6.py", "--shared-layers", "fc1", "--withheld-layers", "fc2")
    assert code == 2 and "both --shared-layers and --withheld-layers" in err


def test_table_names_the_layers_whose_gradient_suffices(run_cli):
    _, out, _ = run_cli(EXAMPLES / "mlp6.py", "--shared-layers", "fc1,fc2")
    assert "Label leakage: high. The gradient of any one of fc1, fc2 reveals" in out
