"""`rankaudit DIR` on apps configured in YAML (Hydra's defaults lists, `${...}`, `_target_`), NVFlare's other job
styles, and privacy settings that live in a config: each value read with its file and line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from rankaudit.deploy.app import Overrides, read_deployment
from rankaudit.deploy.yamlconf import app_yaml

APPS = Path(__file__).resolve().parent / "apps"
GIVEN = Overrides(round={"local_samples": 32}, input_shape_given=True)  # what an app cannot say


@pytest.fixture(autouse=True)
def _no_flower_configuration(monkeypatch, tmp_path):
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "flwr-home"))


def _rows(deployment) -> dict[str, tuple[str, str]]:
    return {setting: (value, source) for setting, value, source in deployment.settings}


def _line(path: Path, text: str) -> int:
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_hydra_defaults_list_interpolation_and_the_target_model():
    app = APPS / "hydra_defaults"
    base = app / "bench" / "conf" / "base.yaml"
    cnn = app / "bench" / "conf" / "model" / "cnn.yaml"
    strategy = app / "bench" / "conf" / "strategy" / "fedavg.yaml"
    deployment = read_deployment(app, GIVEN)
    rows = _rows(deployment)
    where = "bench/conf/base.yaml"
    assert rows["batch-size"] == ("16", f"{where}:{_line(base, 'batch_size: 16')} batch_size")
    assert rows["local-epochs"][0] == "3" and rows["local-epochs"][1].startswith(
        f"{where}:{_line(base, 'num_epochs: 3')}"
    )
    assert rows["lr"] == ("0.02", f"{where}:{_line(base, 'learning_rate: 0.02')} learning_rate")
    assert rows["momentum"] == ("0.9", f"{where}:{_line(base, 'momentum')} momentum")
    assert rows["server-rounds"] == ("6", f"{where}:{_line(base, 'num_rounds')} num_rounds")
    # The model group's file names the class: the one model, its arguments from the same node.
    assert rows["model"] == (
        "bench/models.py:CNN",
        f"CNN(...) at bench/conf/model/cnn.yaml:{_line(cnn, '_target_')} _target_: bench.models.CNN, "
        "the model the app trains",
    )
    assert deployment.model_args == {"hidden": 24, "num_classes": 5}
    assert rows["model-arg hidden"] == ("24", f"bench/conf/model/cnn.yaml:{_line(cnn, 'hidden')} model.hidden")
    # min_fit_clients: ${clients_per_round} in the strategy group resolves against the whole composed config.
    assert rows["clients per round"][0] == "4"
    assert f"bench/conf/strategy/fedavg.yaml:{_line(strategy, 'min_fit_clients:')}" in rows["clients per round"][1]
    entries = app_yaml(app.resolve()).entries
    assert entries["strategy.min_fit_clients"] == (
        4,
        f"bench/conf/strategy/fedavg.yaml:{_line(strategy, 'min_fit_clients:')}",
    )
    assert entries["dataset.batch_size"][0] == 16
    assert "dataset.output_dir" not in entries  # ${hydra:...} is known only when Hydra runs


def test_hydra_defaults_list_choice_changes_the_model_and_a_missing_group_is_named(tmp_path):
    app = tmp_path / "app"
    shutil.copytree(APPS / "hydra_defaults", app)
    base = app / "bench" / "conf" / "base.yaml"
    base.write_text(base.read_text().replace("- model: cnn", "- model: mlp"))
    deployment = read_deployment(app, GIVEN)
    assert _rows(deployment)["model"][0] == "bench/models.py:MLP"
    assert deployment.model_args == {"num_classes": 5}
    base.write_text(base.read_text().replace("- strategy: fedavg", "- strategy: fedprox"))
    notes = app_yaml(app).notes
    assert notes == [
        "bench/conf/strategy/fedprox.yaml, named in the defaults list of bench/conf/base.yaml, does not exist"
    ]
