"""`rankaudit APP_DIR` reads the value each app's running code sets: the code paths its client and server apps
run (not a centralized main() beside them), `match` like `if`, run-config values through constructors and
attributes, a job's train_args however the job builds them, a job config's placeholders, a batch in another file."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import APP_GIVEN, APPS, line_of, no_default_source, setting_rows

from rankaudit.deploy.app import Overrides, read_deployment
from rankaudit.errors import UsageError

pytestmark = pytest.mark.usefixtures("no_flower_configuration")


def test_nvflare_fedprox_recipe_reads_train_args_built_from_run_time_paths():
    job = APPS / "nvflare_fedprox"
    script = job / "job.py"
    client = job / "src" / "client.py"
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    # train_script=os.path.join(os.path.dirname(__file__), ...) and an f-string with a run-time data path: the
    # job's --lr 0.05 reaches the script, never the script's own default 0.01.
    assert rows["lr"] == ("0.05", f"job.py:{line_of(script, '--lr')} (--lr's argparse default) (train_args --lr 0.05)")
    assert rows["batch-size"] == (
        "16",
        f"job.py:{line_of(script, '--batch_size')} (--batch_size's argparse default) (train_args --batch_size 16)",
    )
    assert rows["local-epochs"] == (
        "2",
        f"job.py:{line_of(script, '--aggregation_epochs')} (--aggregation_epochs's argparse default) "
        "(train_args --aggregation_epochs 2)",
    )
    assert rows["optimizer"] == ("sgd", f"SGD(momentum=0.9) at src/client.py:{line_of(client, 'SGD(')}")
    assert rows["momentum"] == ("0.9", f"src/client.py:{line_of(client, 'SGD(')}")
    assert rows["server-rounds"] == ("6", f"job.py:{line_of(script, '--num_rounds')} (--num_rounds's argparse default)")
    assert rows["nodes"] == ("4", f"job.py:{line_of(script, '--n_clients')} (--n_clients's argparse default)")
    assert rows["model"] == (
        "src/model.py:ModerateCNN",
        f"ModerateCNN(...) at job.py:{line_of(script, 'model=')}, the model the app trains",
    )
    round_ = deployment.round
    assert (round_.lr, round_.batch_size, round_.local_epochs, round_.momentum) == (0.05, 16, 2, 0.9)
    no_default_source(rows)


def test_nvflare_script_path_from_pathlib_and_a_run_time_value_for_an_option(tmp_path):
    job = tmp_path / "fedprox"
    shutil.copytree(APPS / "nvflare_fedprox", job)
    script = job / "job.py"
    script.write_text(
        script.read_text()
        .replace(
            'os.path.join(os.path.dirname(__file__), "src", "client.py")',
            'str(Path(__file__).parent / "src" / "client.py")',
        )
        .replace("import tempfile\n", "import tempfile\nfrom pathlib import Path\n")
        .replace("--lr {args.lr}", "--lr {tempfile.gettempdir()}")
        .replace("model=ModerateCNN()", "initial_model=ModerateCNN()")
    )
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    assert rows["batch-size"][0] == "16" and rows["local-epochs"][0] == "2"  # the script was found and passed
    assert (
        rows["model"][1] == f"ModerateCNN(...) at job.py:{line_of(script, 'initial_model=')}, the model the app trains"
    )
    # --lr is passed, with a value the job computes when it runs: neither the script's default nor a guess.
    assert rows["lr"][0] == "0.1" and rows["lr"][1].startswith("not read from the app")


def test_nvflare_flip_executor_arguments_from_config_placeholders():
    job = APPS / "nvflare_flip"
    trainer = job / "app" / "custom" / "flip_trainer.py"
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    assert rows["local-epochs"] == (
        "1",
        "app/config/config_fed_client.json local_rounds (passed as FLIP_TRAINER's epochs)",
    )  # not the trainer's __init__ default 5
    assert rows["lr"] == ("0.02", "app/config/config_fed_client.json learning_rate (passed as FLIP_TRAINER's lr)")
    assert rows["batch-size"] == ("8", f"app/custom/flip_trainer.py:{line_of(trainer, 'batch_size=8')}")
    assert rows["optimizer"] == ("sgd", f"SGD(momentum=0.9) at app/custom/flip_trainer.py:{line_of(trainer, 'SGD(')}")
    assert rows["momentum"] == ("0.9", f"app/custom/flip_trainer.py:{line_of(trainer, 'SGD(')}")
    assert rows["server-rounds"] == ("3", "app/config/config_fed_server.json num_rounds")
    assert rows["clients per round"] == ("2", "app/config/config_fed_server.json min_clients")
    assert rows["model"] == (
        "app/custom/simple_network.py:SimpleNetwork",
        f"SimpleNetwork(...) at app/custom/flip_trainer.py:{line_of(trainer, 'SimpleNetwork()')}, the model the app trains",
    )
    assert (deployment.round.local_epochs, deployment.round.lr) == (1, 0.02)
    no_default_source(rows)


def test_centralized_to_federated_port_reads_the_clients_epochs_not_the_centralized_main():
    app = APPS / "centralized_port"
    cifar, client = app / "cifar.py", app / "client.py"
    deployment = read_deployment(app, APP_GIVEN)
    rows = setting_rows(deployment)
    assert rows["local-epochs"] == ("1", f"client.py:{line_of(client, 'epochs=1')}")  # cifar.main() trains 2
    assert rows["batch-size"] == ("32", f"cifar.py:{line_of(cifar, 'batch_size=32')}")
    assert rows["lr"] == ("0.001", f"cifar.py:{line_of(cifar, 'SGD(')}")
    assert rows["optimizer"] == ("sgd", f"SGD(momentum=0.9) at cifar.py:{line_of(cifar, 'SGD(')}")
    assert rows["momentum"] == ("0.9", f"cifar.py:{line_of(cifar, 'SGD(')}")
    assert rows["server-rounds"] == ("3", f"server.py:{line_of(app / 'server.py', 'num_rounds=3')}")
    assert rows["model"] == (
        "cifar.py:Net",
        f"Net(...) at client.py:{line_of(client, 'cifar.Net()')}, the model the app trains",
    )
    assert deployment.round.local_epochs == 1
    no_default_source(rows)


def test_a_match_on_a_preferences_default_picks_the_case_the_app_takes(tmp_path):
    app = APPS / "match_optimizer"
    task = app / "match_app" / "task.py"
    deployment = read_deployment(app)
    rows = setting_rows(deployment)
    assert rows["optimizer"] == ("adam", f"Adam at match_app/task.py:{line_of(task, 'torch.optim.Adam(')}")
    assert "momentum" not in rows and deployment.round.momentum == 0.0  # never the sgd case's momentum
    assert rows["lr"] == ("0.005", f"match_app/task.py:{line_of(task, 'lr: float')}")
    assert rows["batch-size"] == ("12", f"match_app/task.py:{line_of(task, 'batch_size: int')}")
    assert rows["local-epochs"] == ("2", "[tool.flwr.app.config] local-epochs")
    assert rows["server-rounds"] == ("3", "[tool.flwr.app.config] num-server-rounds")
    no_default_source(rows)
    # The case follows the value: "SGD" lower-cased takes the sgd case, with its momentum.
    copy = tmp_path / "match"
    shutil.copytree(app, copy)
    copied = copy / "match_app" / "task.py"
    copied.write_text(copied.read_text().replace('optimizer: str = "adam"', 'optimizer: str = "SGD"'))
    sgd = read_deployment(copy)
    assert setting_rows(sgd)["optimizer"][0] == "sgd" and sgd.round.momentum == 0.9
    # A subject that is not read: refused in one line, never the first case.
    copied.write_text(copied.read_text().replace("match preferences.optimizer.lower():", "match OPTIMIZER_FROM_ENV:"))
    with pytest.raises(UsageError) as raised:
        read_deployment(copy)
    message = str(raised.value)
    assert "`match OPTIMIZER_FROM_ENV` at match_app/task.py" in message and "\n" not in message


def test_a_match_on_a_run_config_key_passed_as_a_parameter_takes_the_configured_case(tmp_path):
    app = APPS / "match_run_config"
    task = app / "optim_app" / "task.py"
    client = app / "optim_app" / "client_app.py"
    deployment = read_deployment(app)
    rows = setting_rows(deployment)
    # optimizer = "sgd" -> get_optimizer(net, run_config["optimizer"], ...) -> `match name: case "sgd"`.
    assert rows["optimizer"] == ("sgd", f"SGD(momentum=0.8) at optim_app/task.py:{line_of(task, 'optim.SGD(')}")
    assert rows["momentum"] == ("0.8", "[tool.flwr.app.config] momentum")
    assert rows["lr"] == ("0.02", "[tool.flwr.app.config] learning-rate")
    assert (deployment.round.optimizer, deployment.round.momentum, deployment.round.lr) == ("sgd", 0.8, 0.02)
    no_default_source(rows)
    copy = tmp_path / "optim"
    shutil.copytree(app, copy)
    pyproject = copy / "pyproject.toml"
    # "adam" takes the Adam case: the run config's momentum feeds only the SGD case, so none is read.
    pyproject.write_text(pyproject.read_text().replace('optimizer = "sgd"', 'optimizer = "adam"'))
    adam = read_deployment(copy)
    assert setting_rows(adam)["optimizer"] == ("adam", f"Adam at optim_app/task.py:{line_of(task, 'optim.Adam(')}")
    assert "momentum" not in setting_rows(adam) and adam.round.momentum == 0.0
    # No optimizer key: the choice is the app's at run time; one line names the key the client passes.
    pyproject.write_text(pyproject.read_text().replace('optimizer = "adam"\n', ""))
    with pytest.raises(UsageError) as raised:
        read_deployment(copy)
    message = str(raised.value)
    passed = line_of(client, 'self.run_config["optimizer"]')
    assert (
        f"`match name` at optim_app/task.py:{line_of(task, 'match name')}, passed `self.run_config['optimizer']` "
        f"at optim_app/client_app.py:{passed}"
    ) in message
    assert "\n" not in message


def test_a_run_config_strategy_followed_through_the_constructor_into_train():
    app = APPS / "strategy_choice"
    task = app / "strategy_app" / "task.py"
    client = app / "strategy_app" / "client_app.py"
    deployment = read_deployment(app)
    rows = setting_rows(deployment)
    # strategy = "fedavg" -> FlowerClient(..., strategy_name) -> self.strategy_name -> train(..., strategy, ...)
    assert rows["optimizer"] == (
        "sgd",
        f"SGD(momentum=0.9) at strategy_app/task.py:{line_of(task, 'torch.optim.SGD(')}",
    )
    assert rows["momentum"] == ("0.9", f"strategy_app/client_app.py:{line_of(client, 'CLIENT_MOMENTUM = ')}")
    assert rows["lr"] == ("0.03", "[tool.flwr.app.config] learning-rate")
    assert rows["batch-size"] == ("20", "[tool.flwr.app.config] batch-size")
    assert rows["local-epochs"] == ("1", "[tool.flwr.app.config] local-epochs")
    assert rows["server-rounds"] == ("5", "[tool.flwr.app.config] num-server-rounds")
    assert rows["clients per round"][0] == "3"  # max(⌊0.5 · 6⌋, 2)
    assert (deployment.round.optimizer, deployment.round.momentum) == ("sgd", 0.9)
    no_default_source(rows)
    adam = read_deployment(app, Overrides(run_config='strategy="fedadam"'))
    assert setting_rows(adam)["optimizer"] == (
        "adam",
        f"Adam at strategy_app/task.py:{line_of(task, 'torch.optim.Adam(')}",
    )
    assert adam.round.momentum == 0.0


def test_a_momentum_that_is_not_read_is_named_not_taken_as_zero(tmp_path):
    app = tmp_path / "strategy"
    shutil.copytree(APPS / "strategy_choice", app)
    client = app / "strategy_app" / "client_app.py"
    client.write_text(client.read_text().replace("momentum=CLIENT_MOMENTUM", "momentum=self.tuned_momentum()"))
    deployment = read_deployment(app)
    assert "momentum" not in setting_rows(deployment)
    assert any("SGD momentum is set to `momentum`" in note and "--momentum" in note for note in deployment.notes)


def test_the_metric_privacy_branch_is_the_only_one_taken():
    app = APPS / "metric_privacy"
    factory = app / "metric_app" / "strategy_factory.py"
    deployment = read_deployment(app)
    rows = setting_rows(deployment)
    assert deployment.round.dp is None and not any(key.startswith("dp ") for key in rows)
    wrapper = f"MetricPrivacyServerSideFixedClipping at metric_app/strategy_factory.py:{line_of(factory, 'return MetricPrivacy')}"
    assert [note for note in deployment.notes if "privacy wrapper" in note] == [
        f"{wrapper}: a privacy wrapper rankaudit has no rule for; its noise, added by the server, protects nothing "
        "against the server (set noise, clip and noise-by in [tool.rankaudit.dp] to count it)"
    ]
    assert not any("DifferentialPrivacyServerSideFixedClipping" in note for note in deployment.notes)
    assert rows["server-rounds"] == ("20", "[tool.flwr.app.config] num-server-rounds")
    assert rows["optimizer"][0] == "adam" and rows["lr"] == ("0.001", "[tool.flwr.app.config] learning-rate")
    # The global-dp branch, when the run config takes it: Flower's wrapper, and no metric-privacy note.
    dp = read_deployment(app, Overrides(run_config='privacy="global-dp"'))
    assert (dp.round.dp.noise_multiplier, dp.round.dp.clip, dp.round.dp.noise_by) == (0.05, 5.0, "server")
    assert setting_rows(dp)["dp level"] == (
        "client",
        f"DifferentialPrivacyServerSideFixedClipping at metric_app/strategy_factory.py:"
        f"{line_of(factory, 'return DifferentialPrivacy')}",
    )
    assert not any("MetricPrivacy" in note for note in dp.notes)


def test_script_opacus_client_batch_read_across_files_and_noise_on_the_client():
    app = APPS / "dp_script"
    main = app / "dp_cifar_main.py"
    deployment = read_deployment(app, Overrides(round={"local_samples": 70}, input_shape_given=True))
    rows = setting_rows(deployment)
    batch, epochs = line_of(main, "batch_size"), line_of(main, "local_epochs")
    noise, clip = line_of(main, "noise_multiplier"), line_of(main, "max_grad_norm")
    # DataLoader(trainset, PARAMS["batch_size"]) in dp_cifar_client.py, PARAMS assigned in dp_cifar_main.py.
    assert rows["batch-size"] == ("32", f"dp_cifar_main.py:{batch}")
    assert rows["local-epochs"] == ("1", f"dp_cifar_main.py:{epochs}")
    assert rows["lr"] == ("0.001", f"dp_cifar_main.py:{line_of(main, 'SGD(')}")
    assert rows["momentum"] == ("0.9", f"dp_cifar_main.py:{line_of(main, 'SGD(')}")
    assert rows["dp noise"] == ("0.4", f"dp_cifar_main.py:{noise}")
    assert rows["dp clip"] == ("1.2", f"dp_cifar_main.py:{clip}")
    assert rows["dp noise-by"][0] == "client" and rows["dp level"][0] == "sample"
    assert rows["server-rounds"] == ("3", f"dp_cifar_server.py:{line_of(app / 'dp_cifar_server.py', 'num_rounds=3')}")
    assert not any("DPCifarClient" in note or "added by the server" in note for note in deployment.notes)
    dp = deployment.round.dp
    assert (dp.noise_multiplier, dp.clip, dp.sample_rate, dp.steps) == (0.4, 1.2, 32 / 70, 9)  # q = B/N, 1·3 × 3
    no_default_source(rows)


def test_a_privacy_wrapper_named_like_a_client_adds_its_noise_on_the_client(tmp_path):
    app = tmp_path / "dp_script"
    shutil.copytree(APPS / "dp_script", app)
    main = app / "dp_cifar_main.py"
    text = main.read_text()
    start = text.index("        self.privacy_engine = PrivacyEngine(")
    end = text.index("        )\n", start) + len("        )\n")
    main.write_text(text[:start] + "        self.privacy_engine = None\n" + text[end:])
    deployment = read_deployment(app, Overrides(round={"local_samples": 70}, input_shape_given=True))
    notes = [note for note in deployment.notes if "DPCifarClient" in note]
    assert len(notes) == 1 and "noise it adds on the client is not counted" in notes[0]


def test_suggest_and_compare_take_the_app_folder_check_takes(run_cli, monkeypatch):
    monkeypatch.chdir(APPS)
    code, out, err = run_cli("suggest", "quickstart", "--format", "json", "--top", "1")
    payload = json.loads(out)
    assert code == 0, err
    assert payload["model"].endswith("quickstart_app/task.py:Net") and payload["batch_size"] == 32  # the app's batch
    code, out, err = run_cli("compare", "quickstart", "branches", "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["a"]["model"].endswith("quickstart_app/task.py:Net")
    assert payload["b"]["model"].endswith("branches_app/task.py:Net")
    code, out, err = run_cli("suggest", "nvflare_json")  # what the app cannot say: one line, exit 2
    assert code == 2 and "input shape" in err and len(err.strip().splitlines()) == 1


def test_the_hydra_momentum_is_read_not_taken_as_zero(tmp_path):
    app = tmp_path / "hydra"
    shutil.copytree(APPS / "hydra_app", app)
    config = app / "conf" / "config.yaml"
    config.write_text(config.read_text().replace("momentum: 0.0", "momentum: 0.9"))
    deployment = read_deployment(app, APP_GIVEN)
    value, source = setting_rows(deployment)["momentum"]
    assert value == "0.9" and source.startswith("conf/config.yaml") and "train.momentum" in source
    assert deployment.round.momentum == 0.9


def test_what_runs_follows_star_imports_and_dotted_targets(tmp_path):
    app = tmp_path / "port"
    shutil.copytree(APPS / "centralized_port", app)
    client = app / "client.py"
    client.write_text(
        client.read_text()
        .replace("import cifar\n", "from cifar import *  # noqa: F403\n")
        .replace("cifar.train(", "train(")
        .replace("cifar.Net()", "Net()")
        .replace("cifar.load_data()", "load_data()")
    )
    rows = setting_rows(read_deployment(app, APP_GIVEN))
    assert rows["local-epochs"] == ("1", f"client.py:{line_of(client, 'epochs=1')}")  # main() is still not run
    assert rows["lr"] == ("0.001", f"cifar.py:{line_of(app / 'cifar.py', 'SGD(')}")  # train() is
    # A function the app names only as a string (Hydra's `_target_`) runs too.
    client.write_text(
        client.read_text().replace("train(self.model", "TRAINER = 'cifar.train'\n        run(TRAINER, self.model")
    )
    assert setting_rows(read_deployment(app, APP_GIVEN))["lr"][0] == "0.001"


def test_a_factory_choice_its_callers_leave_unread_is_refused_not_taken(tmp_path):
    app = tmp_path / "metric"
    shutil.copytree(APPS / "metric_privacy", app)
    server = app / "metric_app" / "server_app.py"
    server.write_text(server.read_text().replace('config["privacy"],', "choose_privacy(),"))
    with pytest.raises(UsageError) as raised:
        read_deployment(app)
    message = str(raised.value)
    assert "DifferentialPrivacyServerSideFixedClipping at metric_app/strategy_factory.py" in message
    assert "privacy == 'global-dp'" in message and "\n" not in message


def test_server_rounds_the_app_does_not_state_readably_stop_with_the_key_to_state(tmp_path):
    app = tmp_path / "port"
    shutil.copytree(APPS / "centralized_port", app)
    server = app / "server.py"
    server.write_text(
        "import os\n" + server.read_text().replace("num_rounds=3", 'num_rounds=int(os.environ["ROUNDS"])')
    )
    # Several rounds add equations to each sample's bound: one round assumed would understate it.
    with pytest.raises(UsageError) as raised:
        read_deployment(app, APP_GIVEN)
    assert "server-rounds is not read from the app" in str(raised.value)
    assert "set server-rounds = R in [tool.rankaudit.round] (or --server-rounds R)" in raised.value.fix
    given = Overrides(round={"local_samples": 32, "server_rounds": 7}, input_shape_given=True)
    deployment = read_deployment(app, given)
    assert setting_rows(deployment)["server-rounds"] == ("7", "--server-rounds")
    assert (deployment.round.server_rounds, deployment.round.server_rounds_known) == (7, True)


def test_depthfl_clients_per_round_from_min_fit_clients_computed_in_code_and_the_strategys_fraction():
    app = APPS / "depthfl"
    config = app / "depthfl" / "conf" / "config.yaml"
    deployment = read_deployment(app, Overrides(round={"local_samples": 500}, input_shape_given=True))
    rows = setting_rows(deployment)
    # min_fit_clients=int(cfg.num_clients * cfg.fraction) = int(100 * 0.1) in main.py, and the strategy node's
    # fraction_fit 0.00001 (DepthFL's own FedDyn, a FedAvg): max(⌊1e-5 · 100⌋, 10) = 10, not all 100 nodes.
    value, source = rows["clients per round"]
    assert value == "10"
    assert f"depthfl/conf/config.yaml:{line_of(config, 'fraction_fit')} strategy.fraction_fit" in source
    assert f"depthfl/conf/config.yaml:{line_of(config, 'fraction: 0.1')} fraction" in source
    assert rows["nodes"] == ("100", f"depthfl/conf/config.yaml:{line_of(config, 'num_clients: 100')} num_clients")
    assert rows["local-epochs"] == ("5", f"depthfl/conf/config.yaml:{line_of(config, 'num_epochs')} num_epochs")
    assert rows["batch-size"] == ("50", f"depthfl/conf/config.yaml:{line_of(config, 'batch_size')} batch_size")
    assert rows["server-rounds"] == ("1000", f"depthfl/conf/config.yaml:{line_of(config, 'num_rounds')} num_rounds")
    assert deployment.model_args == {"n_blocks": 4, "num_classes": 100}


def test_depthfl_per_client_depth_is_read_as_the_deepest_client(tmp_path):
    app = tmp_path / "depthfl"
    shutil.copytree(APPS / "depthfl", app)
    main, config = app / "depthfl" / "main.py", app / "depthfl" / "conf" / "config.yaml"
    # The config's node says 2 blocks, but every client's copy is set in code: a quarter at each of 1 to 4.
    config.write_text(config.read_text().replace("n_blocks: 4", "n_blocks: 2"))
    given = Overrides(round={"local_samples": 500}, input_shape_given=True)
    deployment = read_deployment(app, given)
    line = line_of(main, "model.n_blocks =")
    assert deployment.model_args == {"n_blocks": 4, "num_classes": 100}
    assert setting_rows(deployment)["model-arg n_blocks"] == (
        "4",
        f"depthfl/main.py:{line} (the largest of `i // (cfg.num_clients // 4) + 1` over the clients)",
    )
    assert (
        f"n_blocks is set per client at depthfl/main.py:{line} (1 to 4 over 100 clients): the model with n_blocks = 4 "
        "is analysed, the deepest a client trains: the worst case where a shallower client's model is a part of it "
        "(DepthFL's blocks and exits)"
    ) in deployment.notes
    # Half the clients at each of two depths: the deepest is 2, whatever the config's node says.
    main.write_text(main.read_text().replace("i // (cfg.num_clients // 4) + 1", "i // (cfg.num_clients // 2) + 1"))
    config.write_text(config.read_text().replace("n_blocks: 2", "n_blocks: 4"))
    assert read_deployment(app, given).model_args["n_blocks"] == 2
    # A depth the code computes in a way rankaudit does not read: one line naming the argument to state.
    main.write_text(main.read_text().replace("i // (cfg.num_clients // 2) + 1", "depth_of(i)"))
    with pytest.raises(UsageError) as raised:
        read_deployment(app, given)
    message = str(raised.value)
    assert message.startswith(f"n_blocks of the model is set per client at depthfl/main.py:{line} (`depth_of(i)`)")
    assert "--model-arg n_blocks=N" in message and "\n" not in message
    stated = Overrides(round={"local_samples": 500}, input_shape_given=True, model_args=("n_blocks=3",))
    assert read_deployment(app, stated).model_args["n_blocks"] == 3


def test_percentile_privacy_is_a_client_side_result_filter_that_adds_no_noise(tmp_path):
    job = tmp_path / "fedavg"
    shutil.copytree(APPS / "nvflare_fedavg_job", job)
    script = job / "fedavg_script_runner.py"
    script.write_text(
        script.read_text()
        .replace(
            "from nvflare.job_config.script_runner import ScriptRunner\n",
            "from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy\n"
            "from nvflare.job_config.script_runner import ScriptRunner\n"
            "from nvflare.job_config.defs import FilterType\n",
        )
        .replace(
            '        job.to(runner, f"site-{site + 1}")\n',
            '        job.to(runner, f"site-{site + 1}")\n'
            '        job.to(PercentilePrivacy(percentile=10, gamma=0.01), f"site-{site + 1}", tasks=["train"], '
            "filter_type=FilterType.TASK_RESULT)\n",
        )
    )
    deployment = read_deployment(job, APP_GIVEN)
    line = line_of(script, "PercentilePrivacy(percentile")
    notes = [note for note in deployment.notes if "PercentilePrivacy" in note]
    assert notes == [
        f"PercentilePrivacy at fedavg_script_runner.py:{line}: a result filter on the client that sends only the "
        "weight changes above its percentile, clipped to gamma; it adds no noise, so nothing is counted as DP, and "
        "the entries it sends still carry the samples (the bound judges the full update, an upper bound on what the "
        "filtered one shows)"
    ]
    assert deployment.round.dp is None and not any("server" in note for note in notes)
    # The same filter in a client config's task_result_filters.
    configured = tmp_path / "json"
    shutil.copytree(APPS / "nvflare_json", configured)
    client = configured / "app" / "config" / "config_fed_client.json"
    config = json.loads(client.read_text())
    config["task_result_filters"] = [
        {
            "tasks": ["train"],
            "filters": [
                {
                    "path": "nvflare.app_common.filters.percentile_privacy.PercentilePrivacy",
                    "args": {"percentile": 10, "gamma": 0.01},
                }
            ],
        }
    ]
    client.write_text(json.dumps(config, indent=2))
    deployment = read_deployment(configured, APP_GIVEN)
    assert [note for note in deployment.notes if "PercentilePrivacy" in note] == [
        notes[0].replace(f"fedavg_script_runner.py:{line}", "app/config/config_fed_client.json")
    ]
    assert deployment.round.dp is None


def test_hello_lightning_train_args_joined_with_plus_and_the_trainers_max_epochs(tmp_path):
    job = APPS / "nvflare_lightning"
    script, client = job / "job.py", job / "client.py"
    deployment = read_deployment(job, APP_GIVEN)
    rows = setting_rows(deployment)
    # train_args = f"--batch_size {batch_size} ..." + (" --synthetic_data" if args.synthetic_data else ""): the
    # job's 24 reaches the client, not the client's own argparse default 4.
    assert rows["batch-size"] == (
        "24",
        f"job.py:{line_of(script, '--batch_size')} (--batch_size's argparse default) (train_args --batch_size 24)",
    )
    assert rows["local-epochs"] == ("1", f"client.py:{line_of(client, 'Trainer(max_epochs=1')}")
    assert rows["momentum"] == ("0.9", f"model.py:{line_of(job / 'model.py', 'SGD(')}")
    assert rows["server-rounds"][0] == "2" and deployment.round.batch_size == 24
    no_default_source(rows)
    # A branch whose condition is known only when the job runs: an option it passes is not read from either side.
    changed = tmp_path / "lightning"
    shutil.copytree(job, changed)
    text = (changed / "job.py").read_text()
    (changed / "job.py").write_text(
        "import os\n"
        + text.replace('" --synthetic_data" if args.synthetic_data', '" --batch_size 8" if os.environ.get("FAST")')
    )
    with pytest.raises(UsageError) as raised:
        read_deployment(changed, APP_GIVEN)
    assert "batch-size" in str(raised.value)


def test_a_match_on_a_parameter_passed_through_an_aliased_import_takes_the_apps_case(tmp_path):
    app = tmp_path / "quickstart"
    shutil.copytree(APPS / "quickstart", app, ignore=shutil.ignore_patterns("__pycache__"))
    task, client = app / "quickstart_app" / "task.py", app / "quickstart_app" / "client_app.py"
    task.write_text(
        task.read_text()
        .replace(
            "def train(net, trainloader, epochs, lr, device):",
            'def train(net, trainloader, epochs, lr, device, name="sgd"):',
        )
        .replace(
            "    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)\n",
            "    match name:\n"
            '        case "adam":\n'
            "            optimizer = torch.optim.Adam(net.parameters(), lr=lr)\n"
            "        case _:\n"
            "            optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)\n",
        )
    )
    # client_app.py imports `train as train_fn`; task.py's own `net.train()` is the module's method, no call of it.
    client.write_text(client.read_text().replace('"cpu")', '"cpu", name=context.run_config["optimizer"])'))
    pyproject = app / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace("batch-size = 32\n", 'batch-size = 32\noptimizer = "adam"\n'))
    rows = setting_rows(read_deployment(app))
    assert rows["optimizer"] == ("adam", f"Adam at quickstart_app/task.py:{line_of(task, 'optim.Adam(')}")
    assert "momentum" not in rows  # Adam's, not the SGD case's 0.9
