"""The pre-commit hook through the real pre-commit framework: a protected model commits, an exposed one is blocked."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import EXAMPLES, REPO


def _git(cwd, *args, check=True, env=None):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=check, env=env)


def _snapshot_of_checkout(target: Path) -> str:
    """A commit holding this checkout as it is now, uncommitted edits included (what `try-repo` does)."""
    _git(REPO.parent, "clone", "--quiet", str(REPO), str(target))
    tracked = _git(REPO, "ls-files", "-z").stdout.split("\0")
    untracked = _git(REPO, "ls-files", "-z", "--others", "--exclude-standard").stdout.split("\0")
    for name in filter(None, tracked + untracked):
        source = REPO / name
        if source.is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    _git(target, "add", "-A")
    _git(
        target,
        "-c",
        "user.email=ci@rankaudit",
        "-c",
        "user.name=ci",
        "commit",
        "--quiet",
        "--allow-empty",
        "-m",
        "snapshot",
    )
    return _git(target, "rev-parse", "HEAD").stdout.strip()


_BUILDING_BLOCKS = """import torch.nn as nn


class ConvBlock(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return self.conv(x).relu()
"""


def test_hook_mode_skips_a_file_of_building_blocks_and_model_args_audit_it(run_cli, tmp_path):
    blocks = tmp_path / "blocks.py"
    blocks.write_text(_BUILDING_BLOCKS)
    code, out, err = run_cli("--quiet", "--skip-non-models", "-v", blocks)
    assert (code, out) == (0, "")
    assert (
        err.strip()
        == f"rankaudit: skipped {blocks}: no model in {blocks} builds without arguments (found ConvBlock, each needs arguments)"
    )
    code, _, err = run_cli("--quiet", blocks)  # outside hook mode it is an error naming the fix
    assert code == 3 and "--model-arg KEY=VALUE (model-args in [tool.rankaudit])" in err
    # Named with its arguments, the same file is audited: 3x8x8 through one 3x3 convolution, 84 of 192 directions.
    # (84 of 192 directions still show most of a typical photo's energy: exposed, so the gate is opened to read it)
    code, out, _ = run_cli(
        "--quiet",
        "--skip-non-models",
        blocks,
        "--model-arg",
        "channels=3",
        "--input-shape",
        "3,8,8",
        "--fail-on",
        "never",
    )
    assert code == 0 and f"{blocks}: exposed, " in out
    # The same from pyproject.toml: [[tool.rankaudit.models]] names the file, its arguments and its input shape.
    (tmp_path / "pyproject.toml").write_text(
        '[tool.rankaudit]\nfail-on = "never"\n\n'
        '[[tool.rankaudit.models]]\npath = "blocks.py"\nmodel-args = { channels = 3 }\ninput-shape = [3, 8, 8]\n'
    )
    code, out, _ = run_cli("--quiet", "--skip-non-models", blocks)
    assert code == 0 and f"{blocks}: exposed, " in out


def test_a_missing_import_names_the_hooks_additional_dependencies(run_cli, tmp_path):
    model = tmp_path / "hf_model.py"
    model.write_text(
        "import torch.nn as nn\nimport not_installed_anywhere_xyz\n\nINPUT_SHAPE = (4,)\nnet = nn.Linear(4, 2)\n"
    )
    code, out, err = run_cli("--quiet", "--skip-non-models", model)
    assert code == 3 and out == ""
    assert "imports not_installed_anywhere_xyz, which is not installed in the environment rankaudit runs in" in err
    assert 'additional_dependencies: ["not_installed_anywhere_xyz"]' in err and len(err.strip().splitlines()) == 1


def test_manifest_declares_the_hook():
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "rankaudit")
    assert hook["language"] == "python" and hook["require_serial"] is True
    import re

    pattern = re.compile(hook["files"])
    assert pattern.search("models/resnet.py") and pattern.search("src/my_model.py")
    assert not pattern.search("tests/test_utils.py")


def documented_local_hooks(with_app: bool = False) -> str:
    """The `.pre-commit-config.yaml` docs/ci.md gives: its `repo: local` block, and with `with_app` the app hook it
    shows for a Flower app or NVFlare job at the repository's root, beside it."""
    import re

    page = (REPO / "docs" / "ci.md").read_text(encoding="utf-8")
    section = page.split("## pre-commit\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```yaml\n(.*?)^```", section, re.S | re.M)
    local = next(block for block in blocks if "repo: local" in block)
    app = next(block for block in blocks if "id: rankaudit-app" in block)
    return local + (app if with_app else "")


def hook_environment(tmp_path) -> dict:
    """The committer's environment: the `rankaudit` rankaudit's tests run (this checkout) first on PATH."""
    scripts = Path(sys.executable).parent
    return {
        **os.environ,
        "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PRE_COMMIT_HOME": str(tmp_path / "cache"),
        "GIT_AUTHOR_NAME": "ci",
        "GIT_AUTHOR_EMAIL": "ci@rankaudit",
        "GIT_COMMITTER_NAME": "ci",
        "GIT_COMMITTER_EMAIL": "ci@rankaudit",
    }


def install_hooks(project: Path, config: str, env: dict) -> None:
    if shutil.which("pre-commit") is None and os.environ.get("CI") != "true":
        pytest.skip("needs pre-commit, which is not installed (pip install -e '.[test]')")
    _git(project, "init", "--quiet")
    (project / ".pre-commit-config.yaml").write_text(config)
    installed = subprocess.run(
        [sys.executable, "-m", "pre_commit", "install"], cwd=project, capture_output=True, text=True, env=env
    )
    assert installed.returncode == 0, installed.stderr
    _git(project, "add", ".pre-commit-config.yaml", env=env)
    _git(project, "commit", "--quiet", "--no-verify", "-m", "config", env=env)


def documented_dp_fix() -> str:
    """What-now's fix for an image model, as the page gives it: the client's DP settings in pyproject.toml."""
    import re

    page = (REPO / "docs" / "what-now.md").read_text(encoding="utf-8")
    return next(b for b in re.findall(r"^```toml\n(.*?)^```", page, re.S | re.M) if "[tool.rankaudit.dp]" in b)


@pytest.mark.slow  # pre-commit builds the hook's environment and runs three commits (18 s)
def test_the_documented_hook_blocks_an_exposed_model_and_the_documented_fix_passes_it(tmp_path):
    """The hook docs/ci.md gives (repo: local, the committer's own environment): a protected model commits, an
    exposed one is blocked, and what-now's fix, client DP in pyproject.toml, lets it through (the DP bound's
    extra is in the environment the hook runs in)."""
    project = tmp_path / "project"
    project.mkdir()
    env = hook_environment(tmp_path)
    install_hooks(project, documented_local_hooks(), env)

    # A project that asks only 0.005 % of each sample's detail hidden: the strided stem keeps 0.0064 % hidden for 90 % of
    # photographs, so it is protected there; Figure 2(a) keeps nothing hidden and stays exposed.
    (project / "pyproject.toml").write_text("[tool.rankaudit]\nmax-recoverable = 0.99995\nexposed-below = 0.00005\n")
    _git(project, "add", "pyproject.toml", env=env)
    shutil.copy(EXAMPLES / "strided_stem.py", project / "protected_model.py")
    (project / "helpers_model.py").write_text("SCALE = 2\n")  # no model in it: skipped, not an error
    (project / "models").mkdir()
    (project / "models" / "blocks.py").write_text(_BUILDING_BLOCKS)  # no zero-argument model: skipped too
    _git(project, "add", "protected_model.py", "helpers_model.py", "models/blocks.py", env=env)
    passed = _git(project, "commit", "-m", "protected model", check=False, env=env)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "Passed" in passed.stdout + passed.stderr

    shutil.copy(EXAMPLES / "fig2_a.py", project / "exposed_model.py")
    # A Hugging Face model file: tiny GPT-2 from a config, offline (transformers from the committer's environment).
    shutil.copy(EXAMPLES / "gpt2_tiny.py", project / "hf_model.py")
    _git(project, "add", "exposed_model.py", "hf_model.py", env=env)
    blocked = _git(project, "commit", "-m", "exposed model", check=False, env=env)
    output = blocked.stdout + blocked.stderr
    assert blocked.returncode != 0
    assert (
        "Failed" in output
        and "exposed_model.py: exposed, 0 % of the detail of 90 % of samples certified hidden" in output
    )
    assert "hf_model.py: exposed, " in output
    assert _git(project, "log", "--oneline", env=env).stdout.count("\n") == 2  # the exposed commit did not land

    _git(project, "reset", "--quiet", "hf_model.py", env=env)
    (project / "pyproject.toml").write_text(documented_dp_fix())
    _git(project, "add", "pyproject.toml", env=env)
    fixed = _git(project, "commit", "-m", "client DP", check=False, env=env)
    output = fixed.stdout + fixed.stderr
    assert fixed.returncode == 0 and "Passed" in output, output


def test_the_documented_app_hook_audits_the_app_as_deployed(tmp_path):
    """The rankaudit-app hook of docs/ci.md runs `rankaudit --quiet .` on a Flower app at the repository's root."""
    project = tmp_path / "project"
    shutil.copytree(REPO / "tests" / "apps" / "quickstart", project, ignore=shutil.ignore_patterns("__pycache__"))
    env = hook_environment(tmp_path)
    install_hooks(project, documented_local_hooks(with_app=True), env)
    _git(project, "add", "-A", env=env)
    # Each sample is read by one local step of this round: exposed, the commit is blocked.
    blocked = _git(project, "commit", "-m", "the app", check=False, env=env)
    output = blocked.stdout + blocked.stderr
    assert blocked.returncode != 0 and "Failed" in output and "quickstart_app/task.py:Net" in output
    assert "exposed" in output
    pyproject = project / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("[tool.rankaudit]\n", '[tool.rankaudit]\nfail-on = "never"\n'))
    _git(project, "add", "-A", env=env)
    passed = _git(project, "commit", "-m", "the app, reported only", check=False, env=env)
    assert passed.returncode == 0, passed.stdout + passed.stderr


@pytest.mark.slow
def test_the_hooks_of_the_repository_build_their_own_environment(tmp_path):
    """The manifest's hook (repo: the repository, rev: a commit): pre-commit builds its own environment, torch
    borrowed from this one here (a fresh build takes most of half an hour on two cores)."""
    hook_repo, project = tmp_path / "hook", tmp_path / "project"
    rev = _snapshot_of_checkout(hook_repo)
    project.mkdir()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch==2.13.0\n")  # the CPU build; analysis never needs CUDA
    env = {
        **hook_environment(tmp_path),
        "PIP_CONSTRAINT": str(constraints),
        # Let the hook's virtualenv see the torch already installed instead of copying 1 GB again.
        "VIRTUALENV_SYSTEM_SITE_PACKAGES": "true",
    }
    install_hooks(project, f"repos:\n- repo: {hook_repo}\n  rev: {rev}\n  hooks:\n  - id: rankaudit\n", env)
    # The strided stem is protected in a project that asks only 0.005 % of each sample's detail hidden.
    (project / "pyproject.toml").write_text("[tool.rankaudit]\nmax-recoverable = 0.99995\nexposed-below = 0.00005\n")
    _git(project, "add", "pyproject.toml", env=env)
    shutil.copy(EXAMPLES / "strided_stem.py", project / "protected_model.py")
    _git(project, "add", "protected_model.py", env=env)
    passed = _git(project, "commit", "-m", "protected model", check=False, env=env)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    shutil.copy(EXAMPLES / "fig2_a.py", project / "exposed_model.py")
    _git(project, "add", "exposed_model.py", env=env)
    blocked = _git(project, "commit", "-m", "exposed model", check=False, env=env)
    assert blocked.returncode != 0 and "exposed_model.py: exposed, " in blocked.stdout + blocked.stderr
