"""A model factory that moves its model to a device (`net.to(device)`, `net.cuda()`) builds without weights, and a
model file that fails to build is checked on its own with the same stand-ins rankaudit used."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch

from rankaudit.model.load import load_model

APPS = Path(__file__).resolve().parent / "apps"
MOON = APPS / "moon_hydra"
MODEL_ARGS = ("--model-arg", "dataset=cifar10", "--model-arg", "model=simple-cnn", "--model-arg", "output_dim=32")


def test_device_moves_while_building_on_meta_leave_the_model_on_meta(tmp_path):
    model = tmp_path / "moved.py"
    model.write_text(
        "import torch\nfrom torch import nn\n\n\n"
        "def build_net(device='cpu'):\n"
        "    net = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))\n"
        "    scale = torch.ones(3).to(device, torch.float64)  # constructor arithmetic, asked in float64\n"
        "    assert scale.dtype == torch.float64\n"
        "    net.to(device)\n"
        "    return net.cuda() if device != 'cpu' else net.to(torch.device(device))\n"
    )
    for device in ("cpu", "cuda:0"):
        loaded = load_model(f"{model}:build_net", (4,), model_args={"device": device})
        tensors = [*loaded.module.parameters(), *loaded.module.buffers()]
        assert tensors and all(tensor.is_meta for tensor in tensors)
        assert loaded.module[0].weight.shape == torch.Size([3, 4])


def test_moon_factory_builds_from_the_app_and_a_missing_plot_library_is_not_blamed(run_cli, monkeypatch):
    monkeypatch.chdir(MOON)
    monkeypatch.setenv("FLWR_HOME", str(MOON / "no-flower-home"))
    flags = ("--local-samples", "16", "--input-shape", "3,8,8", "--format", "json")
    code, out, err = run_cli(".", *flags, *MODEL_ARGS)
    assert code in (0, 1), err  # built on meta through init_net's net.to(device), and judged
    payload = json.loads(out)
    assert payload["parameters"] == sum(
        p.numel()
        for p in (torch.nn.Conv2d(3, 4, 3), torch.nn.Linear(144, 24), torch.nn.Linear(24, 24))
        for p in p.parameters()
    ) + (24 * 32 + 32) + (32 * 10 + 10)
    if importlib.util.find_spec("matplotlib") is None:
        assert "matplotlib" in payload["stand_ins"]  # its utils module plots; the model never uses it
    settings = {row["setting"]: row for row in payload["deployment"]["settings"]}
    assert settings["local-epochs"]["value"] == "2" and settings["batch-size"]["value"] == "8"
    # Without the flags, the factory's arguments are the ones the client passes, read from the Hydra config: the
    # same model, each argument with its file and line (and still no blame on matplotlib).
    code, out, err = run_cli(".", *flags[:-2])
    assert code in (0, 1) and "matplotlib" not in err
    code, out, err = run_cli(".", *flags)
    read = json.loads(out)
    assert read["parameters"] == payload["parameters"]
    settings = {row["setting"]: row for row in read["deployment"]["settings"]}
    assert settings["model-arg output_dim"]["value"] == "32"
    assert settings["model-arg output_dim"]["source"] == "moon_app/conf/base.yaml:17 model.output_dim"


def test_a_module_no_stand_in_covers_is_named_and_the_flag_takes_it(run_cli, monkeypatch, tmp_path):
    app = tmp_path / "moon"
    shutil.copytree(MOON, app)
    models = app / "moon_app" / "models.py"
    models.write_text(models.read_text().replace("import torch\n", "import torch\nimport seaborn  # noqa: F401\n", 1))
    monkeypatch.chdir(app)
    monkeypatch.setenv("FLWR_HOME", str(tmp_path / "no-flower-home"))
    flags = ("--local-samples", "16", "--input-shape", "3,8,8", *MODEL_ARGS)
    code, out, err = run_cli(".", *flags)
    assert code == 3 and "imports seaborn" in err and "--stand-in seaborn" in err
    code, out, err = run_cli(".", *flags, "--stand-in", "seaborn")
    assert code in (0, 1), err
