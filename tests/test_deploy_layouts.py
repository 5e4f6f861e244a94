"""`rankaudit APP_DIR` finds what an app names where its packaging puts it: a src layout's packages, one model
however many identical copies of its file the app carries, and a TensorFlow app told what rankaudit reads."""

from __future__ import annotations

import shutil

import pytest
from conftest import APP_GIVEN, APPS, line_of, no_default_source, setting_rows

from rankaudit.deploy.app import read_deployment
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
