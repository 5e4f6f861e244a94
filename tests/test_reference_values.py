"""The spec's reference values (method.md: counting) and R-GAP Figure 4, through the whole path from a model file."""

import json

import pytest
from conftest import EXAMPLES

from rankaudit.audit import audit

FIGURE_2 = [
    ("fig2_a.py", -484, "conv1", "exposed"),
    # Read on energy (method.md: energy): certified deficits of 405 and 16 of 3,072 directions hide almost none of a typical
    # photograph's energy, so Figures 2(b), 2(c) and 2(e) are exposed like 2(a) and 2(d).
    ("fig2_b.py", 405, "conv1", "exposed"),
    ("fig2_c.py", 405, "conv1", "exposed"),
    ("fig2_d.py", -208, "conv2", "exposed"),
    ("fig2_e.py", 316, "conv2", "exposed"),
]


@pytest.mark.parametrize("filename, ra_i, critical, verdict", FIGURE_2)
def test_figure_2_networks(filename, ra_i, critical, verdict):
    result = audit(str(EXAMPLES / filename))
    assert (result.ra_i, result.critical_layer, result.verdict) == (ra_i, critical, verdict)


@pytest.mark.parametrize("filename, ra_i, critical, verdict", FIGURE_2)
def test_figure_2_through_the_json_contract(run_cli, filename, ra_i, critical, verdict):
    code, out, _ = run_cli(EXAMPLES / filename, "--format", "json")
    payload = json.loads(out)
    assert (payload["ra_i"], payload["critical_layer"], payload["verdict"]) == (ra_i, critical, verdict)
    assert code == 1  # none is protected: exposed, or partial with most directions recoverable (method.md: verdicts)
    code, _, _ = run_cli(EXAMPLES / filename, "--fail-on", "exposed")
    assert code == (1 if verdict == "exposed" else 0)


def test_fig2_d_row_by_row():
    result = audit(str(EXAMPLES / "fig2_d.py"))
    rows = [(r.name, r.inputs, r.weights, r.outputs, r.virtual, r.ra_i, r.dense) for r in result.layers]
    assert rows == [
        ("conv1", 3072, 108, 3600, 0, -636, False),
        ("conv2", 3600, 144, 3136, 528, -208, False),
        ("fc", 3136, 3136, 1, 208, -209, True),
    ]


def test_fig2_c_wide_linear_is_dense_and_carries_the_deficit():
    result = audit(str(EXAMPLES / "fig2_c.py"))
    fc1 = result.layers[1]
    assert (fc1.name, fc1.dense, fc1.virtual) == ("fc1", True, -405)
    assert not fc1.critical


def test_resnet18_w16_figure_4():
    """R-GAP Figure 4: RA-i -1.0e4; cutting block 3's skip raises it to -7.8e3; cutting block 8's changes nothing."""
    base = audit(str(EXAMPLES / "resnet18_w16.py"))
    cut3 = audit(str(EXAMPLES / "resnet18_w16_cut3.py"))
    cut8 = audit(str(EXAMPLES / "resnet18_w16_cut8.py"))
    assert (base.ra_i, base.critical_layer) == (-10240, "layer2.0.conv1")
    assert (cut3.ra_i, cut3.critical_layer) == (-7808, "avgpool")
    assert (cut8.ra_i, cut8.critical_layer) == (-10240, "layer2.0.conv1")
    assert round(base.ra_i, -3) == -10000 and round(cut3.ra_i, -2) == -7800
    critical = base.critical_row
    assert critical.folded == ["layer2.0.downsample.0"] and critical.weights == 4608 + 512
    assert critical.block == "layer2.0"
    assert {b.name: b.kind for b in base.blocks} == {
        "layer1.0": "identity",
        "layer1.1": "identity",
        "layer2.0": "projection",
        "layer2.1": "identity",
        "layer3.0": "projection",
        "layer3.1": "identity",
        "layer4.0": "projection",
        "layer4.1": "identity",
    }
    assert len(cut3.blocks) == 7 and "layer2.0" not in {b.name for b in cut3.blocks}


def test_cnn6_counts():
    result = audit(str(EXAMPLES / "cnn6.py"))
    assert [(r.name, r.inputs, r.weights, r.outputs) for r in result.layers] == [
        ("conv1", 3072, 576, 3468),
        ("conv2", 3468, 3888, 2916),
        ("conv3", 2916, 11664, 2916),
        ("conv4", 2916, 11664, 2916),
        ("conv5", 2916, 20736, 1600),
        ("conv6", 1600, 73728, 3200),
        ("fc", 3200, 3200, 1),
    ]
    assert (result.ra_i, result.critical_layer, result.verdict) == (-972, "conv1", "exposed")


def test_cnn6_d_second_layer_counts_as_over_determined():
    """method.md: numerical check: locally |x| - |W| - |z| = -312 at conv2 (the numerical rank tells otherwise)."""
    conv2 = audit(str(EXAMPLES / "cnn6_d.py")).layers[1]
    assert conv2.inputs - conv2.weights - conv2.outputs == -312


def test_lenet_and_lenet_star_count_alike():
    lenet, leaky = audit(str(EXAMPLES / "lenet.py")), audit(str(EXAMPLES / "lenet_leaky.py"))
    assert [r.ra_i for r in lenet.layers] == [r.ra_i for r in leaky.layers]
    assert [(r.inputs, r.weights, r.outputs) for r in lenet.layers][:3] == [
        (784, 300, 2352),
        (2352, 3600, 588),
        (588, 3600, 588),
    ]


def test_mlp6_every_layer_dense_at_batch_1():
    result = audit(str(EXAMPLES / "mlp6.py"))
    assert [r.name for r in result.layers] == ["fc1", "fc2", "fc3", "fc4", "fc5", "fc6", "classifier"]
    assert all(r.dense for r in result.layers)
    assert (result.ra_i, result.critical_layer, result.verdict) == (None, None, "exposed")
    assert any(c.code == "RA102" for c in result.caveats)  # ReLU note, once
    assert sum(c.code == "RA102" for c in result.caveats) == 1
