"""[tool.rankaudit] in pyproject.toml: found by walking up from the model file, flags win, errors name the key."""

import json
import shutil
import textwrap

import pytest
from conftest import EXAMPLES

NO_SHAPE_MODEL = """
import torch.nn as nn
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 4, bias=False)
        self.fc = nn.Linear(3 * 29 * 29, 1, bias=False)
    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))
"""


@pytest.fixture
def project(tmp_path):
    models = tmp_path / "src" / "models"
    models.mkdir(parents=True)
    (models / "net.py").write_text(textwrap.dedent(NO_SHAPE_MODEL))
    shutil.copy(EXAMPLES / "fig2_a.py", models / "exposed.py")

    def configure(body: str):
        (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n\n" + textwrap.dedent(body))
        return models

    return configure


def test_settings_come_from_the_nearest_pyproject(run_cli, project):
    models = project("""
        [tool.rankaudit]
        fail-on = "never"
        batch-size = 2
        [[tool.rankaudit.models]]
        path = "src/models/net.py"
        input-shape = [3, 32, 32]
    """)
    code, out, _ = run_cli(models / "net.py", "--format", "json")
    payload = json.loads(out)
    assert code == 0 and payload["input_shape"] == [3, 32, 32] and payload["batch_size"] == 2
    assert payload["policy"]["fail_on"] == "never"
    assert run_cli(models / "exposed.py")[0] == 0  # fail-on never applies to every file


def test_command_line_flags_win(run_cli, project):
    models = project("""
        [tool.rankaudit]
        fail-on = "never"
        batch-size = 2
    """)
    code, out, _ = run_cli(models / "exposed.py", "--fail-on", "exposed", "--batch-size", "1", "--format", "json")
    assert code == 1 and json.loads(out)["batch_size"] == 1


def test_min_ra_and_globs(run_cli, project):
    models = project("""
        [tool.rankaudit]
        min-ra = 406
        [[tool.rankaudit.models]]
        path = "src/models/*.py"
        input-shape = "3,32,32"
    """)
    code, out, _ = run_cli(models / "net.py")
    assert code == 1 and "below the required minimum 406" in out


def test_withheld_layers_from_config(run_cli, project):
    models = project("""
        [tool.rankaudit]
        withheld-layers = ["fc"]
    """)
    _, out, _ = run_cli(models / "exposed.py", "--format", "json")
    assert json.loads(out)["label_leakage"]["risk"] == "low"


@pytest.mark.parametrize(
    "body, key",
    [
        ('fail-on = "sometimes"', "fail-on"),
        ("batch-size = 0", "batch-size"),
        ('min-ra = "low"', "min-ra"),
        ("shared-layer = ['fc']", "shared-layer"),
        ("[[tool.rankaudit.models]]\npath = 'src/models/net.py'\ninput-shape = [3, -1]", "models.input-shape"),
        ("[[tool.rankaudit.models]]\nshape = [3]", "models"),
    ],
)
def test_config_errors_exit_2_naming_the_key(run_cli, project, body, key):
    models = project("[tool.rankaudit]\n" + body + "\n")
    code, _, err = run_cli(models / "exposed.py")
    assert code == 2 and key in err and "pyproject.toml" in err and len(err.strip().splitlines()) == 1


def test_invalid_toml_is_a_usage_error(run_cli, project):
    models = project("[tool.rankaudit\nfail-on = 1\n")
    code, _, err = run_cli(models / "exposed.py")
    assert code == 2 and "not valid TOML" in err


def test_a_pyproject_without_the_table_is_passed_over(run_cli, tmp_path):
    inner = tmp_path / "pkg"
    inner.mkdir()
    (inner / "pyproject.toml").write_text("[project]\nname = 'inner'\n")
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\nfail-on = 'never'\n")
    shutil.copy(EXAMPLES / "fig2_a.py", inner / "exposed.py")
    assert run_cli(inner / "exposed.py")[0] == 0


def test_max_recoverable_from_config_sets_the_share_protected_asks(run_cli, project):
    models = project("""
        [tool.rankaudit]
        max-recoverable = 0.99995
        exposed-below = 0.00005
    """)
    # R_s = 452 of 3,072: 90 % of photographs keep 0.0064 % of their detail hidden
    shutil.copy(EXAMPLES / "strided_stem.py", models / "stem.py")
    code, out, _ = run_cli(models / "stem.py", "--format", "json")
    payload = json.loads(out)
    assert code == 0 and payload["verdict"] == "protected" and payload["identifiability"]["max_recoverable"] == 0.99995
    assert payload["identifiability"]["exposed_below"] == 0.00005
    code, out, _ = run_cli(models / "stem.py", "--max-recoverable", "0.5", "--format", "json")  # the flag wins
    assert code == 1 and json.loads(out)["verdict"] == "partial"
    models = project("[tool.rankaudit]\nmax-recoverable = 2\n")
    code, _, err = run_cli(models / "stem.py")
    assert code == 2 and "max-recoverable" in err and len(err.strip().splitlines()) == 1
    models = project("[tool.rankaudit]\nexposed-below = -1\n")
    code, _, err = run_cli(models / "stem.py")
    assert code == 2 and "exposed-below" in err and len(err.strip().splitlines()) == 1


def test_fail_on_partial_and_exposed_from_config(run_cli, project):
    models = project('[tool.rankaudit]\nfail-on = "exposed"\nexposed-below = 0.00005\n')
    shutil.copy(EXAMPLES / "strided_stem.py", models / "stem.py")  # 0.0064 % certified hidden: partial here
    assert run_cli(models / "stem.py")[0] == 0
    assert run_cli(models / "stem.py", "--fail-on", "partial")[0] == 1
