"""The analysis never allocates real weights; functional forms, dense layers and not-modelled ops count as the spec says."""

import json
import subprocess
import sys
import textwrap

import torch
import torch.nn.functional as F
from conftest import EXAMPLES, REPO, analyse_module, row
from torch import nn

from rankaudit.model.load import load_model

TEN_BILLION = """
import torch.nn as nn
INPUT_SHAPE = (1024,)
class Huge(nn.Module):
    # 1024 -> 50000 -> 50000 x 3 -> 10: about 10.1e9 parameters, 40 GB of float32 if ever allocated.
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(1024, 50000)
        self.hidden = nn.Sequential(*[nn.Sequential(nn.Linear(50000, 50000), nn.ReLU()) for _ in range(4)])
        self.out = nn.Linear(50000, 10)
    def forward(self, x):
        return self.out(self.hidden(self.inp(x)))
"""


def test_models_are_built_on_meta():
    loaded = load_model(str(EXAMPLES / "resnet18_w16.py"))
    assert all(p.is_meta for p in loaded.module.parameters())
    assert loaded.input_shape == (3, 32, 32) and loaded.name == "ResNet18W16"


def test_ten_billion_parameters_analysed_within_1_5_gb(tmp_path):
    path = tmp_path / "huge.py"
    path.write_text(textwrap.dedent(TEN_BILLION))
    # VmHWM (this process image's own peak), not ru_maxrss, which Linux carries over from the parent at exec.
    probe = (
        "import json, re, sys\nfrom rankaudit.cli import main\n"
        "try:\n    main([sys.argv[1], '--format', 'json', '-o', sys.argv[2]])\nexcept SystemExit as e:\n"
        "    code = e.code\npeak = re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read())\n"
        "print(json.dumps({'code': code, 'max_rss_kib': int(peak.group(1))}))\n"
    )
    report = tmp_path / "huge.json"
    done = subprocess.run(
        [sys.executable, "-c", probe, str(path), str(report)], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    payload = json.loads(report.read_text())
    assert payload["parameters"] > 10_000_000_000
    assert measured["max_rss_kib"] < 1.5 * 1024 * 1024  # KiB on Linux: under 1.5 GB
    assert [r["weights"] for r in payload["layers"]][:2] == [1024 * 50000 + 50000, 50000 * 50000 + 50000]


class Functional(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3, 3, 3))
        self.fc_weight = nn.Parameter(torch.empty(1, 4 * 3 * 3))

    def forward(self, x):
        x = F.max_pool2d(F.leaky_relu(F.conv2d(x, self.weight, stride=2)), 2)
        return F.linear(x.flatten(1), self.fc_weight)


class Modules(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, bias=False)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(36, 1, bias=False)

    def forward(self, x):
        return self.fc(self.pool(F.leaky_relu(self.conv(x))).flatten(1))


def test_functional_forms_count_like_modules():
    functional = analyse_module(Functional, (3, 13, 13))
    modules = analyse_module(Modules, (3, 13, 13))
    strip = lambda r: [(x.inputs, x.weights, x.outputs, x.virtual, x.ra_i, x.dense) for x in r.layers]  # noqa: E731
    assert strip(functional) == strip(modules)
    assert [x.op for x in functional.layers] == ["conv2d", "max_pool2d", "linear"]


def test_frozen_parameters_are_not_gradient_constraints():
    def build():
        model = Modules()
        model.conv.weight.requires_grad_(False)
        return model

    result = analyse_module(build, (3, 13, 13))
    assert row(result, "conv").weights == 0 and row(result, "conv").frozen_params == 108
    assert any(c.code == "RA105" and c.node == "conv" for c in result.caveats)


def test_conv_covering_its_input_is_dense_and_never_critical():
    build = lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, bias=False), nn.Conv2d(3, 5, 6))  # noqa: E731
    result = analyse_module(build, (2, 6, 6))
    first, head = result.layers
    assert head.dense and not first.dense and result.critical_layer == "0"
    # The same conv with a 7x7 input does not cover it (1 output position is impossible; 2x2 here): ordinary.
    assert not analyse_module(build, (2, 7, 7)).layers[1].dense
    # With a batch wider than its 5 output channels it is ordinary too (method.md: counting).
    assert not analyse_module(build, (2, 6, 6), batch_size=6).layers[1].dense


def test_linear_over_a_sequence_shares_weights():
    build = lambda: nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Flatten(), nn.Linear(40, 1))  # noqa: E731
    tokens, head = analyse_module(build, (10, 8)).layers
    assert not tokens.dense and (tokens.inputs, tokens.weights, tokens.outputs) == (80, 36, 40)
    assert tokens.critical and tokens.ra_i == 80 - 36 - 40
    assert head.dense


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
        self.gate = nn.Linear(8, 8)
        self.fc = nn.Linear(8 * 6, 1)

    def forward(self, x):
        x = self.norm(x)
        scores = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2), dim=-1)
        mixed = scores @ x
        gated = F.gelu(mixed) * torch.sigmoid(self.gate(x))
        return self.fc(gated.flatten(1))


def test_not_modelled_ops_are_caveats_never_silent():
    result = analyse_module(Attention, (6, 8))
    flagged = {c.op for c in result.caveats if c.code == "RA101"}
    assert {"LayerNorm", "softmax", "matmul", "gelu", "mul"} <= flagged
    layernorm = next(c for c in result.caveats if c.op == "LayerNorm")
    assert "16 parameters are not counted" in layernorm.message and "transparent" in layernorm.message
    scores = next(c for c in result.caveats if c.op == "matmul" and c.node == "matmul")
    assert "parameter-free layer" in scores.message  # 6x8 @ 8x6 -> 6x6: the size changes
    assert row(result, "matmul").weights == 0


def test_relu_note_once_per_model():
    result = analyse_module(
        lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)), (4,)
    )
    notes = [c for c in result.caveats if c.code == "RA102"]
    assert len(notes) == 1 and "upper bound" in notes[0].message
    smooth = analyse_module(lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)), (4,))
    assert not [c for c in smooth.caveats if c.code == "RA102"]


def test_module_called_twice_is_flagged():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3, padding=1)

        def forward(self, x):
            return self.conv(torch.tanh(self.conv(x)))

    result = analyse_module(Twice, (2, 5, 5))
    assert [r.name for r in result.layers] == ["conv", "conv#2"]
    assert [c.code for c in result.caveats if c.code == "RA104"] == ["RA104"]


def test_layer_rows_carry_their_source_line():
    result = analyse_module(Modules, (3, 13, 13))
    assert row(result, "fc").source.endswith(f"test_meta_and_ops.py:{Modules.forward.__code__.co_firstlineno + 1}")


INIT_HEAVY = """
import torch.nn as nn
INPUT_SHAPE = (3, 16, 16)
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8 * 14 * 14, 10)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.Linear):
                nn.init.trunc_normal_(module.weight, std=0.02)
    def forward(self, x):
        return self.fc(self.bn(self.conv(x)).flatten(1))
"""


def test_initialisers_are_skipped_on_meta_but_not_on_real_devices(tmp_path):
    """torch's first normal_ on meta imports torch._dynamo (seconds); building on meta must not pay for it."""
    path = tmp_path / "init_heavy.py"
    path.write_text(textwrap.dedent(INIT_HEAVY))
    probe = (
        "import sys\nfrom rankaudit.audit import audit\nfrom rankaudit.model.load import load_model\n"
        "r = audit(sys.argv[1])\nassert [l.name for l in r.layers] == ['conv', 'fc'], r.layers\n"
        "print('dynamo' if 'torch._dynamo' in sys.modules else 'no-dynamo')\n"
        "real = load_model(sys.argv[1], device='cpu').module\n"
        "print(float(real.conv.weight.std()) > 0.05, 0.015 < float(real.fc.weight.std()) < 0.025)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["no-dynamo", "True", "True"]
