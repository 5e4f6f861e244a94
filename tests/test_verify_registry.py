"""The verifier registry: --verify's names and help come from it, and a new verifier is one module and one line."""

import json
import subprocess
import sys

import click
import pytest
from conftest import EXAMPLES

from rankaudit.cli import check
from rankaudit.verify import registry
from rankaudit.verify.registry import Verifier


def _fake_record(context):
    """A verifier that reads the request it is handed and returns a record built from it."""
    return {
        "model": context.result.model,
        "batch_size": context.result.batch_size,
        "seed": context.seed,
        "requested": list(context.requested),
        "internal_error": "the fake's bound was broken" if context.seed == 13 else None,
    }


FAKE = Verifier(
    name="fake",
    help="a verifier the test registers.",
    needs=frozenset(),
    run=_fake_record,
)


@pytest.fixture
def fake_registered(monkeypatch):
    monkeypatch.setitem(registry.verifiers(), "fake", FAKE)


def _verify_option() -> click.Option:
    return next(param for param in check.params if param.name == "verify")


def test_the_choices_and_help_of_verify_are_the_registry():
    option = _verify_option()
    assert list(option.type.choices) == registry.names() == ["rgap", "gdbr", "rank", "fisher", "dager", "dp", "bias"]
    assert option.help == registry.help_text()
    for verifier in registry.verifiers().values():
        assert f"{verifier.name}: {verifier.help}" in option.help


def test_a_registered_verifier_runs_from_the_command_line_and_its_record_is_in_the_json(run_cli, fake_registered):
    code, out, err = run_cli(EXAMPLES / "lenet.py", "--verify", "fake", "--seed", "5", "-b", "2", "--format", "json")
    record = json.loads(out)["verification"]["fake"]
    assert code in (0, 1) and record["seed"] == 5 and record["batch_size"] == 2 and record["requested"] == ["fake"]
    assert record["model"].endswith("lenet.py") and "error" not in err


def test_a_registered_verifier_is_in_the_help_and_the_choices(run_cli, fake_registered):
    code, out, _ = run_cli("check", "--help")
    assert code == 0 and "fake: a verifier the test registers." in " ".join(out.split())
    code, _, err = run_cli(EXAMPLES / "lenet.py", "--verify", "nonesuch")
    assert code == 2 and "'fake'" in err


def test_a_record_s_internal_error_is_said_on_stderr(run_cli, fake_registered):
    code, _, err = run_cli(EXAMPLES / "lenet.py", "--verify", "fake", "--seed", "13", "-q")
    assert "internal error" not in err and "lenet.py: the fake's bound was broken" in err


def test_a_verifier_without_a_round_form_refuses_a_round(run_cli, fake_registered):
    """The dispatch reads the verifier's needs, not its name: one without Need.ROUND refuses a round of two steps."""
    code, _, err = run_cli(EXAMPLES / "lenet.py", "--verify", "fake", "--local-samples", "4", "-b", "2")
    assert code == 2 and "--verify fake reads one shared gradient" in err and "2 local steps" in err


def test_defense_needs_a_verifier_that_is_defended(run_cli, fake_registered):
    code, _, err = run_cli(EXAMPLES / "lenet.py", "--verify", "fake", "--defense", "noise:0.01")
    assert code == 2 and "--defense applies to the rgap and gdbr attacks" in err
    assert registry.defendable() == ["rgap", "gdbr"]


def test_the_registry_loads_without_torch():
    """The CLI reads names and help before any model is loaded: no verifier module imports torch at its top."""
    probe = "import sys; from rankaudit.verify import registry; registry.verifiers(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
