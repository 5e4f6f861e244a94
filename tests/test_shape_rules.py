"""Each analytic shape rule gives what the real op gives on a real tensor, including rejecting bad inputs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.count import op_shapes, ops


def rule_for(target, kind):
    family = ops.family_of(kind, target)
    assert family.shape is not None, f"{target} has no shape rule"
    return family.shape


MODULE_CASES = [
    (nn.Conv2d(3, 8, 3), (1, 3, 17, 17)),
    (nn.Conv2d(3, 8, 4, stride=2, padding=2), (1, 3, 32, 32)),
    (nn.Conv2d(4, 8, 3, stride=3, padding=1, dilation=2, groups=2), (1, 4, 20, 23)),
    (nn.Conv2d(3, 6, 3, padding="same"), (1, 3, 9, 9)),
    (nn.Conv2d(3, 6, 3, padding="valid"), (1, 3, 9, 9)),
    (nn.Conv1d(2, 5, 5, stride=2, padding=1), (1, 2, 31)),
    (nn.Conv3d(2, 3, (1, 3, 3), stride=(1, 2, 2)), (1, 2, 4, 9, 9)),
    (nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1, output_padding=1), (1, 4, 7, 7)),
    (nn.ConvTranspose1d(3, 3, 3, stride=3, dilation=2), (1, 3, 5)),
    (nn.Linear(7, 3), (1, 7)),
    (nn.Linear(7, 3), (1, 5, 7)),
    (nn.MaxPool2d(3, stride=2, padding=1), (1, 2, 15, 15)),
    (nn.MaxPool2d(2, ceil_mode=True), (1, 2, 15, 15)),
    (nn.MaxPool2d(3, stride=2, ceil_mode=True, padding=1, dilation=2), (1, 2, 14, 14)),
    (nn.AvgPool2d(3, stride=2, ceil_mode=True), (1, 2, 14, 14)),
    (nn.AvgPool1d(4), (1, 3, 17)),
    (nn.AdaptiveAvgPool2d((3, None)), (1, 2, 11, 7)),
    (nn.AdaptiveMaxPool2d(1), (1, 2, 11, 7)),
    (nn.Upsample(scale_factor=2.5), (1, 2, 5, 7)),
    (nn.Upsample(size=(9, 4)), (1, 2, 5, 7)),
    (nn.PixelShuffle(2), (1, 8, 3, 5)),
    (nn.PixelUnshuffle(2), (1, 2, 6, 4)),
    (nn.BatchNorm2d(3), (1, 3, 4, 4)),
    (nn.LeakyReLU(), (1, 3, 4, 4)),
]


@pytest.mark.parametrize(
    "module, shape", MODULE_CASES, ids=lambda v: type(v).__name__ if isinstance(v, nn.Module) else str(v)
)
def test_module_rules_match_real_ops(module, shape):
    x = torch.randn(shape)
    expected = tuple(module.eval()(x).shape)
    assert rule_for(module, "module")(module, (x,), {}) == expected


FUNCTION_CASES = [
    (F.max_pool2d, (torch.randn(1, 2, 13, 13), 3), {"stride": 2, "ceil_mode": True}),
    (F.avg_pool2d, (torch.randn(1, 2, 13, 13), 2), {}),
    (F.max_pool1d, (torch.randn(1, 2, 13), 2, 2, 1), {}),
    (F.adaptive_avg_pool2d, (torch.randn(1, 2, 13, 9), 1), {}),
    (F.interpolate, (torch.randn(1, 2, 5, 5),), {"scale_factor": 2}),
    (F.conv2d, (torch.randn(1, 3, 9, 9), torch.randn(6, 3, 3, 3)), {"stride": 2, "padding": 1}),
    (F.linear, (torch.randn(2, 4), torch.randn(3, 4)), {}),
    (torch.cat, ([torch.randn(1, 2, 3), torch.randn(1, 5, 3)],), {"dim": 1}),
    (torch.cat, ([torch.randn(1, 2, 3), torch.randn(1, 2, 4)], -1), {}),
    (torch.add, (torch.randn(1, 3, 1, 5), torch.randn(4, 1)), {}),
    (torch.relu, (torch.randn(2, 3),), {}),
]


@pytest.mark.parametrize("function, args, kwargs", FUNCTION_CASES)
def test_function_rules_match_real_ops(function, args, kwargs):
    expected = tuple(function(*args, **kwargs).shape)
    assert rule_for(function, "function")(function, args, kwargs) == expected


def test_rules_reject_what_the_ops_reject():
    with pytest.raises(op_shapes.ShapeMismatch, match="3 input channels"):
        ops.family_of("module", nn.Conv2d(3, 4, 3)).shape(nn.Conv2d(3, 4, 3), (torch.randn(1, 2, 8, 8),), {})
    with pytest.raises(op_shapes.ShapeMismatch, match="larger than its padded input"):
        ops.family_of("module", nn.Conv2d(3, 4, 5)).shape(nn.Conv2d(3, 4, 5), (torch.randn(1, 3, 4, 4),), {})
    with pytest.raises(op_shapes.ShapeMismatch, match="7 input features"):
        ops.family_of("module", nn.Linear(7, 2)).shape(nn.Linear(7, 2), (torch.randn(1, 6),), {})


def test_rules_never_allocate():
    with torch.device("meta"):
        conv = nn.Conv2d(3, 8, 3)
        x = torch.empty(1, 3, 224, 224)
    assert ops.family_of("module", conv).shape(conv, (x,), {}) == (1, 8, 222, 222)


def _shapes(value):
    """A real output as the rules give it: a shape, or a tuple of them (None kept)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return tuple(_shapes(part) for part in value)


TORCH_NN_CASES = [  # modules whose output the counting does not model but whose shapes the trace needs
    (nn.LSTM(4, 6, batch_first=True), (torch.randn(2, 5, 4),), {}),
    (nn.LSTM(4, 6, num_layers=2, bidirectional=True), (torch.randn(5, 2, 4),), {}),
    (nn.LSTM(4, 6, proj_size=3, batch_first=True), (torch.randn(2, 5, 4),), {}),
    (nn.LSTM(4, 6), (torch.randn(5, 4),), {}),
    (nn.GRU(4, 6, num_layers=3, batch_first=True, bidirectional=True), (torch.randn(3, 7, 4),), {}),
    (nn.RNN(4, 6), (torch.randn(7, 3, 4),), {}),
    (nn.RNN(4, 6, batch_first=True), (torch.randn(7, 4),), {}),
    (nn.RNNCell(4, 3), (torch.randn(2, 4),), {}),
    (nn.LSTMCell(4, 3), (torch.randn(4),), {}),
    (nn.GRUCell(4, 3), (torch.randn(5, 4), torch.randn(5, 3)), {}),
    (nn.MultiheadAttention(8, 2, batch_first=True), (torch.randn(2, 5, 8),) * 3, {}),
    (nn.MultiheadAttention(8, 2), (torch.randn(5, 2, 8), torch.randn(7, 2, 8), torch.randn(7, 2, 8)), {}),
    (nn.MultiheadAttention(8, 2), (torch.randn(5, 8),) * 3, {"need_weights": False}),
    (nn.MultiheadAttention(8, 2, batch_first=True), (torch.randn(2, 5, 8),) * 3, {"average_attn_weights": False}),
    (nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), (torch.randn(2, 5, 8),), {}),
    (nn.TransformerDecoderLayer(8, 2, 16), (torch.randn(5, 2, 8), torch.randn(3, 2, 8)), {}),
    (nn.Bilinear(4, 5, 3), (torch.randn(2, 7, 4), torch.randn(2, 7, 5)), {}),
    (nn.Unfold(3, dilation=2, padding=1, stride=2), (torch.randn(2, 3, 11, 9),), {}),
    (nn.LPPool2d(2, 3, stride=2, ceil_mode=True), (torch.randn(1, 2, 12, 12),), {}),
    (nn.LPPool1d(3, 2), (torch.randn(1, 2, 9),), {}),
]


@pytest.mark.parametrize("module, args, kwargs", TORCH_NN_CASES, ids=lambda v: type(v).__name__)
def test_rules_of_modules_with_tuple_outputs_match_real_ops(module, args, kwargs):
    with torch.no_grad():
        expected = _shapes(module.eval()(*args, **kwargs))
    assert rule_for(module, "module")(module, args, kwargs) == expected


MORE_FUNCTION_CASES = [
    (F.unfold, (torch.randn(2, 3, 10, 10), 3), {"padding": 1, "stride": 2}),
    (F.unfold, (torch.randn(3, 8, 8), (2, 3)), {"dilation": 2}),
    (torch.addmm, (torch.randn(5), torch.randn(3, 4), torch.randn(4, 5)), {}),
    (F.lp_pool2d, (torch.randn(1, 2, 9, 9), 2, 3), {"stride": 2}),
    (torch.matmul, (torch.randn(4, 27), torch.randn(2, 27, 36)), {}),
    (torch.matmul, (torch.randn(3, 1, 4, 5), torch.randn(2, 5, 6)), {}),
    (torch.matmul, (torch.randn(5), torch.randn(2, 5, 6)), {}),
    (torch.matmul, (torch.randn(2, 3, 5), torch.randn(5)), {}),
    (torch.matmul, (torch.randn(5), torch.randn(5)), {}),
    (torch.bmm, (torch.randn(2, 3, 5), torch.randn(2, 5, 4)), {}),
]


@pytest.mark.parametrize("function, args, kwargs", MORE_FUNCTION_CASES)
def test_more_function_rules_match_real_ops(function, args, kwargs):
    expected = tuple(function(*args, **kwargs).shape)
    assert rule_for(function, "function")(function, args, kwargs) == expected


def test_matmul_leaves_einsum_and_mismatches_to_the_op():
    rule = rule_for(torch.matmul, "function")
    assert rule(torch.einsum, ("ij,jk->ik", torch.randn(2, 3), torch.randn(3, 4)), {}) is None
    assert rule(torch.matmul, (torch.randn(2, 3), torch.randn(4, 5)), {}) is None


SHORTCUT_CASES = [  # what weight_norm and spectral_norm compute, answered from shapes on meta
    (torch.norm_except_dim, (torch.randn(4, 3, 3, 3), 2, 0), {}),
    (torch.norm_except_dim, (torch.randn(4, 3, 3, 3), 2, 2), {}),
    (torch.norm_except_dim, (torch.randn(4, 3), 2, -1), {}),
    (torch._weight_norm, (torch.randn(4, 3, 2), torch.randn(4, 1, 1), 0), {}),
    (F.normalize, (torch.randn(6, 3),), {"dim": 0}),
    (torch.mv, (torch.randn(4, 27), torch.randn(27)), {}),
    (torch.vdot, (torch.randn(4), torch.randn(4)), {}),
    (torch.div, (torch.randn(4, 3, 3, 3), torch.randn(())), {}),
    (torch.Tensor.__rtruediv__, (torch.randn(4, 1), 2.0), {}),
    (torch.mul, (torch.randn(4, 1), torch.randn(1, 5, dtype=torch.float64)), {}),
]


@pytest.mark.parametrize("function, args, kwargs", SHORTCUT_CASES)
def test_meta_shortcuts_match_real_ops(function, args, kwargs):
    from rankaudit.model.meta_device import meta_shortcut

    expected = function(*args, **kwargs)
    on_meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    answer = meta_shortcut(function, on_meta, kwargs)
    assert answer is not None and answer.is_meta
    assert (tuple(answer.shape), answer.dtype) == (tuple(expected.shape), expected.dtype)
    assert meta_shortcut(function, args, kwargs) is None  # real tensors run the op


def test_the_slow_spellings_never_import_the_compiler(tmp_path):
    """What made weight_norm, LSTMs, attention, checkpointing and the rest take seconds: a meta kernel importing
    torch._dynamo. Each model of benchmarks/bench_spellings.py analyses in one fresh process without it."""
    import subprocess
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        from bench_spellings import HEAD, MODELS
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    # The TorchScript spellings compile in the model file itself (torch.jit.trace imports sympy); an orthogonal
    # parametrization's meta build is tried once and, where torch cannot run it without weights, built small on the
    # CPU, which imports the compiler (seconds, said in docs/benchmarks.md).
    compiled = {"jit_script", "jit_trace", "orthogonal"}
    paths = []
    for name, (_, body) in MODELS.items():
        if name in compiled:
            continue
        path = tmp_path / f"{name}.py"
        path.write_text(HEAD + body)
        paths.append(str(path))
    probe = (
        "import sys\nfrom rankaudit.audit import audit\n"
        "for path in sys.argv[1:]:\n    audit(path)\n"
        "print(sorted(name for name in ('torch._dynamo', 'sympy') if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe, *paths], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
