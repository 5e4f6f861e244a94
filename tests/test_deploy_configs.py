"""`rankaudit DIR` on apps configured in YAML (Hydra's defaults lists, `${...}`, `_target_`), NVFlare's other job
styles, and privacy settings that live in a config: each value read with its file and line."""

from __future__ import annotations

import shutil

import pytest
from conftest import APP_GIVEN, APPS, line_of, setting_rows

from rankaudit.deploy.app import read_deployment
from rankaudit.deploy.yamlconf import app_yaml
from rankaudit.errors import UsageError

pytestmark = pytest.mark.usefixtures("no_flower_configuration")


def test_hydra_defaults_list_interpolation_and_the_target_model():
    app = APPS / "hydra_defaults"
    base = app / "bench" / "conf" / "base.yaml"
    cnn = app / "bench" / "conf" / "model" / "cnn.yaml"
    strategy = app / "bench" / "conf" / "strategy" / "fedavg.yaml"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    where = "bench/conf/base.yaml"
    assert rows["batch-size"] == ("16", f"{where}:{line_of(base, 'batch_size: 16')} batch_size")
    assert rows["local-epochs"][0] == "3" and rows["local-epochs"][1].startswith(
        f"{where}:{line_of(base, 'num_epochs: 3')}"
    )
    assert rows["lr"] == ("0.02", f"{where}:{line_of(base, 'learning_rate: 0.02')} learning_rate")
    assert rows["momentum"] == ("0.9", f"{where}:{line_of(base, 'momentum')} momentum")
    assert rows["server-rounds"] == ("6", f"{where}:{line_of(base, 'num_rounds')} num_rounds")
    # The model group's file names the class: the one model, its arguments from the same node.
    assert rows["model"] == (
        "bench/models.py:CNN",
        f"CNN(...) at bench/conf/model/cnn.yaml:{line_of(cnn, '_target_')} _target_: bench.models.CNN, "
        "the model the app trains",
    )
    assert deployment.model_args == {"hidden": 24, "num_classes": 5}
    assert rows["model-arg hidden"] == ("24", f"bench/conf/model/cnn.yaml:{line_of(cnn, 'hidden')} model.hidden")
    # min_fit_clients: ${clients_per_round} in the strategy group resolves against the whole composed config.
    assert rows["clients per round"][0] == "4"
    assert f"bench/conf/strategy/fedavg.yaml:{line_of(strategy, 'min_fit_clients:')}" in rows["clients per round"][1]
    entries = app_yaml(app.resolve()).entries
    assert entries["strategy.min_fit_clients"] == (
        4,
        f"bench/conf/strategy/fedavg.yaml:{line_of(strategy, 'min_fit_clients:')}",
    )
    assert entries["dataset.batch_size"][0] == 16
    assert "dataset.output_dir" not in entries  # ${hydra:...} is known only when Hydra runs


def test_hydra_defaults_list_choice_changes_the_model_and_a_missing_group_is_named(tmp_path):
    app = tmp_path / "app"
    shutil.copytree(APPS / "hydra_defaults", app)
    base = app / "bench" / "conf" / "base.yaml"
    base.write_text(base.read_text().replace("- model: cnn", "- model: mlp"))
    deployment = read_deployment(app, APP_GIVEN)
    assert setting_rows(deployment)["model"][0] == "bench/models.py:MLP"
    assert deployment.model_args == {"num_classes": 5}
    # Hydra's own groups are Hydra's business; a group of the app's that is missing is named.
    base.write_text(
        base.read_text().replace(
            "- _self_", "- override hydra/job_logging: disabled\n  - hydra/launcher: basic\n  - _self_"
        )
    )
    assert app_yaml(app).notes == []
    base.write_text(base.read_text().replace("- strategy: fedavg", "- strategy: fedprox"))
    notes = app_yaml(app).notes
    assert notes == [
        "bench/conf/strategy/fedprox.yaml, named in the defaults list of bench/conf/base.yaml, does not exist"
    ]


def test_nvflare_recipe_with_homomorphic_encryption_is_a_job_and_its_encryption_is_named():
    job = APPS / "nvflare_he_recipe"
    script, train = job / "job.py", job / "train.py"
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    assert rows["model"] == (
        "net.py:SmallNet",
        f"SmallNet(...) at job.py:{line_of(script, 'model=SmallNet')}, the model the app trains",
    )
    args = line_of(script, "train_args=")
    assert rows["batch-size"] == ("8", f"job.py:{args} (train_args --batch_size 8)")
    assert rows["local-epochs"] == ("3", f"job.py:{args} (train_args --epochs 3)")
    assert rows["lr"] == ("0.02", f"train.py:{line_of(train, '--lr')} (--lr's argparse default)")
    assert rows["server-rounds"] == ("4", f"job.py:{line_of(script, 'num_rounds=4')}")
    assert rows["clients per round"][0] == "3"
    he = next(note for note in deployment.notes if "homomorphic" in note)
    assert he.startswith(f"FedAvgRecipeWithHE at job.py:{line_of(script, 'recipe = ')} encrypts every layer")
    # One account of what the server sees: not also "without secure aggregation the server sees each update".
    assert not any("without secure aggregation" in note for note in deployment.notes), deployment.notes
    assert deployment.round.clients == 1  # the sum is judged only when the user says how many are summed
    assert not [row for row in rows.values() if "not read" in row[1]], rows


def test_nvflare_fedavg_job_with_a_script_runner():
    job = APPS / "nvflare_fedavg_job"
    script, train = job / "fedavg_script_runner.py", job / "src" / "local_train.py"
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    built = line_of(script, "FedAvgJob(name")
    assert rows["model"] == (
        "src/network.py:TinyNetwork",
        f"TinyNetwork(...) at fedavg_script_runner.py:{built}, the model the app trains",
    )
    assert rows["server-rounds"] == ("5", f"fedavg_script_runner.py:{line_of(script, 'num_rounds = 5')}")
    assert rows["clients per round"] == ("2", f"fedavg_script_runner.py:{line_of(script, 'n_clients = 2')}")
    runner = line_of(script, "ScriptRunner(script=")
    assert rows["local-epochs"] == ("2", f"fedavg_script_runner.py:{runner} (script_args --local_epochs 2)")
    assert rows["batch-size"] == ("5", f"src/local_train.py:{line_of(train, 'batch_size=5')}")
    assert rows["momentum"] == ("0.5", f"src/local_train.py:{line_of(train, 'momentum=0.5')}")
    assert not [row for row in rows.values() if "not read" in row[1]], rows


def test_fedbn_local_batchnorm_is_named_and_a_local_weighted_layer_withheld(tmp_path):
    app = APPS / "fedbn"
    client = app / "fedbn_app" / "client.py"
    base = app / "fedbn_app" / "conf" / "base.yaml"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    filtered = line_of(client, "not in key")
    # BatchNorm's scale and shift stay on the client: withheld, with the line that leaves them out.
    assert deployment.withheld_layers == ["bn1", "bn2"]
    assert rows["withheld-layers"] == (
        "bn1,bn2",
        f"fedbn_app/client.py:{filtered} (LocalNormClient.get_parameters sends no key holding 'bn')",
    )
    assert (
        f"LocalNormClient.get_parameters at fedbn_app/client.py:{filtered} keeps the normalisation layers bn1, bn2 "
        "on the client (FedBN): their scale and shift are left out of what is judged as sent"
    ) in deployment.notes
    assert rows["lr"] == ("0.03", "fedbn_app/conf/client/localnorm.yaml:4 client.lr")
    assert rows["batch-size"] == ("20", f"fedbn_app/conf/base.yaml:{line_of(base, 'batch_size')} dataset.batch_size")
    assert rows["server-rounds"] == ("8", f"fedbn_app/conf/base.yaml:{line_of(base, 'num_rounds')} num_rounds")
    assert rows["local-epochs"] == ("2", f"fedbn_app/client.py:{line_of(client, 'epochs=2')}")
    # A client that keeps a layer with weights (the classifier) local: withheld, with its source.
    copy = tmp_path / "fedbn"
    shutil.copytree(app, copy)
    copied_client = copy / "fedbn_app" / "client.py"
    copied_client.write_text(copied_client.read_text().replace('"bn" not in key', '"fc2" not in key'))
    local_head = read_deployment(copy, APP_GIVEN)
    assert local_head.withheld_layers == ["fc2"]
    assert setting_rows(local_head)["withheld-layers"] == (
        "fc2",
        f"fedbn_app/client.py:{filtered} (LocalNormClient.get_parameters sends no key holding 'fc2')",
    )
    # The shared client sends everything: nothing is withheld, and no note claims otherwise.
    copied = copy / "fedbn_app" / "conf" / "base.yaml"
    copied.write_text(copied.read_text().replace("- client: localnorm", "- client: shared"))
    shared = read_deployment(copy, APP_GIVEN)
    assert shared.withheld_layers is None and not any("get_parameters" in note for note in shared.notes)
    # Neither named nor built: the choice is the app's at run time, so every layer counts as sent, and a note says so.
    copied.write_text(copied.read_text().replace("  - client: shared\n", "").replace("defaults:\n", ""))
    undecided = read_deployment(copy, APP_GIVEN)
    assert undecided.withheld_layers is None
    assert any("LocalNormClient.get_parameters" in note and "judged as sent" in note for note in undecided.notes)


def test_fl4health_instance_level_dp_reads_noise_and_clip_from_its_config():
    app = APPS / "fl4health_dp"
    config = app / "config.yaml"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    assert rows["dp noise"] == ("1", f"config.yaml:{line_of(config, 'noise_multiplier')} noise_multiplier")
    assert rows["dp clip"] == ("5", f"config.yaml:{line_of(config, 'clipping_bound')} clipping_bound")
    client = f"client.py:{line_of(app / 'client.py', 'class CifarDpClient')}"
    assert rows["dp level"] == ("sample", f"InstanceLevelDpClient (FL4Health) at {client}")
    assert rows["dp noise-by"][0] == "client"
    assert rows["batch-size"] == ("16", f"config.yaml:{line_of(config, 'batch_size')} batch_size")
    assert rows["local-epochs"] == ("2", f"config.yaml:{line_of(config, 'local_epochs')} local_epochs")
    assert rows["server-rounds"] == ("4", f"config.yaml:{line_of(config, 'n_server_rounds')} n_server_rounds")
    dp = deployment.round.dp
    # DP-SGD at q = B/N over E·⌈N/B⌉ steps a round, every round.
    assert (dp.noise_multiplier, dp.clip, dp.sample_rate, dp.steps) == (1.0, 5.0, 16 / 32, 2 * 2 * 4)
    assert not [row for row in rows.values() if "not read" in row[1]], rows


def test_a_dp_client_whose_settings_are_not_in_the_config_is_named(tmp_path):
    app = tmp_path / "fl4health_dp"
    shutil.copytree(APPS / "fl4health_dp", app)
    config = app / "config.yaml"
    config.write_text(config.read_text().replace("noise_multiplier: 1.0\n", ""))
    with pytest.raises(UsageError) as raised:
        read_deployment(app, APP_GIVEN)
    message = str(raised.value)
    assert message.startswith("InstanceLevelDpClient (FL4Health) at client.py:") and "noise_multiplier" in message
    assert "--dp-noise" in message and "\n" not in message


def test_a_dp_client_base_rankaudit_has_no_rule_for_is_named(tmp_path):
    app = tmp_path / "fl4health_dp"
    shutil.copytree(APPS / "fl4health_dp", app)
    client = app / "client.py"
    client.write_text(
        client.read_text()
        .replace(
            "from fl4health.clients.instance_level_dp_client import InstanceLevelDpClient",
            "from fl4health.clients.scaffold_client import DPScaffoldClient",
        )
        .replace("class CifarDpClient(InstanceLevelDpClient)", "class CifarDpClient(DPScaffoldClient)")
    )
    deployment = read_deployment(app, APP_GIVEN)
    assert deployment.round.dp is None
    line = line_of(client, "class CifarDpClient")
    assert any(
        note.startswith(f"DPScaffoldClient at client.py:{line}: a privacy wrapper rankaudit has no rule for")
        and "noise it adds on the client is not counted" in note
        for note in deployment.notes
    ), deployment.notes


def test_hydra_packages_nested_defaults_overrides_and_optional_groups(tmp_path):
    conf = tmp_path / "conf"
    (conf / "experiment").mkdir(parents=True)
    (conf / "optim").mkdir()
    (tmp_path / "main.py").write_text(
        "import hydra\n\n\n@hydra.main(config_path='conf', config_name='run', version_base=None)\n"
        "def main(cfg):\n    pass\n"
    )
    (conf / "run.yaml").write_text(
        "defaults:\n  - experiment: small\n  - optional extras: none\n  - override optim: adam\n  - _self_\n"
        "num_rounds: 3\n"
    )
    (conf / "experiment" / "small.yaml").write_text(
        "# @package _global_\ndefaults:\n  - /optim: sgd\nbatch_size: 4\nnum_rounds: 9\n"
    )
    (conf / "optim" / "sgd.yaml").write_text("lr: 0.1\n")
    (conf / "optim" / "adam.yaml").write_text("# the run's optimizer\nlr: 0.001\nbetas: [0.9, 0.99]\n")
    read = app_yaml(tmp_path)
    assert read.notes == []
    assert read.entries["batch_size"] == (4, "conf/experiment/small.yaml:4")  # _global_: at the root
    assert read.entries["num_rounds"] == (3, "conf/run.yaml:6")  # _self_ after the experiment: the run's own wins
    assert read.entries["optim.lr"] == (0.001, "conf/optim/adam.yaml:2")  # the override chose adam
    assert read.entries["optim.betas"] == ([0.9, 0.99], "conf/optim/adam.yaml:3")


def test_a_yaml_config_in_a_subfolder_named_by_the_config_path_default_is_read(tmp_path):
    app = tmp_path / "fl4health"
    shutil.copytree(APPS / "fl4health_dp", app)
    (app / "configs").mkdir()
    (app / "config.yaml").rename(app / "configs" / "dp.yaml")
    server = app / "server.py"
    # FL4Health's examples write the default from the repository's root.
    server.write_text(
        server.read_text().replace('default="config.yaml"', 'default="examples/dp_fed_examples/configs/dp.yaml"')
    )
    config = app / "configs" / "dp.yaml"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    assert rows["batch-size"][1].startswith(f"configs/dp.yaml:{line_of(config, 'batch_size')}")
    assert rows["dp noise"][1].startswith(f"configs/dp.yaml:{line_of(config, 'noise_multiplier')}")
    assert rows["server-rounds"][1].startswith(f"configs/dp.yaml:{line_of(config, 'n_server_rounds')}")


def test_a_per_split_batch_size_table_gives_the_training_batch(tmp_path):
    app = tmp_path / "heterofl"
    shutil.copytree(APPS / "hydra_app", app)
    config = app / "conf" / "config.yaml"
    # HeteroFL's base.yaml: `dataset: {batch_size: {train: 10, test: 50}}`.
    config.write_text(
        config.read_text().replace("batch_size: 32\n", "dataset:\n  batch_size:\n    train: 10\n    test: 50\n")
    )
    deployment = read_deployment(app, APP_GIVEN)
    assert setting_rows(deployment)["batch-size"] == (
        "10",
        f"conf/config.yaml:{line_of(config, 'train: 10')} dataset.batch_size.train",
    )
    assert deployment.round.batch_size == 10
