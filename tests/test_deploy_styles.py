"""`rankaudit DIR` on every common way to write an app: each value the app sets is read with its source, and none is
called a default."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import APP_GIVEN, APPS, line_of, no_default_source, setting_rows

from rankaudit.deploy.app import Overrides, read_deployment
from rankaudit.deploy.nvflare import load_config
from rankaudit.deploy.yamlconf import read_yaml
from rankaudit.errors import UsageError

pytestmark = pytest.mark.usefixtures("no_flower_configuration")


def test_nvflare_json_job_script_arguments_argparse_defaults_and_server_rounds():
    job = APPS / "nvflare_json"
    client = job / "app" / "custom" / "client.py"
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    assert rows["batch-size"] == ("16", "app/config/config_fed_client.json task_script_args (passes --batch_size 16)")
    assert rows["local-epochs"] == (
        "2",
        f"app/custom/client.py:{line_of(client, '--epochs')} (--epochs's argparse default)",
    )
    assert rows["lr"] == ("0.01", f"app/custom/client.py:{line_of(client, '--lr')} (--lr's argparse default)")
    assert rows["server-rounds"] == ("2", "app/config/config_fed_server.json num_rounds")
    assert rows["clients per round"] == ("2", "app/config/config_fed_server.json min_clients")
    assert rows["model"][0] == "app/custom/net.py:Net"
    round_ = deployment.round
    assert (round_.batch_size, round_.local_epochs, round_.lr, round_.server_rounds, round_.clients) == (
        16,
        2,
        0.01,
        2,
        1,
    )
    no_default_source(rows)


def test_nvflare_hocon_server_config_with_placeholders(tmp_path):
    job = tmp_path / "job"
    shutil.copytree(APPS / "nvflare_json", job)
    (job / "app" / "config" / "config_fed_server.json").unlink()
    (job / "app" / "config" / "config_fed_server.conf").write_text(
        "format_version = 2\nrounds = 7\n# the workflow\nworkflows = [\n  {\n    id = sag\n"
        '    path = "nvflare.app_common.workflows.scatter_and_gather.ScatterAndGather"\n'
        '    args { min_clients = 3, num_rounds = "{rounds}" }\n  }\n]\n'
    )
    rows = setting_rows(read_deployment(job, APP_GIVEN))
    assert rows["server-rounds"] == ("7", "app/config/config_fed_server.conf num_rounds")
    assert rows["clients per round"] == ("3", "app/config/config_fed_server.conf min_clients")
    hocon = tmp_path / "dotted.conf"
    hocon.write_text('a.b = 1\na { c: "x" } // note\nlist = [1, 2]\nrounds = ${a.b}')
    assert load_config(hocon) == {"a": {"b": 1, "c": "x"}, "list": [1, 2], "rounds": 1}
    client = job / "app" / "config" / "config_fed_client.json"
    client.write_text(client.read_text().replace('"--batch_size 16"', '"-b 24"'))
    script = job / "app" / "custom" / "client.py"
    script.write_text(script.read_text().replace('add_argument("--batch_size"', 'add_argument("-b", "--batch_size"'))
    assert setting_rows(read_deployment(job, APP_GIVEN))["batch-size"] == (
        "24",
        "app/config/config_fed_client.json task_script_args (passes -b 24)",
    )


def test_nvflare_recipe_job_reads_train_args_argparse_and_the_model_it_names():
    job = APPS / "nvflare_recipe"
    script = job / "job.py"
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    created = line_of(script, "model=CNN")
    assert rows["model"] == ("model.py:CNN", f"CNN(...) at job.py:{created}, the model the app trains")
    assert rows["model-arg num_classes"] == ("4", f"job.py:{created}")
    assert deployment.model_args == {"num_classes": 4}
    assert rows["batch-size"] == (
        "16",
        f"job.py:{line_of(script, '--batch_size')} (--batch_size's argparse default) (train_args --batch_size 16)",
    )
    assert rows["local-epochs"] == ("2", f"job.py:{line_of(script, 'train_args=')} (train_args --epochs 2)")
    assert rows["server-rounds"] == ("5", f"job.py:{line_of(script, '--num_rounds')} (--num_rounds's argparse default)")
    assert rows["nodes"][0] == "3" and rows["clients per round"][0] == "3"
    client = job / "client.py"
    assert rows["lr"] == ("0.05", f"client.py:{line_of(client, 'lr=0.05')}")
    assert rows["momentum"] == ("0.9", f"client.py:{line_of(client, 'lr=0.05')}")
    no_default_source(rows)


def test_nested_run_config_tables_and_the_flower_configuration_file(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.toml").write_text(
        '[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\noptions.num-supernodes = 8\n'
    )
    monkeypatch.setenv("FLWR_HOME", str(home))
    deployment = read_deployment(APPS / "fedprox_nested", Overrides())
    rows = setting_rows(deployment)
    assert rows["batch-size"] == ("10", "[tool.flwr.app.config] dataset.batch-size")
    assert rows["local-epochs"] == ("10", "[tool.flwr.app.config] algorithm.local-epochs")
    assert rows["lr"] == ("0.03", "[tool.flwr.app.config] algorithm.lr")
    assert rows["server-rounds"] == ("100", "[tool.flwr.app.config] num-server-rounds")
    assert rows["nodes"] == ("8", f"{home / 'config.toml'} [superlink.local] options.num-supernodes")
    # fraction_fit=1.0 of 8 nodes, at least min_fit_clients=5: 8 clients train each round.
    assert rows["clients per round"][0] == "8" and "server_app.py" in rows["clients per round"][1]
    round_ = deployment.round
    assert (round_.batch_size, round_.local_epochs, round_.lr, round_.server_rounds) == (10, 10, 0.03, 100)
    no_default_source(rows)


def test_script_style_client_with_opacus_factory_attribute_lr_and_module_dict():
    app = APPS / "script_client"
    client = app / "client.py"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    # CNN is imported too, but the client trains ResNet() (a factory).
    assert rows["model"] == (
        "models.py:ResNet",
        f"ResNet(...) at client.py:{line_of(client, 'ResNet()')}, the model the app trains",
    )
    params = line_of(client, "PARAMS = ")
    assert rows["batch-size"] == ("16", f"client.py:{params}") and rows["local-epochs"] == ("3", f"client.py:{params}")
    assert rows["lr"] == ("0.02", f"client.py:{line_of(client, 'self._lr = ')}")  # 0.01 * 2, an attribute
    assert rows["server-rounds"] == ("4", f"server.py:{line_of(app / 'server.py', 'num_rounds=4')}")
    assert rows["dp noise"] == ("1.1", f"client.py:{line_of(client, 'NOISE_MULTIPLIER = ')}")
    assert rows["dp clip"] == ("1.5", f"client.py:{line_of(client, 'MAX_GRAD_NORM = ')}")
    assert rows["dp noise-by"][0] == "client" and rows["dp level"][0] == "sample"
    dp = deployment.round.dp
    assert (dp.noise_multiplier, dp.clip, dp.level, dp.sample_rate, dp.steps) == (1.1, 1.5, "sample", 0.5, 24)
    no_default_source(rows)


def test_configuration_resolves_the_optimizer_and_the_privacy_wrapper_in_a_sibling_package():
    app = APPS / "branches"
    deployment = read_deployment(app)
    rows = setting_rows(deployment)
    client = app / "branches_app" / "client_app.py"
    assert rows["optimizer"] == ("adam", f"Adam at branches_app/client_app.py:{line_of(client, 'Adam(')}")
    assert "momentum" not in rows and deployment.round.momentum == 0.0  # never SGD's momentum with Adam
    assert rows["dp noise"] == ("0.01", "[tool.flwr.app.config] noise")
    assert rows["dp clip"] == ("5", "[tool.flwr.app.config] clip")
    assert rows["dp noise-by"][0] == "server"
    assert deployment.round.dp.sample_rate == 0.5  # num_sampled_clients 5 of 10 nodes
    sgd = read_deployment(app, Overrides(run_config='optimizer="sgd"'))
    assert setting_rows(sgd)["optimizer"][0] == "sgd" and sgd.round.momentum == 0.9
    metric = read_deployment(app, Overrides(run_config='privacy="metric-privacy"'))
    assert metric.round.dp is None
    assert any(
        "MetricPrivacyServerSideFixedClipping at privacy_wrappers/select.py" in note
        and "protects nothing against the server" in note
        for note in metric.notes
    )


def test_an_optimizer_choice_that_is_not_read_is_refused_in_one_line(tmp_path):
    app = tmp_path / "branches"
    shutil.copytree(APPS / "branches", app)
    client = app / "branches_app" / "client_app.py"
    client.write_text(client.read_text().replace('context.run_config["optimizer"]', 'context.node_config["opt"]'))
    with pytest.raises(UsageError) as raised:
        read_deployment(app)
    message = str(raised.value)
    assert "Adam at branches_app/client_app.py" in message and "SGD at branches_app/client_app.py" in message
    assert "context.node_config['opt']" in message and "\n" not in message
    given = read_deployment(app, Overrides(round={"optimizer": "sgd", "momentum": 0.9}))
    assert given.round.optimizer == "sgd"


def test_hydra_yaml_app():
    app = APPS / "hydra_app"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    config = app / "conf" / "config.yaml"
    assert rows["batch-size"] == ("32", f"conf/config.yaml:{line_of(config, 'batch_size')} batch_size")
    assert rows["local-epochs"] == ("2", f"conf/config.yaml:{line_of(config, 'local_epochs')} train.local_epochs")
    assert rows["lr"] == ("0.05", f"conf/config.yaml:{line_of(config, 'lr:')} train.lr")
    assert rows["server-rounds"] == ("4", f"conf/config.yaml:{line_of(config, 'num_rounds')} num_rounds")
    assert rows["nodes"][0] == "20" and rows["clients per round"][0] == "5"  # max(⌊0.25 · 20⌋, 2)
    no_default_source(rows)
    assert read_yaml(config)["train.lr"] == (0.05, line_of(config, "lr:"))


def test_hydra_model_name_mapped_to_a_class_in_code_picks_that_class_with_its_arguments(run_cli, tmp_path):
    app = APPS / "hydra_model_name"
    main = app / "main.py"
    config = app / "conf" / "base.yaml"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    # model_name: cnn -> get_model(cfg) -> `elif cfg.model_name == "cnn": return CNN(num_classes=cfg.num_classes)`.
    assert rows["model"] == (
        "models.py:CNN",
        f"CNN(...) at main.py:{line_of(main, 'CNN(num_classes')}, the model the app trains",
    )
    assert rows["model-arg num_classes"] == ("4", f"conf/base.yaml:{line_of(config, 'num_classes')} num_classes")
    assert deployment.model_args == {"num_classes": 4}
    no_default_source(rows)
    code, out, _ = run_cli(str(app), "--input-shape", "3,8,8", "--local-samples", "24", "--format", "json")
    assert code in (0, 1) and json.loads(out)["model_name"] == "CNN"
    copy = tmp_path / "named"
    shutil.copytree(app, copy)
    copied = copy / "conf" / "base.yaml"
    copied.write_text(copied.read_text().replace("model_name: cnn", "model_name: mlp"))
    mlp = read_deployment(copy, APP_GIVEN)
    assert setting_rows(mlp)["model"][0] == "models.py:MLP" and mlp.model_args == {"num_classes": 4}
    # A name the config does not state readably: one line naming both classes and the condition, never a guess.
    copied.write_text(copied.read_text().replace("model_name: mlp", "model_name: ${oc.env:MODEL}"))
    with pytest.raises(UsageError) as raised:
        read_deployment(copy, APP_GIVEN)
    message = str(raised.value)
    assert "the model is chosen when the app runs" in message and "\n" not in message
    assert f"CNN at main.py:{line_of(main, 'CNN(num_classes')}, by `cfg.model_name == 'cnn'`" in message
    assert f"MLP at main.py:{line_of(main, 'MLP(num_classes')}" in message
    # A registry dict looked up by the name: the entry the config names, with the call's arguments.
    code = main.read_text()
    factory = code[code.index("def get_model(cfg):") : code.index("class FlowerClient")]
    registry = code.replace(factory, 'MODELS = {"mlp": MLP, "cnn": CNN}\n\n\n').replace(
        "get_model(cfg)", "MODELS[cfg.model_name](num_classes=cfg.num_classes)"
    )
    (copy / "main.py").write_text(registry)
    copied.write_text(config.read_text())
    looked_up = read_deployment(copy, APP_GIVEN)
    built = line_of(copy / "main.py", "MODELS[cfg.model_name](")
    assert setting_rows(looked_up)["model"] == (
        "models.py:CNN",
        f"CNN(...) at main.py:{built}, the model the app trains",
    )
    assert looked_up.model_args == {"num_classes": 4}
    copied.write_text(config.read_text().replace("model_name: cnn", "model_name: ${oc.env:MODEL}"))
    with pytest.raises(UsageError) as raised:
        read_deployment(copy, APP_GIVEN)
    assert f"MLP ('mlp') or CNN ('cnn'), looked up by `cfg.model_name` at main.py:{built}" in str(raised.value)


def test_a_model_name_no_branch_or_entry_takes_stops_naming_the_ones_that_do(run_cli, tmp_path):
    app = tmp_path / "unmatched"
    shutil.copytree(APPS / "hydra_model_name", app)
    main, config = app / "main.py", app / "conf" / "base.yaml"
    config.write_text(config.read_text().replace("model_name: cnn", "model_name: resnet18"))
    code, out, err = run_cli(str(app), "--input-shape", "3,8,8", "--local-samples", "24")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    mlp, cnn = line_of(main, '== "mlp"'), line_of(main, '== "cnn"')
    assert (
        f"model_name = 'resnet18' at conf/base.yaml:{line_of(config, 'model_name')} names no model the app builds: "
        f"its code takes 'mlp' (main.py:{mlp}), 'cnn' (main.py:{cnn})"
    ) in err
    assert "could not build" not in err and "set model_name to one of them" in err
    # A registry dict looked up by the key: its entries are the names that match, at the lookup's line.
    code_text = main.read_text()
    factory = code_text[code_text.index("def get_model(cfg):") : code_text.index("class FlowerClient")]
    main.write_text(
        code_text.replace(factory, 'MODELS = {"mlp": MLP, "cnn": CNN}\n\n\n').replace(
            "get_model(cfg)", "MODELS[cfg.model_name](num_classes=cfg.num_classes)"
        )
    )
    with pytest.raises(UsageError) as raised:
        read_deployment(app, APP_GIVEN)
    looked_up = line_of(main, "MODELS[cfg.model_name](")
    assert f"its code takes 'mlp' (main.py:{looked_up}), 'cnn' (main.py:{looked_up})" in str(raised.value)
    # A `match` on the key with a default case builds that default: no stop, the default's class is the model.
    main.write_text(
        code_text.replace(
            factory,
            "def get_model(cfg):\n"
            "    match cfg.model_name:\n"
            '        case "mlp":\n'
            "            return MLP(num_classes=cfg.num_classes)\n"
            "        case _:\n"
            "            return CNN(num_classes=cfg.num_classes)\n\n\n",
        )
    )
    assert setting_rows(read_deployment(app, APP_GIVEN))["model"][0] == "models.py:CNN"
    config.write_text(config.read_text().replace("model_name: resnet18", "model_name: mlp"))
    assert setting_rows(read_deployment(app, APP_GIVEN))["model"][0] == "models.py:MLP"


def test_missing_data_imports_get_stand_ins_and_are_named(run_cli, monkeypatch):
    monkeypatch.chdir(APPS / "datasets_imports")
    code, out, err = run_cli(".", "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["verdict"] == "exposed"
    assert payload["stand_ins"] == ["datasets", "flwr_datasets"]
    assert payload["round"]["server_rounds"] == 2 and payload["round"]["available_clients"] == 1
    settings = {row["setting"]: row for row in payload["deployment"]["settings"]}
    assert settings["lr"]["value"] == "0.1" and settings["lr"]["source"].startswith("datasets_app/client_app.py:")
    code, out, err = run_cli(".")
    assert "Imported with stand-ins for datasets, flwr_datasets" in out
    code, out, err = run_cli(".", "--no-stand-ins")
    assert code == 3 and "imports datasets, which is not installed" in err and "--stand-in datasets" in err


def test_a_model_that_needs_the_missing_module_still_fails_naming_it(run_cli, tmp_path):
    uses = tmp_path / "uses.py"
    uses.write_text(
        "import torchvision\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.body = torchvision.models.resnet18()\n\n"
        "    def forward(self, x):\n        return self.body(x)\n"
    )
    code, out, err = run_cli(str(uses), "--input-shape", "3,8,8")
    assert code == 3 and "needs torchvision, which is not installed" in err
    derives = tmp_path / "derives.py"
    derives.write_text(
        "import not_installed_lightning as L\n\n\nclass Net(L.LightningModule):\n    def forward(self, x):\n"
        "        return x\n"
    )
    code, out, err = run_cli(str(derives), "--input-shape", "4", "--stand-in", "not_installed_lightning")
    assert code == 3 and "derives from not_installed_lightning.LightningModule, which is not installed" in err


def test_opacus_clip_passed_through_a_helper_in_another_file(tmp_path):
    app = tmp_path / "opacus"
    shutil.copytree(APPS / "opacus", app)
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("max-grad-norm = 1.0", "max-grad-norm = 0.7"))
    task = app / "opacus_app" / "task.py"
    task.write_text(
        task.read_text() + "\n\ndef privatise(engine, model, optimizer, loader, max_grad_norm):\n"
        "    return engine.make_private(\n        module=model, optimizer=optimizer, data_loader=loader,"
        " noise_multiplier=1.1, max_grad_norm=max_grad_norm\n    )\n"
    )
    client = app / "opacus_app" / "client_app.py"
    text = client.read_text().replace("from opacus_app.task import Net", "from opacus_app.task import Net, privatise")
    start = text.index("    model, optimizer, train_loader = privacy_engine.make_private(")
    end = text.index("    )\n", start) + len("    )\n")
    client.write_text(
        text[:start]
        + "    model, optimizer, train_loader = privatise(privacy_engine, model, optimizer, train_loader, max_grad_norm)\n"
        + text[end:]
    )
    deployment = read_deployment(app)
    assert setting_rows(deployment)["dp clip"] == ("0.7", "[tool.flwr.app.config] max-grad-norm")
    assert deployment.round.dp.clip == 0.7


def test_dp_switched_by_a_condition_that_is_not_read_is_refused(tmp_path):
    app = tmp_path / "branches"
    shutil.copytree(APPS / "branches", app)
    select = app / "privacy_wrappers" / "select.py"
    select.write_text(select.read_text().replace('privacy = run_config["privacy"]', 'privacy = run_config["mode"]'))
    with pytest.raises(UsageError) as raised:
        read_deployment(app)
    assert "DifferentialPrivacyServerSideFixedClipping at privacy_wrappers/select.py" in str(raised.value)
    assert "privacy == 'global-dp'" in str(raised.value)
    given = read_deployment(app, Overrides(dp={"noise": 0.01, "clip": 5.0}))
    assert given.round.dp.noise_multiplier == 0.01


def test_a_function_called_from_its_own_branch_does_not_loop(tmp_path):
    app = tmp_path / "loop"
    shutil.copytree(APPS / "script_client", app)
    (app / "helper.py").write_text(
        "import torch\n\n\ndef pick(net, fast):\n    if fast:\n        return pick(net, fast)\n"
        "    else:\n        return torch.optim.SGD(net.parameters(), lr=0.3)\n"
    )
    assert setting_rows(read_deployment(app, APP_GIVEN))["lr"][0] == "0.02"  # the client's own SGD, read first


def test_a_flower_app_without_its_app_table_is_read_from_its_code(tmp_path):
    app = tmp_path / "bare"
    shutil.copytree(APPS / "quickstart", app, ignore=shutil.ignore_patterns("__pycache__"))
    pyproject = app / "pyproject.toml"
    text = pyproject.read_text()
    pyproject.write_text(text[: text.index("[tool.flwr.app]")] + text[text.index("[tool.rankaudit]") :])
    # The run config is gone with the table: the batch, the epochs and the rounds the bound depends on are nowhere
    # to read.
    with pytest.raises(UsageError) as raised:
        read_deployment(app)
    assert str(raised.value).startswith("batch-size and local-epochs and server-rounds are not read from the app")
    assert "--batch-size B, --local-epochs E, --server-rounds R" in str(raised.value)
    deployment = read_deployment(app, Overrides(round={"batch_size": 32, "local_epochs": 1, "server_rounds": 3}))
    rows = setting_rows(deployment)
    assert deployment.kind == "flower" and rows["model"][0] == "quickstart_app/task.py:Net"  # not its Head layer
    task = app / "quickstart_app" / "task.py"
    assert rows["momentum"] == ("0.9", f"quickstart_app/task.py:{line_of(task, 'torch.optim.SGD')}")
    assert rows["local-epochs"] == ("1", "--local-epochs")


def test_a_factory_called_with_a_positional_run_config_value(tmp_path):
    app = tmp_path / "positional"
    shutil.copytree(APPS / "script_client", app)
    models = app / "models.py"
    models.write_text(
        models.read_text().replace(
            "def ResNet():\n    return TinyResNet(width=4)", "def ResNet(width):\n    return TinyResNet(width=width)"
        )
    )
    client = app / "client.py"
    client.write_text(
        client.read_text()
        .replace("self.model = ResNet()", "self.model = ResNet(PARAMS['width'])")
        .replace('"local_epochs": 3}', '"local_epochs": 3, "width": 8}')
    )
    deployment = read_deployment(app, APP_GIVEN)
    assert deployment.model_args == {"width": 8}
    assert setting_rows(deployment)["model-arg width"] == ("8", f"client.py:{line_of(client, 'PARAMS = ')}")


def test_run_config_through_a_local_name(tmp_path):
    app = tmp_path / "alias"
    shutil.copytree(APPS / "fedprox_nested", app)
    client = app / "fedprox_app" / "client_app.py"
    client.write_text(
        client.read_text()
        .replace("    net = MLP()\n", "    net = MLP()\n    cfg = context.run_config\n")
        .replace('context.run_config["algorithm.lr"]', 'cfg.get("algorithm.lr", 0.5)')
        .replace('context.run_config["dataset.batch-size"]', 'cfg["dataset.batch-size"]')
    )
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("lr = 0.03", "step = 0.03"))  # lr now only via the code
    rows = setting_rows(read_deployment(app, Overrides()))
    model = app / "fedprox_app" / "model.py"
    assert rows["lr"] == ("0.5", f"fedprox_app/client_app.py:{line_of(client, 'cfg.get(')}")
    assert rows["batch-size"] == ("10", "[tool.flwr.app.config] dataset.batch-size")
    assert rows["optimizer"][1] == f"SGD at fedprox_app/model.py:{line_of(model, 'SGD')}"


def test_an_import_the_file_guards_itself_gets_no_stand_in(run_cli, tmp_path):
    guarded = tmp_path / "guarded.py"
    guarded.write_text(
        "from torch import nn\n\ntry:\n    import torchvision\n    HAVE_VISION = True\nexcept ImportError:\n"
        "    HAVE_VISION = False\n\n\nclass Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = torchvision.ops.MLP(4, [2]) if HAVE_VISION else nn.Linear(4, 2)\n\n"
        "    def forward(self, x):\n        return self.fc(x)\n"
    )
    code, out, err = run_cli(str(guarded), "--input-shape", "4", "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["stand_ins"] == [] and payload["parameters"] == 10  # nn.Linear(4, 2), its fallback


def test_dp_set_up_under_a_run_time_condition_still_counts(tmp_path):
    app = tmp_path / "first_round"
    shutil.copytree(APPS / "script_client", app)
    client = app / "client.py"
    client.write_text(
        client.read_text()
        .replace(
            "        self.privacy_engine = PrivacyEngine(",
            "        self.rounds_done = 0\n        if self.rounds_done == 0:  # set up once, kept for every round\n"
            "            self.privacy_engine = PrivacyEngine(",
        )
        .replace("        return [], len(", "        self.rounds_done = self.rounds_done + 1\n        return [], len(")
    )
    assert read_deployment(app, APP_GIVEN).round.dp.noise_multiplier == 1.1
