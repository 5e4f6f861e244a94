#!/usr/bin/env python3
"""Benchmark: the static path on the spellings that used to take seconds, against a plain model of the same size.

    python benchmarks/bench_spellings.py [--repeat 5] [--out spellings.json]

Each model is a small net (a 3x8x8 image or 8 steps of 8 features) written in one spelling: weight_norm,
spectral_norm, orthogonal (built on the CPU), a torch.jit.script-ed and a torch.jit.trace-d layer, functional_call,
addmm, unfold + matmul, checkpointing, LPPool, RNN, LSTM, GRU, a TransformerEncoderLayer, MultiheadAttention,
Bilinear. Beside each, the plain model of its input kind (a conv and a
linear head, or two linear layers). Every run is a fresh ``python -m rankaudit MODEL --format json`` process, the
spellings and the plain models interleaved on every repeat so that drifting load hits both alike; one untimed
warm-up run first.

Reported per spelling: the median of the JSON's ``seconds`` (building, tracing, counting and the bound: the static
path itself, without interpreter start-up), its ratio to the plain model's median, and the median wall time of the
process. Target: every ratio <= 3. This is a benchmark, not a test: it exits 0 whatever it measures, printing FAIL
beside a ratio over the target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEAD = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
TARGET_RATIO = 3.0

# name -> (the plain model it is compared with, the model file's body)
MODELS = {
    "plain": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
""",
    ),
    "plain_seq": (
        "plain_seq",
        """
INPUT_SHAPE = (8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.fc = nn.Linear(64, 4)
    def forward(self, x):
        return self.fc(torch.tanh(self.a(x)).flatten(1))
""",
    ),
    "weight_norm": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

from torch.nn.utils.parametrizations import weight_norm
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = weight_norm(nn.Conv2d(3, 4, 3))
        self.fc = nn.Linear(4 * 6 * 6, 10)
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
""",
    ),
    "spectral_norm": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

from torch.nn.utils.parametrizations import spectral_norm
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = spectral_norm(nn.Conv2d(3, 4, 3))
        self.fc = nn.Linear(4 * 6 * 6, 10)
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
""",
    ),
    "orthogonal": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

from torch.nn.utils.parametrizations import orthogonal
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = orthogonal(nn.Linear(4 * 6 * 6, 10))
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
""",
    ),
    "jit_script": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = torch.jit.script(nn.Linear(4 * 6 * 6, 10))
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
""",
    ),
    "jit_trace": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.jit.trace(nn.Conv2d(3, 4, 3), torch.rand(1, 3, 8, 8))
        self.fc = nn.Linear(4 * 6 * 6, 10)
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).flatten(1))
""",
    ),
    "functional_call": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

from torch.func import functional_call
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)
    def forward(self, x):
        h = functional_call(self.conv, dict(self.conv.named_parameters()), (x,))
        return self.fc(torch.relu(h).flatten(1))
""",
    ),
    "addmm": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(192, 16) * 0.1)
        self.b = nn.Parameter(torch.zeros(16))
        self.fc = nn.Linear(16, 10)
    def forward(self, x):
        return self.fc(torch.relu(torch.addmm(self.b, x.flatten(1), self.w)))
""",
    ),
    "unfold": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 27) * 0.1)
        self.fc = nn.Linear(4 * 36, 10)
    def forward(self, x):
        cols = F.unfold(x, 3)
        return self.fc(torch.relu(self.w @ cols).flatten(1))
""",
    ),
    "checkpoint": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

from torch.utils.checkpoint import checkpoint
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4 * 6 * 6, 10)
    def forward(self, x):
        h = checkpoint(self.conv, x, use_reentrant=False)
        return self.fc(torch.relu(h).flatten(1))
""",
    ),
    "lppool": (
        "plain",
        """
INPUT_SHAPE = (3, 8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.pool = nn.LPPool2d(2, 2)
        self.fc = nn.Linear(4 * 3 * 3, 10)
    def forward(self, x):
        return self.fc(self.pool(self.conv(x)).flatten(1))
""",
    ),
    "rnn": (
        "plain_seq",
        """
INPUT_SHAPE = (8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.RNN(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)
    def forward(self, x):
        out, h = self.rnn(x)
        return self.fc(out[:, -1])
""",
    ),
    "lstm": (
        "plain_seq",
        """
INPUT_SHAPE = (8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)
    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])
""",
    ),
    "gru": (
        "plain_seq",
        """
INPUT_SHAPE = (8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 4)
    def forward(self, x):
        out, _ = self.rnn(x)
        return self.fc(out[:, -1])
""",
    ),
    "transformer_layer": (
        "plain_seq",
        """
INPUT_SHAPE = (8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.fc = nn.Linear(64, 4)
    def forward(self, x):
        return self.fc(self.layer(x).flatten(1))
""",
    ),
    "mha": (
        "plain_seq",
        """
INPUT_SHAPE = (8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(64, 4)
    def forward(self, x):
        out, _ = self.attn(x, x, x)
        return self.fc(out.flatten(1))
""",
    ),
    "bilinear": (
        "plain_seq",
        """
INPUT_SHAPE = (8, 8)

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.bi = nn.Bilinear(8, 8, 4)
        self.fc = nn.Linear(32, 4)
    def forward(self, x):
        return self.fc(self.bi(x, x).flatten(1))
""",
    ),
}


def run(path: Path, out: Path) -> tuple[float, float]:
    """(JSON seconds, wall seconds) of one fresh rankaudit process."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "rankaudit", str(path), "--format", "json", "-o", str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    wall = time.perf_counter() - started
    if done.returncode not in (0, 1):
        raise RuntimeError(f"{path.name}: exit {done.returncode}: {done.stderr.strip()}")
    return json.loads(out.read_text())["seconds"], wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    options = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rankaudit-bench-spellings-"))
    paths = {}
    for name, (_, body) in MODELS.items():
        paths[name] = folder / f"{name}.py"
        paths[name].write_text(HEAD + body)
    out = folder / "report.json"
    for name in ("plain", "plain_seq"):
        run(paths[name], out)  # warm-up: the first process after a while reads torch from disk
    seconds: dict[str, list[float]] = {name: [] for name in MODELS}
    walls: dict[str, list[float]] = {name: [] for name in MODELS}
    for repeat in range(options.repeat):
        names = list(MODELS) if repeat % 2 == 0 else list(reversed(MODELS))
        for name in names:
            analysed, wall = run(paths[name], out)
            seconds[name].append(analysed)
            walls[name].append(wall)
    load = [round(x, 2) for x in os.getloadavg()]
    rows = []
    print(f"{'spelling':<18} {'seconds':>8} {'plain':>8} {'ratio':>6} {'wall':>7}  target ratio <= {TARGET_RATIO:g}")
    for name, (plain, _) in MODELS.items():
        if name == plain:
            continue
        median, reference = statistics.median(seconds[name]), statistics.median(seconds[plain])
        ratio = median / reference
        rows.append(
            {
                "spelling": name,
                "plain": plain,
                "seconds": median,
                "plain_seconds": reference,
                "ratio": ratio,
                "wall": statistics.median(walls[name]),
            }
        )
        verdict = "pass" if ratio <= TARGET_RATIO else "FAIL"
        print(
            f"{name:<18} {median:8.3f} {reference:8.3f} {ratio:6.2f} {statistics.median(walls[name]):7.2f}  {verdict}"
        )
    print(f"load average at the end: {load}; repeats: {options.repeat}")
    if options.out is not None:
        options.out.write_text(json.dumps({"rows": rows, "load": load, "repeat": options.repeat}, indent=2))


if __name__ == "__main__":
    main()
