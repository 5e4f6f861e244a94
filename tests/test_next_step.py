"""The line that blocks names the next step, and the step works: pasted as printed, it runs and its answer passes
the gate."""

import json
import re
import shlex
import textwrap

import pytest
from conftest import TABULAR_NET


def _quiet_next(out: str) -> str:
    head, _, command = out.strip().partition("; next: ")
    assert command, out
    return command


def test_the_blocking_line_gives_the_suggest_command_with_the_round_and_the_noise_it_finds_passes(run_cli, tmp_path):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    model = tmp_path / "tabular.py"
    model.write_text(TABULAR_NET)
    round_flags = ("--local-samples", "32", "--batch-size", "8")
    code, out, _ = run_cli(model, *round_flags, "-q")
    command = _quiet_next(out)
    assert code == 1
    assert command == f"rankaudit suggest {model} -b 8 --local-samples 32 --max-reconstruction 0.05"
    # The full report says it under the header, and again at the end of the policy line.
    _, full, _ = run_cli(model, *round_flags)
    lines = full.splitlines()
    assert lines[1] == f"Next step (exposed, the policy fails): {command}"
    assert lines[-1].startswith("Policy: FAIL: ") and lines[-1].endswith(f". Next step: `{command}`")
    # Pasted as printed, it answers with a noise multiplier for this round (q = 8/32, four steps) ...
    code, out, _ = run_cli(*shlex.split(command)[1:], "--format", "json")
    noise = json.loads(out)["dp_noise"]
    assert code == 0 and (noise["sample_rate"], noise["steps"]) == (0.25, 4)
    sigma = noise["noise_multiplier"]
    # ... with which the same check passes, carried by the noise; a tenth less does not.
    passed, out, _ = run_cli(model, *round_flags, "--dp-noise", str(sigma), "--max-reconstruction", "0.05", "-q")
    assert passed == 0 and out.strip().endswith("exit 0: pass, carried by the DP noise")
    failed, out, _ = run_cli(model, *round_flags, "--dp-noise", str(0.9 * sigma), "--max-reconstruction", "0.05", "-q")
    assert failed == 1 and _quiet_next(out) == command


def test_a_full_rank_tabular_model_is_sent_to_dp_not_to_data(run_cli, tmp_path):
    model = tmp_path / "tabular.py"
    model.write_text(TABULAR_NET)
    code, out, _ = run_cli(model, "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["verdict"] == "exposed"
    sample = payload["identifiability"]["sample"]
    assert sample["rank_bound"] == sample["unknowns"] == 12  # nothing of a sample is hidden: no data can change that
    step = payload["policy"]["next_step"]
    assert step["command"] == f"rankaudit suggest {model} --max-reconstruction 0.05"
    assert "client DP noise is the way" in step["why"] and "--data" not in step["command"]
    code, table, _ = run_cli(model)
    energy = next(line for line in table.splitlines() if line.startswith("For any weights"))
    assert "give --data" not in energy and "only client DP noise" in energy
    # --data indeed changes nothing: the same verdict and next step on real tabular samples.
    datasets = pytest.importorskip("sklearn.datasets", reason="needs scikit-learn (pip install -e '.[test]')")
    import numpy as np

    wine = datasets.load_wine().data[:, :12].astype(np.float32)
    np.save(tmp_path / "wine.npy", wine)
    code, out, _ = run_cli(model, "--data", tmp_path / "wine.npy", "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["verdict"] == "exposed"
    # The same step, on the samples the run was read with.
    assert payload["policy"]["next_step"]["command"] == step["command"].replace(
        " --max", f" --data {tmp_path / 'wine.npy'} --max"
    )


SIGNAL = """
import torch.nn as nn

INPUT_SHAPE = (1, 32)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(1, 1, 6, stride=2, bias=False)
        self.fc = nn.Linear(14, 1, bias=False)

    def forward(self, x):
        return self.fc(self.conv(x).relu().flatten(1))
"""


def test_a_deficit_without_data_is_sent_to_data_and_a_passing_run_has_no_next_step(run_cli, tmp_path):
    # A 32-value signal whose shared gradients have 20 values: 12 directions certified hidden, which only --data can
    # read on energy (the input is not an image).
    model = tmp_path / "signal.py"
    model.write_text(textwrap.dedent(SIGNAL))
    code, out, _ = run_cli(model, "-q")
    assert code == 1 and _quiet_next(out) == f"rankaudit {model} --data SAMPLES.npy"
    code, out, _ = run_cli(model, "--fail-on", "never", "-q")
    assert code == 0 and "next:" not in out
    code, out, _ = run_cli(model, "--fail-on", "never", "--format", "json")
    assert json.loads(out)["policy"]["next_step"] is None


def test_the_html_report_leads_with_the_next_step(run_cli, tmp_path):
    model = tmp_path / "tabular.py"
    model.write_text(TABULAR_NET)
    code, out, _ = run_cli(model, "--format", "html")
    verdict_card = out[out.index('aria-label="verdict"') :]
    step = re.search(r'<p class="next-step"><b>Next step:</b> <code>([^<]*)</code>', verdict_card)
    assert code == 1 and step and step.group(1) == f"rankaudit suggest {model} --max-reconstruction 0.05"
    assert verdict_card.index("next-step") < verdict_card.index('class="meaning"')


def test_suggest_turns_a_target_epsilon_into_the_noise_that_meets_it(run_cli, tmp_path):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    from rankaudit.settings.accountant import PLDAccountant, SubsampledGaussian

    model = tmp_path / "tabular.py"
    model.write_text(TABULAR_NET)
    code, out, _ = run_cli(
        "suggest", model, "--local-samples", "32", "-b", "8", "--target-epsilon", "2", "--format", "json"
    )
    noise = json.loads(out)["dp_noise"]
    assert code == 0 and noise["target"] is None and noise["target_epsilon"] == 2
    sigma, q, steps = noise["epsilon_noise"], noise["sample_rate"], noise["steps"]
    assert (q, steps) == (0.25, 4)
    # The accountant's ε at δ: within the target at σ, above it a step of the search's tolerance below.
    epsilon = lambda s: PLDAccountant().profile(SubsampledGaussian(s, q, steps)).epsilon(1e-5)  # noqa: E731
    assert epsilon(sigma) <= 2 < epsilon(sigma * 0.99)
    code, _, err = run_cli("suggest", model, "--target-epsilon", "nan")
    assert code == 2 and "--target-epsilon must be a number above 0" in err and err.count("\n") == 1


# An image model without INPUT_SHAPE whose class needs an argument: the run needs --input-shape and --model-arg.
SHAPELESS = """
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 4, stride=4, bias=False)
        self.fc = nn.Linear(width * 4, 2, bias=False)

    def forward(self, x):
        return self.fc(self.conv(x).relu().flatten(1))
"""


def test_the_next_step_carries_the_input_shape_and_model_arguments_the_run_needed(run_cli, tmp_path):
    pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
    model = tmp_path / "shapeless.py"
    model.write_text(SHAPELESS)
    reading = ("--input-shape", "3,8,8", "--model-arg", "width=2", "--timeout", "120")
    code, out, _ = run_cli(model, *reading, "--format", "json")
    command = json.loads(out)["policy"]["next_step"]["command"]
    assert code == 1 and command == f"rankaudit suggest {model} {' '.join(reading)} --max-reconstruction 0.05"
    # Pasted as printed it runs (without --input-shape it stops at "no input shape", exit 2), and the check line it
    # names judges the same model again.
    code, out, err = run_cli(*shlex.split(command)[1:], "--format", "json")
    assert code == 0, err
    # Its Fisher review built the real model with the argument too (the class has no default for it).
    assert json.loads(out)["fisher"]["as_is"]["least_noise"] > 0
    check = json.loads(out)["check_command"]
    assert check == f"rankaudit check {model} --input-shape 3,8,8 --model-arg width=2"
    code, out, err = run_cli(*shlex.split(check)[1:], "-q")
    assert code == 1 and out.startswith(f"{model}: exposed"), err


def test_an_apps_next_step_keeps_the_round_flags_given_and_says_what_suggest_does_not_take(run_cli, tmp_path):
    code, out, _ = run_cli("tests/apps/quickstart", "--local-epochs", "3", "-q")
    assert (
        code == 1
        and _quiet_next(out) == "rankaudit suggest tests/apps/quickstart --local-epochs 3 --max-reconstruction 0.05"
    )
    model = tmp_path / "tabular.py"
    model.write_text(TABULAR_NET)
    code, out, _ = run_cli(model, "--withheld-layers", "fc2", "--format", "json")
    step = json.loads(out)["policy"]["next_step"]
    assert code == 1 and "withheld" not in step["command"]
    assert step["why"].endswith("(suggest reads the model without --withheld-layers, which only check takes)")
