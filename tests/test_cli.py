"""The command line: exit codes, one-line errors, the JSON contract, policies."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import EXAMPLES, REPO

CONV_NET = """
import torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 1)
    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))
"""


def write(tmp_path, name, body):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def assert_one_line_error(err, *fragments):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("rankaudit: error: ")
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0]


def test_missing_path_is_a_usage_error(run_cli, tmp_path):
    code, out, err = run_cli(tmp_path / "nope.py")
    assert code == 2 and out == ""
    assert_one_line_error(err, "does not exist", "fix:")


# Each command's arguments, files and settings are checked before torch loads: a mistyped path is answered at
# once, not after the seconds `import torch` takes on a loaded machine.
_TORCH_PROBE = """
import sys
from rankaudit.cli import main
try:
    main(sys.argv[1:])
except SystemExit as exc:
    print(exc.code, "torch" in sys.modules)
"""


@pytest.mark.parametrize(
    "args",
    [
        ["{missing}"],
        ["check", "{missing}", "--format", "json"],
        ["suggest", "{missing}"],
        ["compare", str(EXAMPLES / "cnn6.py"), "{missing}"],
        ["{bad_config}"],
    ],
    ids=["bare", "check", "suggest", "compare", "bad-config"],
)
def test_bad_input_fails_before_torch_loads(tmp_path, args):
    missing = tmp_path / "nope.py"
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text("[tool.rankaudit]\nfail-on = 'sometimes'\n")
    (project / "model.py").write_text(CONV_NET)
    argv = [arg.format(missing=missing, bad_config=project / "model.py") for arg in args]
    done = subprocess.run(
        [sys.executable, "-c", _TORCH_PROBE, *argv], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.stdout.split() == ["2", "False"], done.stdout + done.stderr
    assert_one_line_error(done.stderr)


def test_unknown_flag_is_a_usage_error(run_cli):
    code, _, err = run_cli(EXAMPLES / "cnn6.py", "--bogus")
    assert code == 2
    assert_one_line_error(err, "--bogus")


@pytest.mark.parametrize("shape", ["3,x", "0,32,32", "-3,32,32", "three", ""])
def test_malformed_shape_is_a_usage_error(run_cli, shape):
    code, _, err = run_cli(EXAMPLES / "cnn6.py", "--input-shape", shape)
    assert code == 2
    assert_one_line_error(err, "malformed input shape", "--input-shape 3,32,32")


@pytest.mark.parametrize("shape", ["3x32x32", "(3, 32, 32)", "[3,32,32]"])
def test_shape_spellings(run_cli, shape):
    code, out, _ = run_cli(EXAMPLES / "cnn6.py", "--input-shape", shape, "--format", "json")
    assert code == 1 and json.loads(out)["input_shape"] == [3, 32, 32]


def test_ambiguous_file_lists_the_candidates(run_cli, tmp_path):
    path = write(tmp_path, "two.py", CONV_NET + "\nclass Other(Net):\n    pass\nINPUT_SHAPE = (3, 8, 8)\n")
    code, _, err = run_cli(path)
    assert code == 2
    assert_one_line_error(err, "several models", "Net", "Other", ":NAME")
    code, out, _ = run_cli(f"{path}:Other", "--format", "json")
    assert code == 1 and json.loads(out)["model_name"] == "Other"


def test_unknown_name_is_a_usage_error(run_cli):
    code, _, err = run_cli(f"{EXAMPLES / 'cnn6.py'}:Nope")
    assert code == 2
    assert_one_line_error(err, "no attribute 'Nope'", "CNN6")


def test_missing_input_shape_says_how_to_give_it(run_cli, tmp_path):
    code, _, err = run_cli(write(tmp_path, "net.py", CONV_NET))
    assert code == 2
    assert_one_line_error(err, "no input shape", "--input-shape", "INPUT_SHAPE")


def test_file_raising_on_import_exits_3_with_its_line(run_cli, tmp_path):
    path = write(tmp_path, "bad.py", "import torch\nx = 1\nraise RuntimeError('no GPU here')\n")
    code, _, err = run_cli(path)
    assert code == 3
    assert_one_line_error(err, "RuntimeError: no GPU here", "bad.py:3")


def test_syntax_error_exits_3(run_cli, tmp_path):
    code, _, err = run_cli(write(tmp_path, "broken.py", "def f(:\n"))
    assert code == 3
    assert_one_line_error(err, "does not parse", "broken.py:1")


def test_file_without_a_model_exits_3(run_cli, tmp_path):
    code, _, err = run_cli(write(tmp_path, "empty.py", "import torch\nINPUT_SHAPE = (3,)\n"))
    assert code == 3
    assert_one_line_error(err, "no nn.Module")


def test_model_needing_arguments_exits_3(run_cli, tmp_path):
    body = "import torch.nn as nn\nclass Net(nn.Module):\n    def __init__(self, width):\n        super().__init__()\n"
    code, _, err = run_cli(write(tmp_path, "args.py", body + "INPUT_SHAPE = (3,)\n"))
    assert code == 3
    assert_one_line_error(err, "builds without arguments", "factory")


def test_constructor_raising_exits_3(run_cli, tmp_path):
    body = CONV_NET.replace("super().__init__()", "super().__init__(); raise ValueError('bad width')")
    code, _, err = run_cli(write(tmp_path, "ctor.py", body + "INPUT_SHAPE = (3, 8, 8)\n"))
    assert code == 3
    assert_one_line_error(err, "could not build Net()", "ValueError: bad width")


def test_wrong_input_shape_exits_3_naming_the_layer(run_cli):
    code, _, err = run_cli(EXAMPLES / "cnn6.py", "--input-shape", "3,8,8")
    assert code == 3
    assert_one_line_error(err, "shape propagation failed at fc", "3200 input features")


def test_data_dependent_control_flow_exits_3_naming_construct_and_line(run_cli, tmp_path):
    body = CONV_NET.replace(
        "return self.fc(self.conv(x).flatten(1))",
        "y = self.conv(x)\n        if y.sum() > 0:\n            y = y * 2\n        return self.fc(y.flatten(1))",
    )
    path = write(tmp_path, "flow.py", body + "INPUT_SHAPE = (3, 8, 8)\n")
    code, _, err = run_cli(path)
    assert code == 3
    assert_one_line_error(err, "could not trace", "control flow", "flow.py:10", "torch.export")


def test_shape_dependent_control_flow_falls_back_to_torch_export(run_cli, tmp_path):
    body = CONV_NET.replace(
        "return self.fc(self.conv(x).flatten(1))",
        "if x.shape[-1] > 4:\n            x = self.conv(x)\n        return self.fc(x.flatten(1))",
    )
    code, out, err = run_cli(write(tmp_path, "shapes.py", body + "INPUT_SHAPE = (3, 8, 8)\n"), "--format", "json")
    payload = json.loads(out)
    assert err == "" and payload["tracer"] == "torch.export"
    assert [(r["name"], r["inputs"], r["weights"], r["outputs"]) for r in payload["layers"]] == [
        ("conv", 192, 112, 144),
        ("fc", 144, 145, 1),
    ]
    assert any(c["code"] == "RA106" and "control flow" in c["message"] for c in payload["caveats"])


def test_policy_exit_codes(run_cli):
    exposed, partial = EXAMPLES / "fig2_a.py", EXAMPLES / "strided_stem.py"
    assert run_cli(exposed)[0] == 1
    assert run_cli(exposed, "--fail-on", "never")[0] == 0
    assert run_cli(exposed, "--fail-on", "exposed")[0] == 1
    assert run_cli(EXAMPLES / "fig2_b.py", "--fail-on", "exposed")[0] == 1  # 2,667 of 3,072: nothing hidden to speak of
    # the strided stem: 90 % of photographs keep 0.0064 % of their detail hidden, partial above --exposed-below 0.00005
    assert run_cli(partial, "--exposed-below", "0.00005")[0] == 1
    assert run_cli(partial, "--exposed-below", "0.00005", "--fail-on", "exposed")[0] == 0
    assert run_cli(partial, "--exposed-below", "0.00005", "--fail-on", "exposed", "--min-ra", "2620")[0] == 0
    code, out, _ = run_cli(partial, "--exposed-below", "0.00005", "--fail-on", "exposed", "--min-ra", "2621")
    assert code == 1 and "below the required minimum 2621" in out
    assert run_cli(exposed, "--fail-on", "never", "--min-ra", "-500")[0] == 0
    assert run_cli(exposed, "--fail-on", "never", "--min-ra", "-400")[0] == 1


def test_boundary_policy(run_cli, tmp_path):
    # conv 1->1 3x3 on 1x4x4: |x| 16, |W| 9, |z| 4 -> RA 3; a 1x1-input... build RA = 0 exactly:
    # Linear over 2 positions shares weights: x = 2*4 = 8, W = 2*4 = 8 (no bias), z = 2*2... use conv 1->1 k2 on 1x3x3:
    # |x| 9, |W| 4, |z| 4 -> RA 1; add bias: |W| 5 -> RA 0.
    body = (
        "import torch.nn as nn\nclass Edge(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.conv = nn.Conv2d(1, 1, 2)\n    def forward(self, x):\n        return self.conv(x)\n"
        "INPUT_SHAPE = (1, 3, 3)\n"
    )
    path = write(tmp_path, "edge.py", body)
    # A 3x3 input is under the photographs' reference's smallest size: nothing is certified without --data.
    code, out, _ = run_cli(path, "--format", "json")
    assert code == 1 and json.loads(out)["identifiability"]["sample"]["certified_hidden_energy"] == 0
    pytest.importorskip("sklearn", reason="the grey photo crops need scikit-learn")
    from rankaudit.bound.images import load_images

    crops = tmp_path / "crops.npy"
    np.save(crops, load_images(None, (1, 3, 3), 400, seed=0)[0].numpy())
    code, out, _ = run_cli(path, "--data", crops, "--format", "json")
    payload = json.loads(out)
    # The bound certifies a deficit: 5 gradient values (weight and bias) cannot pin 9 unknowns, but the 4 hidden
    # directions keep 0.29 % of the detail of 90 % of 400 grey photo crops (2.2 % on average): exposed at the
    # default 5 %.
    assert code == 1 and payload["verdict"] == "exposed" and payload["ra_i"] == 0
    assert payload["identifiability"]["rank_bound"] == 5 and payload["identifiability"]["certified_deficit"] == 4
    assert payload["identifiability"]["sample"]["certified_hidden_energy"] == pytest.approx(0.0029, abs=0.0003)
    assert payload["identifiability"]["sample"]["expected_hidden_energy"] == pytest.approx(0.022, abs=0.001)
    # Asking only 0.2 % for either level makes it protected; R-GAP's index sits at its boundary, which --fail-on
    # boundary refuses.
    low = ("--data", crops, "--exposed-below", "0.002", "--max-recoverable", "0.998")
    code, out, _ = run_cli(path, *low, "--format", "json")
    assert code == 0 and json.loads(out)["verdict"] == "protected"
    code, out, _ = run_cli(path, *low, "--fail-on", "boundary")
    assert code == 1 and "RA-i 0 <= 0" in out and "verdict is" not in out
    code, out, _ = run_cli(path, "--data", crops, "--exposed-below", "0.002", "--fail-on", "boundary")  # partial
    assert code == 1 and "RA-i 0 <= 0" in out and "verdict is partial" in out


JSON_LAYER_KEYS = {"name", "op", "inputs", "weights", "outputs", "virtual", "ra_i", "dense", "critical", "block"}
JSON_KEYS = {
    "rankaudit_version",
    "model",
    "input_shape",
    "batch_size",
    "tracer",
    "ra_i",
    "critical_layer",
    "verdict",
    "layers",
    "caveats",
}


def test_json_contract_keys_and_output_file(run_cli, tmp_path):
    target = tmp_path / "ra.json"
    code, out, err = run_cli(EXAMPLES / "resnet18_w16.py", "--batch-size", "4", "--format", "json", "-o", target)
    assert code == 1 and out == ""
    assert "wrote" in err and str(target) in err
    payload = json.loads(target.read_text())
    assert JSON_KEYS <= payload.keys()
    assert payload["batch_size"] == 4 and payload["input_shape"] == [3, 32, 32] and payload["tracer"] == "torch.fx"
    for layer in payload["layers"]:
        assert JSON_LAYER_KEYS <= layer.keys()
        assert layer["ra_i"] == layer["inputs"] - layer["weights"] - layer["outputs"] - layer["virtual"]
    assert sum(layer["critical"] for layer in payload["layers"]) == 1
    for caveat in payload["caveats"]:
        assert {"node", "op", "message"} <= caveat.keys()


def test_several_models_exit_with_the_worst(run_cli, tmp_path):
    code, out, err = run_cli(EXAMPLES / "fig2_b.py", EXAMPLES / "fig2_a.py")
    assert code == 1 and out.count("rankaudit 0.1.0") == 2
    code, out, err = run_cli(EXAMPLES / "fig2_b.py", tmp_path / "missing.py")
    assert code == 2 and "fig2_b.py" in out and "does not exist" in err
    code, out, _ = run_cli(EXAMPLES / "fig2_b.py", EXAMPLES / "fig2_e.py", "--format", "json", "--fail-on", "never")
    assert code == 0 and [m["ra_i"] for m in json.loads(out)] == [405, 316]


def test_table_marks_the_critical_row_and_explains_the_verdict(run_cli):
    code, out, _ = run_cli(EXAMPLES / "fig2_e.py")
    lines = out.splitlines()
    critical = [line for line in lines if line.startswith(">")]
    assert len(critical) == 1 and "conv2" in critical[0] and "316" in critical[0]
    closing = lines[lines.index(critical[0]) + 3 :][:2]  # after the table: the bound's line, then RA-i's
    closing = lines[lines.index(critical[0]) + 3 :][:3]  # after the table: the bound, the certificate, RA-i
    assert closing[0].startswith(
        "Bound: rank <= 3,056 of 3,072 unknowns (99.5 % of the directions recoverable; min cut: ∇conv1, ∇conv2, "
        "∇fc): exposed."
    )
    assert "At least 16 input directions leave every shared gradient unchanged" in closing[0]
    assert "90 % of batches like yours keep nothing of the samples' detail hidden, for any weights" in (closing[0])
    assert closing[1].startswith(
        "For any weights, including a server that picks them: nothing of a sample's detail (its difference from the "
        "average sample) is certified hidden, and its visible part can be the sample itself"
    )
    assert closing[2] == (
        "RA-i 316 at conv2: R-GAP's closed-form recursion stops at the critical layer (more unknowns "
        "than constraints there)."
    )


def test_console_script_and_module_entry_points():
    for command in (["rankaudit"], [sys.executable, "-m", "rankaudit"]):
        done = subprocess.run(
            command + [str(EXAMPLES / "fig2_a.py"), "--format", "json"], capture_output=True, text=True, cwd=REPO
        )
        assert done.returncode == 1, done.stderr
        assert json.loads(done.stdout)["ra_i"] == -484
    done = subprocess.run(["rankaudit", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and "0.1.0" in done.stdout


def test_debug_shows_the_traceback():
    done = subprocess.run(
        ["rankaudit", str(EXAMPLES / "cnn6.py"), "--input-shape", "3,8,8", "--debug"], capture_output=True, text=True
    )
    assert done.returncode != 0 and "Traceback" in done.stderr


def test_fig2_e_is_exposed_on_energy_even_at_the_weaker_gate(run_cli):
    # a certified deficit of 16 of 3,072 directions hides almost nothing of a typical photograph's energy
    code, out, _ = run_cli(EXAMPLES / "fig2_e.py", "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["verdict"] == "exposed"
    assert payload["identifiability"]["max_recoverable"] == 0.5 and payload["policy"]["fail_on"] == "partial"
    assert payload["identifiability"]["rank_bound"] == 3056
    assert payload["identifiability"]["hidden_estimate"] == pytest.approx(16 / 3072)
    code, out, _ = run_cli(EXAMPLES / "fig2_e.py", "--fail-on", "exposed", "--quiet")
    assert code == 1 and "fig2_e.py: exposed, 0 % of the detail of 90 % of samples certified hidden" in out


def test_a_large_certified_deficit_is_not_protected_when_it_hides_little_energy(run_cli):
    # 85 % of the directions hidden, but 90 % of photographs keep under 0.01 % of their detail hidden (0.4 % on average):
    # exposed, whatever the direction count
    code, out, _ = run_cli(EXAMPLES / "strided_stem.py", "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["verdict"] == "exposed" and not payload["policy"]["passed"]
    assert (payload["identifiability"]["rank_bound"], payload["identifiability"]["unknowns"]) == (452, 3072)
    code, out, _ = run_cli(EXAMPLES / "strided_stem.py", "--exposed-below", "0.00005")
    assert (
        code == 1
        and "verdict is partial: 90 % of samples like yours keep less than 0.01 % of their detail hidden" in out
    )
    code, out, _ = run_cli(EXAMPLES / "strided_stem.py", "--exposed-below", "0.00005", "--max-recoverable", "0.99995")
    assert code == 0 and "protected asks at least 0.005 %" in out


@pytest.mark.parametrize(
    "args, verdict, reason, next_step",
    [
        (
            ["strided_stem.py"],
            "exposed",
            "exit 1 (--fail-on partial): verdict is exposed",
            "rankaudit suggest examples/strided_stem.py --max-reconstruction 0.05",
        ),
        (
            ["gpt2_tiny.py"],
            "exposed",
            "exit 1 (--fail-on partial): verdict is exposed, +2 more reasons",
            "rankaudit suggest examples/gpt2_tiny.py",
        ),
        (
            ["fig2_a.py", "--dp-noise", "0.5", "--max-reconstruction", "0.1"],
            "exposed",
            "DP: reconstruction <= 0.372 at prior 0.01; exit 1 (--fail-on partial): verdict is exposed, +1 more reason",
            "rankaudit suggest examples/fig2_a.py --max-reconstruction 0.1",
        ),
        (["fig2_a.py", "--fail-on", "never"], "exposed", "exit 0: pass", None),
    ],
)
def test_quiet_prints_one_short_line_per_model(run_cli, monkeypatch, args, verdict, reason, next_step):
    """--quiet: the verdict, the share certified hidden and the exit code's reason, under 200 characters, then the
    command to run next with the user's file in it; the sentences behind them are the full output's."""
    monkeypatch.chdir(REPO)
    code, out, _ = run_cli(f"examples/{args[0]}", *args[1:], "--quiet")
    line = out.rstrip("\n")
    head, _, command = line.partition("; next: ")
    assert "\n" not in line and len(head) < 200, line
    assert head.startswith(f"examples/{args[0]}: {verdict}") and head.endswith(reason)
    assert command == (next_step or "")
    assert code == (0 if "exit 0" in reason else 1)
