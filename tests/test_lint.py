"""The linter's setup: one ruff version and one set of commands for CI and the repository's pre-commit hooks."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _pinned_ruff() -> str:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = [spec for spec in extras["test"] if spec.startswith("ruff")]
    assert len(pins) == 1 and pins[0].startswith("ruff=="), f"the test extra must pin ruff exactly, not {pins}"
    return pins[0]


def test_pre_commit_hooks_pin_the_ruff_ci_installs():
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    hooks = {hook["id"]: hook for repo in config["repos"] for hook in repo["hooks"]}
    assert set(hooks) == {"ruff-check", "ruff-format"}
    for hook in hooks.values():
        assert hook["additional_dependencies"] == [_pinned_ruff()]
    assert hooks["ruff-format"]["entry"].startswith("ruff format --check")


def test_ci_runs_the_lint_the_format_check_and_the_strict_docs_build():
    script = (REPO / ".ci" / "run").read_text()
    for command in ("ruff check .", "ruff format --check .", "mkdocs build --strict"):
        assert command in script, f".ci/run no longer runs `{command}`"
    # Lint and docs come before the tests, so a style error fails in seconds rather than after the suite.
    assert script.index("ruff check") < script.index("&& pytest")


def test_the_rule_set_is_stated_in_pyproject():
    ruff = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["ruff"]
    assert ruff["line-length"] == 120 and set(ruff["lint"]["select"]) >= {"F", "E4", "E7", "E9", "I", "B"}


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_the_installed_ruff_is_the_pinned_one_and_a_planted_error_fails_it(tmp_path):
    version = subprocess.run(["ruff", "--version"], capture_output=True, text=True, check=True).stdout
    assert re.search(r"\d+\.\d+\.\d+", version).group() == _pinned_ruff().split("==")[1]
    planted = tmp_path / "planted.py"
    planted.write_text("import os\n")  # F401: an unused import
    run = subprocess.run(
        ["ruff", "check", "--config", str(REPO / "pyproject.toml"), str(planted)], capture_output=True, text=True
    )
    assert run.returncode == 1 and "F401" in run.stdout
