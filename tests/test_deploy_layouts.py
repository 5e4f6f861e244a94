"""`rankaudit APP_DIR` finds what an app names where its packaging puts it: a src layout's packages, one model
however many identical copies of its file the app carries, and a TensorFlow app told what rankaudit reads."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import APP_GIVEN, APPS, line_of, no_default_source, setting_rows

from rankaudit.deploy.app import Overrides, read_deployment
from rankaudit.errors import UsageError

pytestmark = pytest.mark.usefixtures("no_flower_configuration")


def test_a_src_layout_app_is_read_from_the_package_hatch_packs(run_cli, monkeypatch):
    app = APPS / "src_layout"
    task, client = app / "src" / "flpa" / "task.py", app / "src" / "flpa" / "client_app.py"
    deployment = read_deployment(app)
    rows = setting_rows(deployment)
    # [tool.hatch.build.targets.wheel] packages = ["src/flpa"]: flpa.client_app is src/flpa/client_app.py.
    assert rows["model"] == (
        "src/flpa/task.py:Net",
        f"Net(...) at src/flpa/client_app.py:{line_of(client, 'model = Net()')}, the model the app trains",
    )
    assert rows["momentum"] == ("0.9", f"src/flpa/task.py:{line_of(task, 'SGD(')}")
    assert rows["local-epochs"] == ("2", "[tool.flwr.app.config] local-epochs")
    assert rows["server-rounds"] == ("4", "[tool.flwr.app.config] num-server-rounds")
    no_default_source(rows)
    monkeypatch.chdir(APPS)
    code, out, err = run_cli("src_layout", "--quiet")  # the model imports flpa.layers, its own package
    assert code in (0, 1) and not err.strip(), err


def test_a_module_in_neither_the_app_nor_its_source_folder_names_both(tmp_path):
    app = tmp_path / "flpa"
    shutil.copytree(APPS / "src_layout", app)
    pyproject = app / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('clientapp = "flpa.client_app:app"', 'clientapp = "flpa.client:app"')
    )
    with pytest.raises(UsageError) as raised:
        read_deployment(app)
    assert "clientapp names the module flpa.client, which is not in the app" in str(raised.value)
    assert "flpa/client.py does not exist there or under src/" in str(raised.value)


def test_a_tensorflow_app_is_told_rankaudit_reads_pytorch_models(run_cli, monkeypatch):
    monkeypatch.chdir(APPS)
    code, out, err = run_cli("tensorflow", "--input-shape", "3,32,32", "--local-samples", "64")
    assert code == 2 and not out
    assert "tfexample/task.py builds the app's model with Keras" in err
    assert "rankaudit reads PyTorch models (torch.nn.Module) only" in err
    assert "install" not in err and len(err.strip().splitlines()) == 1


def test_identical_copies_of_a_model_file_are_one_model(tmp_path):
    job = tmp_path / "job"
    shutil.copytree(APPS / "nvflare_json", job)
    # An NVFlare job ships the same custom code to each site: byte-identical files, one model.
    (job / "app_site-2" / "custom").mkdir(parents=True)
    shutil.copy(job / "app" / "custom" / "net.py", job / "app_site-2" / "custom" / "net.py")
    rows = setting_rows(read_deployment(job, APP_GIVEN))
    assert rows["model"][0] == "app/custom/net.py:Net"
    # A copy that differs is another candidate, named with the first.
    copy = job / "app_site-2" / "custom" / "net.py"
    copy.write_text(copy.read_text().replace("class Net", "# changed at site 2\nclass Net"))
    with pytest.raises(UsageError) as raised:
        read_deployment(job, APP_GIVEN)
    assert "several model candidates (app/custom/net.py:Net, app_site-2/custom/net.py:Net)" in str(raised.value)


def test_a_job_that_imports_its_model_from_src_gets_that_one(tmp_path):
    job = tmp_path / "recipe"
    shutil.copytree(APPS / "nvflare_recipe", job)
    (job / "src").mkdir()
    model = job / "src" / "model.py"
    model.write_text((job / "model.py").read_text().replace("nn.Linear(64, 2)", "nn.Linear(64, 3)"))
    script = job / "job.py"
    script.write_text(script.read_text().replace("from model import CNN", "from src.model import CNN"))
    rows = setting_rows(read_deployment(job, APP_GIVEN))
    assert rows["model"] == (
        "src/model.py:CNN",
        f"CNN(...) at job.py:{line_of(script, 'model=CNN')}, the model the app trains",
    )


def test_an_apps_own_info_log_lines_stay_out_of_rankaudits_stderr():
    import subprocess
    import sys

    from conftest import REPO

    # flpa's task.py calls logging.basicConfig(level=INFO) and logs while it is imported and while Net is built.
    finished = subprocess.run(
        [sys.executable, "-m", "rankaudit", str(APPS / "src_layout"), "-q"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert finished.returncode in (0, 1), finished.stderr
    assert "flpa:" not in finished.stderr and "INFO" not in finished.stderr, finished.stderr
    assert finished.stdout.strip()  # the verdict line


def test_a_decoder_training_calls_outside_forward_is_named(tmp_path):
    app = tmp_path / "autoencoder"
    shutil.copytree(APPS / "quickstart", app, ignore=shutil.ignore_patterns("__pycache__"))
    task = app / "quickstart_app" / "task.py"
    task.write_text(
        task.read_text()
        .replace(
            "        self.head = Head(4 * 6 * 6, 10)\n",
            "        self.head = Head(4 * 6 * 6, 10)\n        self.decoder = nn.Linear(4 * 6 * 6, 64)\n",
        )
        .replace(
            "    def forward(self, x):\n",
            "    def reconstruct(self, x):\n"
            "        return self.decoder(torch.relu(self.conv1(x)).flatten(1)).view(-1, 1, 8, 8)\n\n"
            "    def forward(self, x):\n",
        )
        .replace(
            "criterion(net(images), labels).backward()",
            "(criterion(net(images), labels) + ((net.reconstruct(images) - images) ** 2).mean()).backward()",
        )
    )
    notes = [note for note in read_deployment(app).notes if "forward()" in note]
    assert notes == [
        f"Net.decoder (quickstart_app/task.py:{line_of(task, 'self.decoder =')}) is not used by forward() but by "
        "Net.reconstruct(), which the app's code calls: rankaudit traces forward() alone, so the gradients decoder "
        "adds to the update are not counted and the bound covers only what forward() uses; make forward() compute "
        "what training computes to count them"
    ]
    # A layer the app never calls outside forward() is no gradient: no note.
    task.write_text(task.read_text().replace(" + ((net.reconstruct(images) - images) ** 2).mean()", ""))
    assert not [note for note in read_deployment(app).notes if "forward()" in note]


def test_fedrep_model_named_by_model_name_and_its_head_kept_on_the_client(run_cli, monkeypatch):
    app = APPS / "fedrep"
    client, models = app / "fedrep" / "client_app.py", app / "fedrep" / "models.py"
    given = Overrides(round={"local_samples": 500}, input_shape_given=True)
    deployment = read_deployment(app, given)
    rows = setting_rows(deployment)
    # model-name = "cnncifar10" in the run config, mapped to CNNCifar10 through the model manager in code.
    assert rows["model"] == (
        "fedrep/implemented_models/cnn_cifar10.py:CNNCifar10",
        "CNNCifar10(...) at [tool.flwr.app.config] model-name = 'cnncifar10', the model the app trains",
    )
    assert rows["local-epochs"] == (
        "6",
        "[tool.flwr.app.config] num-local-epochs and [tool.flwr.app.config] num-rep-epochs",
    )  # range(local_epochs + rep_epochs)
    assert rows["momentum"] == ("0.5", f"fedrep/models.py:{line_of(models, 'momentum=0.5')}")
    # algorithm = "fedrep" picks FedRepClient (Algorithm.FEDREP.value), whose get_parameters sends the body alone.
    sent = line_of(client, "model.body.state_dict()")
    assert deployment.withheld_layers == ["head"]
    assert rows["withheld-layers"] == (
        "head",
        f"fedrep/client_app.py:{sent} (FedRepClient.get_parameters sends body alone)",
    )
    assert (
        f"FedRepClient.get_parameters at fedrep/client_app.py:{sent} sends the model's body alone: head stays on the "
        "client (personal layers, as in FedPer and FedRep) and is left out of what is judged as sent"
    ) in deployment.notes
    # The verdict follows what is sent: the same figures as the model file with its head withheld.
    monkeypatch.chdir(APPS)
    code, out, err = run_cli("fedrep", "--input-shape", "3,32,32", "--local-samples", "500", "--format", "json")
    read = json.loads(out)
    model = "fedrep/fedrep/implemented_models/cnn_cifar10.py:CNNCifar10"
    round_flags = ("-b", "50", "--local-epochs", "6", "--server-rounds", "100", "--lr", "0.01", "--momentum", "0.5")
    flags = ("--input-shape", "3,32,32", "--local-samples", "500", *round_flags, "--format", "json")
    code, out, err = run_cli(model, *flags, "--withheld-layers", "head.0")
    withheld = json.loads(out)
    code, out, err = run_cli(model, *flags)
    sent_whole = json.loads(out)
    assert read["identifiability"]["rank_bound"] == withheld["identifiability"]["rank_bound"] == 51146 - (32 * 10 + 10)
    assert sent_whole["identifiability"]["rank_bound"] == 51146
    # FedAvg's client sends everything: nothing withheld.
    fedavg = read_deployment(
        app, Overrides(round={"local_samples": 500}, run_config='algorithm="fedavg"', input_shape_given=True)
    )
    assert fedavg.withheld_layers is None and not any("sends the model's body" in note for note in fedavg.notes)


def test_fedper_model_arguments_from_base_yaml_its_own_package_and_its_head_kept(run_cli, monkeypatch):
    app = APPS / "fedper"
    base, client = app / "fedper" / "conf" / "base.yaml", app / "fedper" / "client.py"
    deployment = read_deployment(app, Overrides(round={"local_samples": 512}, input_shape_given=True))
    rows = setting_rows(deployment)
    # num_head_layers 2 at base.yaml, not MobileNet's constructor default 1.
    assert deployment.model_args == {"num_head_layers": 2, "num_classes": 10}
    assert rows["model-arg num_head_layers"] == (
        "2",
        f"fedper/conf/base.yaml:{line_of(base, 'num_head_layers')} model.num_head_layers",
    )
    sent = line_of(client, "model.body.state_dict()")
    assert rows["withheld-layers"] == (
        "head",
        f"fedper/client.py:{sent} (FedPerClient.get_parameters sends body alone)",
    )
    assert not any("sends the model's model" in note for note in deployment.notes)  # BaseClient sends the whole
    # fedper/ has no __init__.py: mobile_model.py's `from fedper.models import ...` imports the app's own package.
    monkeypatch.chdir(APPS)
    code, out, err = run_cli("fedper", "--input-shape", "3,16,16", "--local-samples", "512", "--format", "json")
    assert code in (0, 1), err
    payload = json.loads(out)
    # MobileNet(num_head_layers=2): the head holds the last depthwise block and the classifier.
    head = [layer["name"] for layer in payload["layers"] if layer["name"].startswith("head.")]
    assert head == ["head.0.0", "head.0.2", "head.1", "head.3"], head  # the pooling is a row of its own
    assert "not installed" not in err
