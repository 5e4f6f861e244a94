"""`rankaudit DIR`: Flower apps, Opacus and NVFlare settings read statically, each value with its source."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from conftest import REPO

from rankaudit.deploy.app import Overrides, read_deployment
from rankaudit.deploy.flower import parse_run_config
from rankaudit.deploy.privacy import noise_for_epsilon
from rankaudit.errors import UsageError

SERVER_NOISE = "this bounds what the released model reveals, not what the server sees"  # findings.dp_sentence

APPS = Path(__file__).resolve().parent / "apps"


def _rows(deployment) -> dict[str, tuple[str, str]]:
    return {setting: (value, source) for setting, value, source in deployment.settings}


def _line(path: Path, text: str) -> int:
    """The line of `path` holding `text`: sources name lines, and the tests should not hard-code them."""
    return next(number for number, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def _copy(app: str, tmp_path: Path) -> Path:
    target = tmp_path / app
    shutil.copytree(APPS / app, target, ignore=shutil.ignore_patterns("__pycache__"))
    return target


def test_quickstart_app_every_value_and_its_source():
    deployment = read_deployment(APPS / "quickstart")
    task = APPS / "quickstart" / "quickstart_app" / "task.py"
    sgd = _line(task, "torch.optim.SGD")
    assert _rows(deployment) == {
        "model": (
            "quickstart_app/task.py:Net",
            f"Net(...) at quickstart_app/client_app.py:{_line(APPS / 'quickstart/quickstart_app/client_app.py', 'Net()')}"
            ", the model the app trains",
        ),
        "local-samples": ("64", "[tool.rankaudit.round]"),
        "batch-size": ("32", "[tool.flwr.app.config] batch-size"),
        "local-epochs": ("1", "[tool.flwr.app.config] local-epochs"),
        "lr": ("0.1", "[tool.flwr.app.config] learning-rate"),
        "optimizer": ("sgd", f"SGD(momentum=0.9) at quickstart_app/task.py:{sgd}"),
        "momentum": ("0.9", f"quickstart_app/task.py:{sgd}"),
        "server-rounds": ("3", "[tool.flwr.app.config] num-server-rounds"),
        "nodes": ("10", "[tool.flwr.federations.local-simulation] options.num-supernodes"),
        "clients per round": (
            "5",
            "max(⌊fraction · nodes⌋, min clients) from [tool.flwr.federations.local-simulation] "
            "options.num-supernodes, [tool.flwr.app.config] fraction-train",
        ),
    }
    round_ = deployment.round
    assert (
        round_.samples,
        round_.batch_size,
        round_.local_epochs,
        round_.lr,
        round_.optimizer,
        round_.momentum,
        round_.server_rounds,
        round_.clients,
        round_.dp,
    ) == (64, 32, 1, 0.1, "sgd", 0.9, 3, 1, None)
    assert deployment.model.endswith("quickstart_app/task.py:Net")  # not extra.Unused: the client never imports it


def test_rankaudit_dot_prints_the_round_with_its_sources(run_cli, monkeypatch):
    monkeypatch.chdir(APPS / "quickstart")
    code, out, err = run_cli(".")
    # The per-sample verdict at the app's own round: each sample is read by one local step, nothing hides it.
    assert code == 1 and "Bound (each sample): rank <= 64 of 64 unknowns per sample" in out and "exposed" in out
    assert "FedAvg round: N = 64 local samples, batch 32, 1 local epoch, K = 2 steps of sgd (momentum 0.9)" in out
    assert "Read from the Flower app .:" in out and "batch-size 32 ([tool.flwr.app.config] batch-size)" in out
    code, out, err = run_cli(".", "--format", "json", "--run-config", "local-epochs=3 batch-size=16")
    payload = json.loads(out)
    assert payload["round"]["batch_size"] == 16 and payload["round"]["local_epochs"] == 3
    assert payload["round"]["steps"] == 12
    settings = {row["setting"]: row for row in payload["deployment"]["settings"]}
    assert settings["local-epochs"] == {
        "setting": "local-epochs",
        "value": "3",
        "source": "--run-config local-epochs=3",
    }
    assert settings["batch-size"]["source"] == "--run-config batch-size=16"


def test_run_config_is_parsed_as_flower_parses_it():
    assert parse_run_config("a=1 b=0.5 c=true d=\"two words\" e='x'") == {
        "a": 1,
        "b": 0.5,
        "c": True,
        "d": "two words",
        "e": "x",
    }
    with pytest.raises(UsageError, match="not in Flower's format"):
        parse_run_config("a=bare")
    with pytest.raises(UsageError, match="not in the app's"):
        read_deployment(APPS / "quickstart", Overrides(run_config="num-epochs=3"))


def test_flags_and_rankaudit_tables_win_over_what_is_read():
    deployment = read_deployment(
        APPS / "quickstart", Overrides(round={"local_epochs": 5, "lr": 0.02}, run_config="local-epochs=3")
    )
    rows = _rows(deployment)
    assert rows["local-epochs"] == ("5", "--local-epochs") and rows["lr"] == ("0.02", "--lr")
    assert deployment.round.local_epochs == 5 and deployment.round.lr == 0.02


def test_central_dp_app_server_noise_secure_aggregation_and_literals(run_cli, monkeypatch):
    app = APPS / "central_dp"
    deployment = read_deployment(app)
    task = app / "central_dp_app" / "task.py"
    rows = _rows(deployment)
    assert rows["batch-size"] == ("32", f"central_dp_app/task.py:{_line(task, 'shuffle=True')}")  # not the test loader
    assert rows["local-epochs"] == ("2", f"central_dp_app/task.py:{_line(task, 'range(2)')}")
    assert rows["optimizer"] == ("adam", f"Adam at central_dp_app/task.py:{_line(task, 'Adam')}")
    assert rows["lr"] == ("0.01", f"central_dp_app/task.py:{_line(task, 'Adam')}")
    server = app / "central_dp_app" / "server_app.py"
    assert rows["server-rounds"] == ("3", f"central_dp_app/server_app.py:{_line(server, 'num_rounds=3')}")
    assert rows["clients"] == ("20", "[tool.flwr.app.config] num-sampled-clients")
    assert rows["available-clients"] == ("100", "[tool.flwr.federations.local-simulation] options.num-supernodes")
    assert rows["dp noise"] == ("0.2", "[tool.flwr.app.config] noise-multiplier")
    assert rows["dp clip"] == ("10", "[tool.flwr.app.config] clipping-norm")
    assert rows["dp noise-by"][0] == "server"
    assert "num_sampled_clients 20" in rows["dp sample-rate"][1]
    round_ = deployment.round
    assert (round_.clients, round_.available_clients, round_.secure_aggregation) == (20, 100, True)
    dp = round_.dp
    assert (dp.noise_multiplier, dp.clip, dp.level, dp.noise_by, dp.sample_rate, dp.steps) == (
        0.2,
        10.0,
        "client",
        "server",
        0.2,
        3,
    )
    monkeypatch.chdir(app)
    code, out, err = run_cli(".", "--format", "json")
    payload = json.loads(out)
    assert payload["dp"]["noise_by"] == "server" and payload["dp"]["sample_rate"] == 0.2
    code_plain, out_plain, _ = run_cli(
        "central_dp_app/task.py",
        "--input-shape",
        "16",
        "--local-samples",
        "64",
        "-b",
        "32",
        "--local-epochs",
        "2",
        "--optimizer",
        "adam",
        "--lr",
        "0.01",
        "--clients",
        "20",
        "--available-clients",
        "100",
        "--server-rounds",
        "3",
        "--format",
        "json",
    )
    # No DP credit against the server: verdict and exit code are those of the same round without any noise.
    assert payload["verdict"] == json.loads(out_plain)["verdict"] and code == code_plain
    code, out, err = run_cli(".")
    assert SERVER_NOISE in out


def test_local_dp_mod_is_client_noise_without_sampling_credit():
    deployment = read_deployment(APPS / "local_dp")
    rows = _rows(deployment)
    assert rows["lr"] == ("0.05", "[tool.flwr.app.config] lr-local")  # [tool.rankaudit.flower] lr = "lr-local"
    task = APPS / "local_dp" / "local_dp_app" / "task.py"
    assert rows["batch-size"] == ("16", f"local_dp_app/task.py:{_line(task, 'DataLoader(train_set')}")
    dp = deployment.round.dp
    # LocalDpMod(clipping_norm 2, sensitivity 1, epsilon 1, delta 1e-5): std = 1·√(2 ln(1.25/δ))/1 over the clip 2.
    assert dp.noise_multiplier == pytest.approx(math.sqrt(2 * math.log(1.25e5)) / 2)
    assert (dp.clip, dp.level, dp.noise_by, dp.sample_rate, dp.steps) == (2.0, "client", "client", 1.0, 4)


def test_opacus_app_q_and_t_from_its_loader_and_epochs():
    deployment = read_deployment(APPS / "opacus")
    dp = deployment.round.dp
    assert (dp.noise_multiplier, dp.clip, dp.level, dp.noise_by) == (1.1, 1.0, "sample", "client")
    assert dp.sample_rate == 32 / 256 and dp.steps == 2 * 8 * 5  # q = B/N, T = E·⌈N/B⌉ per round × 5 rounds
    assert _rows(deployment)["dp clip"] == ("1", "[tool.flwr.app.config] max-grad-norm")
    wider = read_deployment(APPS / "opacus", Overrides(round={"local_samples": 512}))
    assert wider.round.dp.sample_rate == 32 / 512 and wider.round.dp.steps == 2 * 16 * 5


def test_opacus_make_private_with_epsilon_derives_sigma(tmp_path):
    app = _copy("opacus", tmp_path)
    client = app / "opacus_app" / "client_app.py"
    client.write_text(
        client.read_text()
        .replace("make_private(", "make_private_with_epsilon(")
        .replace("noise_multiplier=1.1,", "target_epsilon=2.0, target_delta=1e-5, epochs=2, poisson_sampling=False,")
    )
    deployment = read_deployment(app)
    sigma = deployment.round.dp.noise_multiplier
    assert sigma == noise_for_epsilon(2.0, 1e-5, 32 / 256, 16)
    from rankaudit.settings.accountant import PLDAccountant, SubsampledGaussian

    def epsilon(noise):
        return PLDAccountant().profile(SubsampledGaussian(noise, 32 / 256, 16)).epsilon(1e-5)

    assert epsilon(sigma) <= 2.0 < epsilon(sigma - 0.01)
    assert any("poisson_sampling=False" in note for note in deployment.notes)


def test_factory_with_arguments_from_config_and_flags(run_cli, monkeypatch):
    deployment = read_deployment(APPS / "factory")
    assert deployment.model_args == {"num_features": 16, "num_classes": 3}
    source = "[tool.rankaudit] model-args, [tool.flwr.app.config] num-classes"
    assert _rows(deployment)["model-arg num_classes"] == ("3", source)
    monkeypatch.chdir(APPS / "factory")
    code, out, err = run_cli(".", "--format", "json")
    assert code in (0, 1), err  # built and judged
    assert json.loads(out)["parameters"] == 16 * 3 + 3
    code, out, err = run_cli(".", "--format", "json", "--model-arg", "num_classes=5")
    assert json.loads(out)["parameters"] == 16 * 5 + 5
    # A factory in a plain file takes --model-arg too.
    code, out, err = run_cli(
        "factory_app/task.py:get_model", "--model-arg", "num_classes=4", "--input-shape", "16", "--format", "json"
    )
    assert code in (0, 1), err  # built and judged (exit 1: this small MLP fails the policy)
    assert json.loads(out)["parameters"] == 16 * 32 + 32 + 32 * 4 + 4


def test_several_candidates_and_missing_settings_are_one_line_errors(run_cli, tmp_path):
    app = _copy("quickstart", tmp_path)
    client = app / "quickstart_app" / "client_app.py"
    client.write_text(
        client.read_text().replace(
            "from quickstart_app.task import Net, load_data",
            "from quickstart_app.task import Net, load_data\nfrom quickstart_app.extra import Unused",
        )
    )
    # Imported but never built: the model is the one the client trains.
    assert read_deployment(app).model.endswith("task.py:Net")
    client.write_text(client.read_text().replace("    model = Net()", "    model = Net()\n    probe = Unused()"))
    code, out, err = run_cli(str(app))
    assert code == 2 and "several models" in err and "Net() at" in err and "Unused() at" in err
    assert 'model = "pkg/task.py:NAME"' in err and len(err.strip().splitlines()) == 1
    client.write_text(
        client.read_text().replace("from quickstart_app.extra import Unused", "").replace("    probe = Unused()", "")
    )
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("local-samples = 64", ""))
    code, out, err = run_cli(str(app))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "local-samples = N in [tool.rankaudit.round]" in err
    pyproject.write_text(pyproject.read_text().replace('input-shape = "1,8,8"', ""))
    code, out, err = run_cli(str(app), "--local-samples", "64")
    assert code == 2 and 'set input-shape = "C,H,W" in [tool.rankaudit]' in err


def test_nvflare_exclude_vars_withholds_layers_by_state_dict_keys(run_cli):
    job = APPS / "nvflare_job"
    # The job has no server config: its rounds are stated, as its batch and epochs are.
    given = {"local_samples": 8, "batch_size": 8, "local_epochs": 1, "server_rounds": 1}
    deployment = read_deployment(job, Overrides(round=given))
    assert deployment.withheld_layers == ["fc1.weight", "fc1.bias"]
    assert _rows(deployment)["withheld-layers"] == (
        "fc1.weight,fc1.bias",
        "app/config/config_fed_client.json (ExcludeVars)",
    )
    code, out, err = run_cli(
        job, "--local-samples", "8", "-b", "8", "--local-epochs", "1", "--server-rounds", "1", "--format", "json"
    )
    read = json.loads(out)
    model = job / "app" / "custom" / "simple_network.py"
    code, out, err = run_cli(model, "-b", "8", "--server-rounds", "1", "--withheld-layers", "fc1", "--format", "json")
    by_layer = json.loads(out)
    code, out, err = run_cli(
        model, "-b", "8", "--server-rounds", "1", "--withheld-layers", "fc1.weight,fc1.bias", "--format", "json"
    )
    by_key = json.loads(out)
    assert read["identifiability"] == by_layer["identifiability"] == by_key["identifiability"]
    code, out, err = run_cli(model, "-b", "8", "--server-rounds", "1", "--format", "json")
    assert json.loads(out)["identifiability"] != by_layer["identifiability"]


def test_a_file_in_a_package_imports_from_its_package_root(run_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # neither the app nor its package is on the path from here
    task = APPS / "quickstart" / "quickstart_app" / "task.py"
    code, out, err = run_cli(task, "--input-shape", "1,8,8")
    assert code in (0, 1) and "Bound" in out, err  # loaded and judged, not a load error (exit 3)
    from rankaudit.model.load_errors import _runs_on_its_own
    from rankaudit.model.model_file import package_root

    assert package_root(task) == (APPS / "quickstart", "quickstart_app.task")
    assert _runs_on_its_own(task, "Net") == (True, "")


def test_precommit_manifest_declares_the_app_hook():
    import yaml

    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "rankaudit-app")
    assert hook["pass_filenames"] is False and hook["entry"].endswith(" .")


def test_flowers_own_run_config_parser_agrees():
    config = pytest.importorskip(
        "flwr.common.config",
        reason="needs Flower (flwr), not installed: not a test extra, it pins its own dependencies (pip install 'flwr==1.41.*', as CI does)",
    )
    text = 'local-epochs=3 lr=0.05 fast=true name="a b" nested.key=2'
    assert parse_run_config(text) == config.parse_config_args([text])


def test_a_noise_multiplier_the_code_hides_is_asked_for_then_taken_from_the_config(tmp_path):
    app = _copy("opacus", tmp_path)
    client = app / "opacus_app" / "client_app.py"
    client.write_text(client.read_text().replace("noise_multiplier=1.1,", "noise_multiplier=pick_noise(),"))
    with pytest.raises(UsageError, match="noise_multiplier is not a literal"):
        read_deployment(app)
    dp = read_deployment(app, Overrides(dp={"noise": 0.8})).round.dp
    assert (dp.noise_multiplier, dp.level, dp.noise_by, dp.sample_rate, dp.steps) == (
        0.8,
        "sample",
        "client",
        32 / 256,
        80,
    )


def test_learning_rate_sent_by_the_server_and_torchs_default(tmp_path):
    app = _copy("quickstart", tmp_path)
    pyproject, server = app / "pyproject.toml", app / "quickstart_app" / "server_app.py"
    pyproject.write_text(pyproject.read_text().replace("learning-rate = 0.1\n", ""))
    server.write_text(server.read_text().replace('lr: float = context.run_config["learning-rate"]', "lr = 0.02"))
    rows = _rows(read_deployment(app))
    assert rows["lr"] == (
        "0.02",
        f"quickstart_app/server_app.py:{_line(server, 'lr = 0.02')} (ConfigRecord sent to the clients)",
    )
    rows = _rows(read_deployment(APPS / "opacus"))  # SGD(model.parameters(), lr=0.05): the literal
    assert rows["lr"][0] == "0.05"
    task = _copy("central_dp", tmp_path) / "central_dp_app" / "task.py"
    task.write_text(
        task.read_text().replace("torch.optim.Adam(net.parameters(), lr=0.01)", "torch.optim.Adam(net.parameters())")
    )
    rows = _rows(read_deployment(task.parent.parent))
    assert rows["lr"] == ("0.001", f"Adam's default lr at central_dp_app/task.py:{_line(task, 'Adam(')}")


def test_verify_builds_the_model_with_the_arguments_the_analysis_used(run_cli, monkeypatch, tmp_path):
    """The app's model needs num_features and num_classes (a run-config key): the rank check builds the model the
    analysis judged, so its shared gradient is that model's, round after round."""
    monkeypatch.chdir(APPS / "factory")
    code, out, err = run_cli(".", "--verify", "rank", "--format", "json", "--quiet")
    assert code in (0, 1), err
    payload = json.loads(out)
    rank = payload["verification"]["rank"]
    assert rank["shared_parameters"] == ["fc1.weight", "fc1.bias"] and rank["internal_error"] is None
    assert rank["shared_gradient_size"] % payload["parameters"] == 0  # one update of the same model per round
    # A plain file whose class takes an argument, given with --model-arg: built at width 3 (15 values), not refused.
    model = tmp_path / "needs.py"
    model.write_text(
        "from torch import nn\nINPUT_SHAPE = (4,)\nclass Net(nn.Sequential):\n"
        "    def __init__(self, width):\n        super().__init__(nn.Linear(4, width))\n"
    )
    code, out, err = run_cli(model, "--model-arg", "width=3", "--verify", "rank", "--format", "json", "--quiet")
    assert code in (0, 1), err
    assert json.loads(out)["verification"]["rank"]["shared_gradient_size"] == 4 * 3 + 3


def test_dataset_size_over_the_nodes_gives_the_smallest_partition(tmp_path):
    app = _copy("quickstart", tmp_path)
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("local-samples = 64", "dataset-size = 645"))
    deployment = read_deployment(app)
    assert deployment.round.local_samples == 64
    assert _rows(deployment)["local-samples"] == (
        "64",
        "dataset-size 645 ([tool.rankaudit.round]) over 10 nodes ([tool.flwr.federations.local-simulation] "
        "options.num-supernodes), the smallest partition",
    )
    pyproject.write_text(pyproject.read_text() + '\n[tool.rankaudit.flower]\nlearning-rate = "lr"\n')
    with pytest.raises(UsageError, match=r"unknown key learning-rate in \[tool.rankaudit.flower\]"):
        read_deployment(app)


def test_html_report_lists_what_was_read(run_cli, monkeypatch, tmp_path):
    monkeypatch.chdir(APPS / "central_dp")
    page = tmp_path / "report.html"
    code, out, err = run_cli(".", "-q", "--html", page)
    assert code in (0, 1), err
    html = page.read_text()
    assert "Read from the Flower app ." in html and "[tool.flwr.app.config] noise-multiplier" in html


def test_a_factory_the_client_imports_is_the_model_without_a_class(tmp_path):
    app = _copy("factory", tmp_path)
    pyproject, client = app / "pyproject.toml", app / "factory_app" / "client_app.py"
    pyproject.write_text(
        pyproject.read_text()
        .replace('model = "factory_app/task.py:LogisticRegression"\n', "")
        .replace('num_features = 16, num_classes = "num-classes"', 'num_classes = "num-classes"')
    )
    client.write_text(client.read_text().replace("import LogisticRegression, get_model", "import get_model"))
    deployment = read_deployment(app)
    assert deployment.model.endswith("factory_app/task.py:get_model") and deployment.model_args == {"num_classes": 3}


def test_run_config_from_a_toml_file(tmp_path):
    overrides = tmp_path / "overrides.toml"
    overrides.write_text("local-epochs = 4\n")
    deployment = read_deployment(APPS / "quickstart", Overrides(run_config=str(overrides)))
    assert deployment.round.local_epochs == 4
    assert _rows(deployment)["local-epochs"] == ("4", "--run-config local-epochs=4")
