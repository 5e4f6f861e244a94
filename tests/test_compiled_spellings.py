"""Spellings the tracer cannot read inside: a TorchScript submodule (torch.jit.script, torch.jit.trace) and a weight
parametrization (orthogonal, weight_norm, spectral_norm). Each model is analysed the way the CLI does (its file
loaded on the meta device), and its bound is held against the exact rank of ∂g/∂x computed here from real float64
tensors with torch.func.jacrev, independently of rankaudit's own rank check (method.md: the bound against the
numerical check)."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, jacrev

from rankaudit.audit import audit

HEAD = "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\nINPUT_SHAPE = (3, 8, 8)\n\n"

# A scripted head behind a pooled convolution: counted as parameter-free, its 440 parameters went missing from the
# cut (bound 56 where the rank is 88).
SCRIPTED_HEAD = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3, padding=1)
        head = nn.Sequential(nn.Flatten(), nn.Linear(2 * 4 * 4, 10), nn.Tanh(), nn.Linear(10, 10))
        self.head = torch.jit.script(head)

    def forward(self, x):
        return self.head(F.avg_pool2d(torch.tanh(self.conv(x)), 2))
"""

# A traced stem: its 112 convolution weights see every input direction, yet counted as parameter-free the bound
# was the 16 values after the pooling (the rank is 128).
TRACED_STEM = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Tanh())
        self.stem = torch.jit.trace(stem, torch.rand(1, 3, 8, 8))
        self.head = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        return self.head(F.avg_pool2d(self.stem(x), 4).flatten(1))
"""


def _write(tmp_path, name: str, body: str):
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + textwrap.dedent(body), encoding="utf-8")
    return path


def _real_model(path, seed: int = 0, name: str = "Net") -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(seed)
    return getattr(module, name)().double()


def exact_rank(model: torch.nn.Module, shape=(3, 8, 8), seed: int = 0) -> tuple[int, float]:
    """rank of ∂g/∂x for one sample: the Jacobian of the flattened gradient of the cross-entropy (every trainable
    parameter) with respect to the input, by torch.func.jacrev in float64; the numerical rank counts singular
    values above σ_max · max(m, n) · eps. Returns the rank and the gap σ_r / σ_(r+1) around it."""
    if isinstance(model, torch.jit.ScriptModule):
        model = torch.nn.Sequential(model)  # functional_call takes a compiled submodule, not a compiled root
    parameters = {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}
    x = torch.rand((1, *shape), generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    label = torch.tensor([1])

    def flat_gradient(inputs):
        gradients = grad(lambda values: F.cross_entropy(functional_call(model, values, (inputs,)), label))(parameters)
        return torch.cat([g.reshape(-1) for g in gradients.values()])

    jacobian = jacrev(flat_gradient)(x).reshape(-1, x.numel())
    singular = torch.linalg.svdvals(jacobian)
    tolerance = singular[0] * max(jacobian.shape) * torch.finfo(torch.float64).eps
    rank = int((singular > tolerance).sum())
    following = singular[rank] if rank < len(singular) else tolerance
    return rank, float(singular[rank - 1] / max(following, tolerance))


def _per_sample_bound(result) -> int:
    bound = result.identifiability
    return bound.sample.rank_bound if bound.sample is not None else bound.rank_bound


@pytest.mark.parametrize(
    ("name", "body", "layer", "parameters"),
    [("scripted_head", SCRIPTED_HEAD, "head", 440), ("traced_stem", TRACED_STEM, "stem", 112)],
    ids=["scripted_head", "traced_stem"],
)
def test_a_torchscript_module_is_counted_with_its_parameters(tmp_path, name, body, layer, parameters):
    path = _write(tmp_path, name, body)
    result = audit(str(path))
    rank, gap = exact_rank(_real_model(path))
    assert gap > 1e6, f"{name}: the exact rank {rank} is not clear-cut (gap {gap:.3g})"
    assert _per_sample_bound(result) >= rank, f"{name}: bound {_per_sample_bound(result)} < exact rank {rank}"
    assert result.parameters == sum(p.numel() for p in _real_model(path).parameters())
    caveat = next(c for c in result.caveats if c.node == layer)
    assert "compiled" in caveat.message and f"its {parameters} parameters" in caveat.message, caveat.message
    assert [r.op for r in result.layers if r.name == layer] == ["Sequential (TorchScript)"]


def test_a_model_compiled_as_a_whole_is_one_call_of_unknown_structure(tmp_path):
    """torch.jit.script of the whole model: no tracer enters it; it is analysed as one call whose parameters every
    input direction may reach, not refused with a hint about control flow."""
    path = _write(tmp_path, "compiled", SCRIPTED_HEAD + "\n\ndef compiled():\n    return torch.jit.script(Net())\n")
    result = audit(f"{path}:compiled")
    rank, gap = exact_rank(_real_model(path, name="compiled"))
    assert gap > 1e6 and _per_sample_bound(result) >= rank, (_per_sample_bound(result), rank, gap)
    assert [r.op for r in result.layers] == ["Net (TorchScript)"]


def test_the_rank_check_of_a_traced_stem_agrees_with_the_exact_rank(tmp_path, run_cli):
    """--verify rank builds the model with real weights and measures it: the per-sample rank it reports is the exact
    one, and it sits under the bound (the check raises an internal error when a measured rank exceeds it)."""
    path = _write(tmp_path, "traced_stem", TRACED_STEM)
    report = tmp_path / "report.json"
    code, _, err = run_cli(path, "--verify", "rank", "--samples", "1", "--format", "json", "-o", report, "--quiet")
    assert code in (0, 1), err
    payload = json.loads(report.read_text(encoding="utf-8"))
    measured = payload["verification"]["rank"]["rank"]
    rank, _ = exact_rank(_real_model(path))
    assert measured == rank
    assert payload["identifiability"]["rank_bound"] >= measured


PARAMETRIZED = """
from torch.nn.utils import parametrizations


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 1, 3, padding=1)
        self.fc = parametrizations.{kind}(nn.Linear(16, 12))
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        h = F.avg_pool2d(torch.tanh(self.conv(x)), 2).flatten(1)
        return self.head(torch.tanh(self.fc(h)))
"""


@pytest.mark.parametrize("kind", ["orthogonal", "weight_norm", "spectral_norm"])
def test_a_parametrized_linear_is_a_linear_whose_gradient_is_its_originals(tmp_path, kind):
    """orthogonal() tests its weight for orthogonality while it builds, which the meta device cannot answer: the
    model is built on the CPU instead and analysed, not refused. The layer's shared gradient is that of the
    parameters the client trains (orthogonal's and spectral_norm's `original`, weight_norm's g and v), each a
    fixed linear image of the weight's own gradient."""
    path = _write(tmp_path, kind, PARAMETRIZED.format(kind=kind))
    result = audit(str(path))
    model = _real_model(path)
    rank, gap = exact_rank(model)
    assert gap > 1e6, f"{kind}: the exact rank {rank} is not clear-cut (gap {gap:.3g})"
    assert _per_sample_bound(result) >= rank, f"{kind}: bound {_per_sample_bound(result)} < exact rank {rank}"
    trained = sum(p.numel() for name, p in model.named_parameters() if name.startswith("fc."))
    assert [r.weights for r in result.layers if r.name == "fc"] == [trained]


def test_weights_saved_from_a_compiled_model_load_into_it():
    """--weights of a model compiled as a whole: its state dict names the compiled model's own parameters."""
    from rankaudit.model.load import CompiledModel
    from rankaudit.verify.model import load_weights

    saved = torch.jit.script(torch.nn.Linear(3, 2))
    model = CompiledModel(torch.jit.script(torch.nn.Linear(3, 2)))
    load_weights(model, saved.state_dict(), "weights.pt")
    assert torch.equal(model.model.weight, saved.weight) and torch.equal(model.model.bias, saved.bias)


TRACED_WITH_A_CONSTANT = """
class Stem(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        {keep}

    def forward(self, x):
        return torch.tanh(self.conv(x * {scale}))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = torch.jit.trace(Stem(), torch.rand(1, 3, 8, 8))
        self.head = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        return self.head(F.avg_pool2d(self.stem(x), 4).flatten(1))
"""


def test_a_traced_module_holding_a_cpu_tensor_is_refused_with_its_cause(tmp_path, run_cli):
    """torch.jit.trace bakes a tensor made in forward() into the compiled code, on the CPU: the module cannot run on
    the meta device. The error says so and how to fix it, and the fix it names analyses."""
    made = "torch.linspace(0.5, 1.5, 3).view(1, 3, 1, 1)"
    path = _write(tmp_path, "baked", TRACED_WITH_A_CONSTANT.format(keep="", scale=made))
    code, out, err = run_cli(f"{path}:Net")
    assert code == 3 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "TorchScript module stem could not run without weights" in err and "baked.py:" in err
    assert "register the tensors its code makes as buffers" in err and "input shape" not in err
    buffered = TRACED_WITH_A_CONSTANT.format(keep=f'self.register_buffer("scale", {made})', scale="self.scale")
    path = _write(tmp_path, "buffered", buffered)
    rank, _ = exact_rank(_real_model(path))
    assert _per_sample_bound(audit(f"{path}:Net")) >= rank
