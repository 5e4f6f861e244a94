"""Stand-ins answer the model file's own imports only: an installed library learns the truth about which
packages exist, whatever the model file imported before it."""

from __future__ import annotations

import json
import textwrap

import pytest

ABSENT = "rankaudit_probe_absent"  # a package no environment has; --stand-in names it for these tests

LIBRARY = f"""
import importlib
import importlib.metadata
import importlib.util

SEEN_AT_IMPORT = importlib.util.find_spec("{ABSENT}")


def seen_now():
    return importlib.util.find_spec("{ABSENT}")


def version():
    try:
        return importlib.metadata.version("{ABSENT}")
    except importlib.metadata.PackageNotFoundError:
        return None


def load():
    return importlib.import_module("{ABSENT}")
"""

MODEL = f"""
import torch.nn as nn
import {ABSENT}  # the model file's own import: stood in for
import probe_library

INPUT_SHAPE = (4,)


def _truths():
    try:
        probe_library.load()
        imported = True
    except ModuleNotFoundError:
        imported = False
    return (probe_library.SEEN_AT_IMPORT, probe_library.seen_now(), probe_library.version(), imported)


AT_IMPORT = _truths()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        told_the_truth = AT_IMPORT == _truths() == (None, None, None, False)
        self.fc = nn.Linear(4, 3 if told_the_truth else 2)

    def forward(self, x):
        return self.fc(x)
"""


@pytest.fixture
def installed_library(tmp_path, monkeypatch):
    """probe_library installed in a site-packages folder, as pip would put it."""
    site = tmp_path / "venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    (site / "probe_library.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(site))
    yield
    import sys

    sys.modules.pop("probe_library", None)


def test_a_library_learns_the_truth_while_and_after_the_model_file_imports(run_cli, tmp_path, installed_library):
    model = tmp_path / "project" / "model.py"
    model.parent.mkdir()
    model.write_text(MODEL)
    code, out, err = run_cli(model, "--stand-in", ABSENT, "--format", "json")
    assert code in (0, 1), err
    payload = json.loads(out)
    assert payload["stand_ins"] == [ABSENT]  # the file's own import was still stood in for
    # Width 3: at the file's import and at the build, find_spec, the metadata and import_module told the library
    # the package is missing, though the file had imported a stand-in for it just before.
    assert [(row["name"], row["outputs"]) for row in payload["layers"]] == [("fc", 3)]


def test_a_neighbour_module_of_the_model_file_gets_stand_ins_too(run_cli, tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "helpers.py").write_text(f"import {ABSENT}.data as data\nWIDTH = 5\n")
    (project / "model.py").write_text(
        textwrap.dedent("""
        import torch.nn as nn
        from helpers import WIDTH
        INPUT_SHAPE = (4,)
        model = nn.Linear(4, WIDTH)
        """)
    )
    code, out, err = run_cli(project / "model.py", "--stand-in", ABSENT, "--format", "json")
    assert code in (0, 1), err
    assert json.loads(out)["stand_ins"] == [ABSENT]


def test_an_installed_library_importing_a_missing_package_is_not_stood_in_for(run_cli, tmp_path, installed_library):
    model = tmp_path / "project" / "model.py"
    model.parent.mkdir()
    model.write_text(
        "import torch.nn as nn\nimport probe_library\nINPUT_SHAPE = (4,)\nprobe_library.load()\nmodel = nn.Linear(4, 2)\n"
    )
    code, out, err = run_cli(model, "--stand-in", ABSENT)
    assert code == 3 and len(err.strip().splitlines()) == 1
    assert f"imports a library that needs {ABSENT}, which is not installed" in err and "probe_library.py" in err
    assert "pass --stand-in" not in err  # it would not help: a stand-in answers the model's own imports only


def test_the_ci_environment_without_optional_packages_hides_them(tmp_path):
    """dev/hide_packages, as CI's language-model step uses it: an installed package (jinja2 here) is gone for
    imports, find_spec and the metadata, in this process and in its children."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    probe = (
        "import importlib.metadata, importlib.util, subprocess, sys\n"
        "try:\n    import jinja2\n    imported = True\nexcept ModuleNotFoundError:\n    imported = False\n"
        "try:\n    importlib.metadata.version('Jinja2')\n    listed = True\n"
        "except importlib.metadata.PackageNotFoundError:\n    listed = False\n"
        "child = subprocess.run([sys.executable, '-c', 'import importlib.util; "
        'print(importlib.util.find_spec("jinja2"))\'], capture_output=True, text=True).stdout.strip()\n'
        "print(imported, importlib.util.find_spec('jinja2'), listed, child, importlib.util.find_spec('torch') is None)\n"
    )
    environment = {**os.environ, "RANKAUDIT_HIDE_PACKAGES": "jinja2,flwr"}
    environment["PYTHONPATH"] = os.pathsep.join([str(repo / "dev" / "hide_packages"), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=environment, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "None", "False", "None", "False"]
