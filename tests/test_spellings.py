"""The bound holds for every spelling of the same maths: for each way a model used to escape the count, two
spellings of one function get the same per-sample bound, and that bound is at least the rank of ∂g/∂x measured
on real float64 tensors (method.md: the bound against method.md: numerical check)."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import REPO, Lambda
from torch import nn

sys.path.insert(0, str(REPO / "benchmarks"))
from metamorphic import measured_rank, static_bound  # noqa: E402


class Shifted(nn.Module):
    """x + b (b trainable, ~2: positive for x in [0, 1]), then `body`, then a small linear head. The shift's
    gradient is δ itself: it sees the input only through the backward pass, so an op whose Jacobian depends on
    its input but is counted as constant drops the rank there."""

    def __init__(self, shape, body, features, classes=2):
        super().__init__()
        self.b = nn.Parameter(2.0 + 0.1 * torch.randn(shape))
        self.body = body
        self.head = nn.Linear(features, classes)

    def forward(self, x):
        return self.head(self.body(x + self.b).flatten(1))


# ---- a parameter transformed in forward() ------------------------------------------------------------------------


class HandLinear(nn.Module):
    """4 outputs from a 3x8x8 input, the weight used as written by `spelling`."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.w = nn.Parameter(0.1 * torch.randn(4, 192))
        self.A = nn.Parameter(0.1 * torch.randn(192, 4))
        self.B = nn.Parameter(0.1 * torch.randn(4, 4))

    def forward(self, x):
        x = x.flatten(1)
        if self.spelling == "bare":
            return F.linear(x, self.w)
        if self.spelling == "times_one":
            return F.linear(x, self.w * 1.0)
        if self.spelling == "transposed":
            return x @ self.w.t()
        if self.spelling == "chained":  # LoRA written as two products
            return (x @ self.A) @ self.B
        return x @ (self.A @ self.B)  # LoRA with the factors composed first


class HandConv(nn.Module):
    """A 3x3 convolution of a 3x8x8 input to 4 channels, then a linear head; the weight as `spelling` writes it."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.w = nn.Parameter(0.1 * torch.randn(4, 3, 3, 3))
        self.register_buffer("mask", torch.ones(4, 3, 3, 3))
        self.head = nn.Linear(4 * 36, 3)

    def forward(self, x):
        weight = {"bare": self.w, "scaled": self.w * 0.5, "masked": self.w * self.mask}[self.spelling]
        return self.head(F.relu(F.conv2d(x, weight)).flatten(1))


class HandEinsum(nn.Module):
    """Per-channel projections of a 3x8x8 input: a 3-D weight in einsum, or the same weight reshaped for a matmul."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.w = nn.Parameter(0.1 * torch.randn(3, 64, 2))

    def forward(self, x):
        if self.spelling == "einsum":
            return torch.einsum("bcn,cnk->bk", x.flatten(2), self.w)
        return x.flatten(1) @ self.w.reshape(192, 2)


# ---- modules the registry does not know ------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, need_weights):
        super().__init__()
        self.need_weights = need_weights
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        tokens = x.squeeze(1)
        return self.head(self.attention(tokens, tokens, tokens, need_weights=self.need_weights)[0].flatten(1))


class Recurrent(nn.Module):
    def __init__(self, kind, spelling):
        super().__init__()
        self.spelling = kind, spelling
        self.rnn = (nn.GRU if kind == "gru" else nn.LSTM)(8, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        output, state = self.rnn(x.squeeze(1))
        hidden = state[0] if isinstance(state, tuple) else state
        return self.head(output[:, -1] if self.spelling[1] == "last_output" else hidden[0])


class Pairwise(nn.Module):
    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.bilinear = nn.Bilinear(32, 32, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = x.flatten(1)
        left, right = x[:, :32], x[:, 32:]
        if self.spelling == "module":
            return self.head(self.bilinear(left, right))
        return self.head(torch.einsum("bi,oij,bj->bo", left, self.bilinear.weight, right) + self.bilinear.bias)


def _l2_pool(spelling):
    if spelling == "module":
        return nn.LPPool2d(2, 2)
    if spelling == "functional":
        return Lambda(lambda h: F.lp_pool2d(h, 2, 2))
    return Lambda(lambda h: (F.avg_pool2d(h * h, 2) * 4.0).sqrt())


def _reciprocal(spelling):
    function = {
        "reciprocal": torch.reciprocal,
        "one_over": lambda h: 1.0 / h,
        "divided_ones": lambda h: torch.div(torch.ones_like(h), h),
    }[spelling]
    return nn.Sequential(Lambda(function), nn.AvgPool2d(4))


def _square(spelling):
    function = {"power": lambda h: h**2, "self_product": lambda h: h * h, "torch_mul": lambda h: torch.mul(h, h)}
    return nn.Sequential(Lambda(function[spelling]), nn.AvgPool2d(4))


CAUSES = {
    "a weight multiplied by one": ((3, 8, 8), lambda s: HandLinear(s), ("bare", "times_one")),
    "a weight transposed (a hand-written or tied linear head)": ((3, 8, 8), HandLinear, ("bare", "transposed")),
    "low-rank factors composed in forward": ((3, 8, 8), HandLinear, ("chained", "composed")),
    "a convolution weight scaled (equalised learning rate)": ((3, 8, 8), HandConv, ("bare", "scaled")),
    "a convolution weight masked": ((3, 8, 8), HandConv, ("bare", "masked")),
    "a 3-D weight in einsum": ((3, 8, 8), HandEinsum, ("matmul", "einsum")),
    "nn.MultiheadAttention returning its weights": ((1, 8, 8), Attention, (False, True)),
    "nn.GRU": ((1, 8, 8), lambda s: Recurrent("gru", s), ("last_output", "hidden_state")),
    "nn.LSTM": ((1, 8, 8), lambda s: Recurrent("lstm", s), ("last_output", "hidden_state")),
    "nn.Bilinear": ((1, 8, 8), Pairwise, ("einsum", "module")),
    "nn.LPPool2d": ((1, 8, 8), lambda s: Shifted((1, 8, 8), _l2_pool(s), 16), ("by_hand", "module")),
    "F.lp_pool2d": ((1, 8, 8), lambda s: Shifted((1, 8, 8), _l2_pool(s), 16), ("by_hand", "functional")),
    "1 / x": ((1, 8, 8), lambda s: Shifted((1, 8, 8), _reciprocal(s), 4), ("reciprocal", "one_over")),
    "torch.div(ones, x)": ((1, 8, 8), lambda s: Shifted((1, 8, 8), _reciprocal(s), 4), ("reciprocal", "divided_ones")),
    "s * s": ((1, 8, 8), lambda s: Shifted((1, 8, 8), _square(s), 4), ("power", "self_product")),
    "torch.mul(s, s)": ((1, 8, 8), lambda s: Shifted((1, 8, 8), _square(s), 4), ("power", "torch_mul")),
}


@pytest.mark.parametrize("cause", list(CAUSES))
def test_two_spellings_get_one_sound_bound(cause):
    shape, build, (reference, rewritten) = CAUSES[cause]
    bounds, ranks = {}, {}
    for spelling in (reference, rewritten):
        make = functools.partial(build, spelling)
        bounds[spelling], unknowns = static_bound(make, shape)
        measured = measured_rank(make, shape)
        assert measured.reliable, (cause, spelling, measured.gap)
        ranks[spelling] = measured.rank
    assert bounds[reference] == bounds[rewritten], f"{cause}: bound {bounds} differs between the spellings"
    for spelling in (reference, rewritten):
        assert bounds[spelling] >= ranks[spelling], (
            f"{cause} ({spelling}): static per-sample bound {bounds[spelling]} < measured rank {ranks[spelling]}"
            f" of {unknowns}"
        )


def test_a_tied_weight_is_one_gradient():
    """x @ emb.weight.t() after an embedding-like use of the same weight: one gradient vertex, not two."""
    from rankaudit.bound.identifiability import FlowNetwork, shared_predicate
    from rankaudit.count.calls import trace_and_count

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(64, 8, bias=False)

        def forward(self, x):
            hidden = self.proj(x.flatten(1))
            return hidden @ self.proj.weight  # the same weight, read back (a tied decoder)

    with torch.device("meta"):
        model = Tied()
    network = FlowNetwork(trace_and_count(model, (1, 8, 8)), 1, shared_predicate(None, None))
    assert network.gradient_values() == 8 * 64


@pytest.mark.parametrize("cause", list(CAUSES))
def test_the_export_tracer_gives_the_same_bound(cause, monkeypatch):
    """Where torch.fx cannot trace a model, torch.export does: the same parameters reach the same calls there."""
    import rankaudit.trace.tracer

    shape, build, (_, rewritten) = CAUSES[cause]
    make = functools.partial(build, rewritten)
    with_fx, _ = static_bound(make, shape)

    def fx_fails(*args, **kwargs):
        raise RuntimeError("symbolic tracing failed (forced by the test)")

    monkeypatch.setattr(rankaudit.trace.tracer, "trace_with_fx", fx_fails)
    with_export, _ = static_bound(make, shape)
    assert with_export == with_fx, f"{cause}: export bound {with_export}, fx bound {with_fx}"


def test_a_division_by_data_inside_a_module_with_parameters_is_no_scaling(monkeypatch):
    """torch.export names a call after the module that holds it when the module has parameters of its own: the
    division is still recognised by the op called, not by that name."""
    import rankaudit.trace.tracer

    class Divide(nn.Module):
        def __init__(self):
            super().__init__()
            self.b = nn.Parameter(2.0 + 0.1 * torch.randn(1, 8, 8))
            self.c = nn.Parameter(torch.ones(()))  # one value: its own gradient carries next to nothing

        def forward(self, x):
            return self.c / (x + self.b)

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.divide = Divide()  # a submodule with parameters: export names its calls "divide"
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(F.avg_pool2d(self.divide(x), 4).flatten(1))

    with_fx, _ = static_bound(Scaled, (1, 8, 8))
    monkeypatch.setattr(
        rankaudit.trace.tracer, "trace_with_fx", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no fx"))
    )
    with_export, _ = static_bound(Scaled, (1, 8, 8))
    measured = measured_rank(Scaled, (1, 8, 8)).rank
    assert with_fx == with_export >= measured, f"fx bound {with_fx}, export bound {with_export}, measured {measured}"
