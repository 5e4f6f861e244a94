#!/usr/bin/env python3
"""App benchmark: how long `rankaudit APP_DIR` takes to read an app, as a user runs it.

    python benchmarks/bench_apps.py [--modules 60] [--functions 60] [--repeat 1] [--out apps.json]

Apps: every app folder under tests/apps (Flower apps, script-style clients, NVFlare jobs), and one generated large
Flower app in the style of a research code base: a strategy factory that picks a privacy wrapper from the run
config, a client that reads its settings from the run config, and a package of experiment modules (`--modules`
files of `--functions` functions each, calling one another with run-time values) that the client and server
import. Each app is one fresh `rankaudit DIR --format json` process (reading the app, building the model on the
meta device, tracing, counting, the report); the time is its wall clock and its CPU time (user + system: on a
shared machine the wall clock grows with the load, the CPU time much less), and the reading alone (read_deployment
in this process) is timed beside it. The target: every app under 20 s on a two-core machine. This is a
benchmark, not a test: it always exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
APPS = ROOT / "tests" / "apps"
# What an app cannot say (its input shape, the samples per client), for the apps whose pyproject does not say it.
INPUT_SHAPES = {
    "centralized_port": "3,8,8",
    "dp_script": "3,8,8",
    "hydra_app": "10",
    "nvflare_fedprox": "3,8,8",
    "nvflare_flip": "1,8,8",
    "nvflare_job": "16",
    "nvflare_json": "1,8,8",
    "nvflare_recipe": "1,8,8",
    "script_client": "1,8,8",
}


def _given(app: Path) -> list[str]:
    shape = INPUT_SHAPES.get(app.name)
    return ["--input-shape", shape, "--local-samples", "32"] if shape else []


def make_large_app(directory: Path, modules: int, functions: int) -> Path:
    """A Flower app whose package holds `modules` experiment modules of `functions` functions each."""
    app = directory / "large_app"
    package = app / "large_pkg"
    experiments = package / "experiments"
    experiments.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (experiments / "__init__.py").write_text("")
    (app / "pyproject.toml").write_text(
        '[project]\nname = "large-app"\nversion = "1.0.0"\n\n[tool.flwr.app]\npublisher = "bench"\n\n'
        '[tool.flwr.app.components]\nserverapp = "large_pkg.server_app:app"\nclientapp = "large_pkg.client_app:app"\n\n'
        "[tool.flwr.app.config]\nnum-server-rounds = 20\nbatch-size = 32\nlr = 0.001\nlocal-epochs = 5\n"
        'privacy = "metric-privacy"\nnoise-multiplier = 0.05\nclipping-norm = 5.0\nnum-clients = 4\n\n'
        '[tool.flwr.federations]\ndefault = "sim"\n\n[tool.flwr.federations.sim]\noptions.num-supernodes = 4\n\n'
        "[tool.rankaudit]\ninput-shape = [12]\n\n[tool.rankaudit.round]\nlocal-samples = 64\n"
    )
    (package / "task.py").write_text(
        "import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc1 = nn.Linear(12, 8)\n        self.fc2 = nn.Linear(8, 2)\n\n"
        "    def forward(self, x):\n        return self.fc2(torch.relu(self.fc1(x)))\n\n\n"
        "def train(net, loader, epochs, lr):\n    optimizer = torch.optim.Adam(net.parameters(), lr=lr)\n"
        "    for _ in range(epochs):\n        for (x,) in loader:\n            optimizer.zero_grad()\n"
        "            net(x).sum().backward()\n            optimizer.step()\n"
    )
    (package / "wrappers.py").write_text(
        "from flwr.serverapp.strategy import Strategy\n\n\nclass MetricPrivacyServerSideFixedClipping(Strategy):\n"
        "    def __init__(self, strategy, noise_multiplier, clipping_norm, num_sampled_clients):\n"
        "        self.strategy = strategy\n"
    )
    (package / "factory.py").write_text(
        "from flwr.serverapp.strategy import DifferentialPrivacyServerSideFixedClipping, FedAvg\n\n"
        "from large_pkg.wrappers import MetricPrivacyServerSideFixedClipping\n\n\n"
        "def make_strategy(privacy, *, num_clients, noise_multiplier, clipping_norm):\n"
        "    strategy = FedAvg(min_train_nodes=num_clients)\n    if privacy == 'vanilla':\n        return strategy\n"
        "    if privacy == 'global-dp':\n        return DifferentialPrivacyServerSideFixedClipping(\n"
        "            strategy=strategy, noise_multiplier=noise_multiplier, clipping_norm=clipping_norm,\n"
        "            num_sampled_clients=num_clients,\n        )\n    if privacy == 'metric-privacy':\n"
        "        return MetricPrivacyServerSideFixedClipping(\n            strategy=strategy, "
        "noise_multiplier=noise_multiplier, clipping_norm=clipping_norm,\n"
        "            num_sampled_clients=num_clients,\n        )\n    raise ValueError(privacy)\n"
    )
    imports = "".join(f"from large_pkg.experiments import sweep_{index}  # noqa: F401\n" for index in range(modules))
    (package / "server_app.py").write_text(
        "from flwr.serverapp import ServerApp\n\nfrom large_pkg.factory import make_strategy\n"
        + imports
        + "\napp = ServerApp()\n\n\n@app.main()\ndef main(grid, context):\n    config = context.run_config\n"
        "    strategy = make_strategy(\n        config['privacy'], num_clients=config['num-clients'],\n"
        "        noise_multiplier=config['noise-multiplier'], clipping_norm=config['clipping-norm'],\n    )\n"
        "    strategy.start(grid=grid, num_rounds=config['num-server-rounds'])\n"
    )
    (package / "client_app.py").write_text(
        "import torch\nfrom flwr.clientapp import ClientApp\nfrom torch.utils.data import DataLoader, TensorDataset\n\n"
        "from large_pkg.task import Net, train\n\napp = ClientApp()\n\n\n@app.train()\ndef fit(msg, context):\n"
        "    net = Net()\n    loader = DataLoader(TensorDataset(torch.randn(64, 12)), "
        "batch_size=context.run_config['batch-size'], shuffle=True)\n"
        "    train(net, loader, context.run_config['local-epochs'], context.run_config['lr'])\n"
    )
    for index in range(modules):
        lines = [
            "import torch\n",
            "from large_pkg.factory import make_strategy\n",
            "from large_pkg.task import Net, train\n\n",
            "SETTINGS = {'lr': 0.1, 'epochs': 3, 'privacy': 'global-dp'}\n\n",
        ]
        for number in range(functions):
            callee = f"step_{(number + 1) % functions}"
            lines.append(
                f"\ndef step_{number}(config, value, depth=0):\n"
                f"    scaled = value * {number + 1} + config.get('offset', 0)\n"
                f"    if config['mode'] == 'sweep' and depth < 3:\n"
                f"        return {callee}(config, scaled, depth + 1)\n"
                f"    strategy = make_strategy(config['privacy'], num_clients=config['clients'], "
                f"noise_multiplier=scaled, clipping_norm=config['clip'])\n"
                f"    loader = torch.utils.data.DataLoader(config['data'], batch_size=config['batch'])\n"
                f"    train(Net(), loader, config['epochs'] + {number}, SETTINGS['lr'] * value)\n"
                f"    return strategy, torch.optim.SGD(Net().parameters(), lr=scaled, momentum=0.9)\n"
            )
        (experiments / f"sweep_{index}.py").write_text("".join(lines))
    return app


def _apps(directory: Path, modules: int, functions: int) -> list[Path]:
    found = sorted(path for path in APPS.iterdir() if path.is_dir() and not path.name.startswith("_"))
    return found + [make_large_app(directory, modules, functions)]


def _read_seconds(app: Path) -> tuple[float, str]:
    """read_deployment alone, in this process: the part of the run this benchmark is about."""
    from rankaudit.deploy.app import Overrides, read_deployment
    from rankaudit.errors import RankauditError

    start, cpu = time.perf_counter(), time.process_time()
    try:
        read_deployment(app, Overrides(round={"local_samples": 32}, input_shape_given=True))
        outcome = "read"
    except RankauditError as error:
        outcome = f"refused: {str(error).splitlines()[0][:90]}"
    return time.perf_counter() - start, time.process_time() - cpu, outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=60, help="experiment modules in the generated large app")
    parser.add_argument("--functions", type=int, default=60, help="functions in each experiment module")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for app in _apps(Path(scratch), args.modules, args.functions):
            read, read_cpu, outcome = _read_seconds(app)
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            done = subprocess.run(
                [sys.executable, "-m", "rankaudit", str(app), "--format", "json", *_given(app)],
                capture_output=True,
                text=True,
                cwd=app,
            )
            total = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            lines = sum(len(path.read_text().splitlines()) for path in app.rglob("*.py"))
            rows.append(
                {
                    "app": app.name,
                    "lines": lines,
                    "read_s": round(read, 2),
                    "read_cpu_s": round(read_cpu, 2),
                    "run_s": round(total, 2),
                    "run_cpu_s": round(cpu, 2),
                }
            )
            rows[-1]["exit"] = done.returncode
            rows[-1]["outcome"] = outcome
            print(
                f"{app.name:22} {lines:7d} lines  read {read:6.2f} s (CPU {read_cpu:5.2f} s)  rankaudit {total:6.2f} s "
                f"(CPU {cpu:5.2f} s)  exit {done.returncode}  {outcome}",
                flush=True,
            )
    slowest = max(rows, key=lambda row: row["run_s"])
    print(
        f"slowest: {slowest['app']} {slowest['run_s']:.2f} s wall, {slowest['run_cpu_s']:.2f} s CPU "
        f"(target: under 20 s; load average {os.getloadavg()[0]:.1f})"
    )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
