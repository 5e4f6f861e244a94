"""Metamorphic soundness: small models rewritten into the same maths spelled differently, each checked against the
exact rank of ∂g/∂x.

A base model is a chain of steps (a bias shift, a convolution, an activation, a pooling, a flatten, a linear
layer, ...); every step kind has several spellings of one function: the torch.nn module, the functional form, the
method form, the weight transposed, scaled, masked or composed in forward(), an einsum, a repeated operand, a
division, views and permutes. `variants()` yields the base spelled the default way, then each single rewrite, then
(with `mixes`) random mixes of rewrites. `check()` gives, for one variant, the static per-sample bound that
`rankaudit` computes on the meta device and the rank of ∂g/∂x measured on real float64 tensors (method.md: numerical check's
sketch); a sound analysis has bound >= rank on every variant.

Used by tests/test_metamorphic.py (single rewrites, a few seconds) and benchmarks/bench_metamorphic.py (the sweep).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# ---- steps: one function, several spellings ------------------------------------------------------------------------


class Shift(nn.Module):
    """x + b with a trainable b of the input's shape: a gradient fed by δ alone, so every backward path counts."""

    SPELLINGS = ("plus", "torch_add", "param_scaled", "minus_negated")

    def __init__(self, shape, spelling):
        super().__init__()
        self.spelling = spelling
        self.b = nn.Parameter(2.0 + 0.1 * torch.randn(shape))  # keeps 1 / (x + b) away from 0 for x in [0, 1]

    def forward(self, x):
        if self.spelling == "plus":
            return x + self.b
        if self.spelling == "torch_add":
            return torch.add(x, self.b)
        if self.spelling == "param_scaled":
            return x + self.b * 1.0
        return x - (-self.b)


class Conv(nn.Module):
    """A 3x3 convolution, padding 1."""

    SPELLINGS = ("module", "functional", "scaled", "masked", "flat_weight_view", "reparametrised")

    def __init__(self, channels_in, channels_out, spelling):
        super().__init__()
        self.spelling = spelling
        self.conv = nn.Conv2d(channels_in, channels_out, 3, padding=1)
        self.register_buffer("mask", torch.ones_like(self.conv.weight))
        self.scale = 1.0 / math.sqrt(channels_in * 9)
        if spelling == "flat_weight_view":
            self.flat = nn.Parameter(self.conv.weight.detach().reshape(channels_out, -1).clone())
        if spelling == "reparametrised":  # weight = g * v (weight normalisation without the norm)
            self.gain = nn.Parameter(torch.ones(channels_out, 1, 1, 1))

    def forward(self, x):
        conv = self.conv
        if self.spelling == "module":
            return conv(x)
        if self.spelling == "functional":
            return F.conv2d(x, conv.weight, conv.bias, padding=1)
        if self.spelling == "scaled":  # equalised learning rate
            return F.conv2d(x, conv.weight / self.scale * self.scale, conv.bias, padding=1)
        if self.spelling == "masked":
            return F.conv2d(x, conv.weight * self.mask, conv.bias, padding=1)
        if self.spelling == "flat_weight_view":
            return F.conv2d(x, self.flat.view_as(conv.weight), conv.bias, padding=1)
        return F.conv2d(x, self.gain * conv.weight, conv.bias, padding=1)


class Linear(nn.Module):
    """y = x Wᵀ + b on the last dimension."""

    SPELLINGS = ("module", "functional", "transposed", "scaled", "masked", "low_rank_added", "einsum", "matmul_weight")

    def __init__(self, features_in, features_out, spelling):
        super().__init__()
        self.spelling = spelling
        self.fc = nn.Linear(features_in, features_out)
        self.register_buffer("mask", torch.ones_like(self.fc.weight))
        if spelling == "low_rank_added":  # W + A B, LoRA written by hand
            self.A = nn.Parameter(0.1 * torch.randn(features_out, 2))
            self.B = nn.Parameter(0.1 * torch.randn(2, features_in))
        if spelling == "matmul_weight":  # stored as (in, out), GPT-2's Conv1D layout
            self.w_in_out = nn.Parameter(self.fc.weight.detach().t().clone())

    def forward(self, x):
        fc = self.fc
        if self.spelling == "module":
            return fc(x)
        if self.spelling == "functional":
            return F.linear(x, fc.weight, fc.bias)
        if self.spelling == "transposed":
            return x @ fc.weight.t() + fc.bias
        if self.spelling == "scaled":
            return F.linear(x, fc.weight * 1.0, fc.bias)
        if self.spelling == "masked":
            return F.linear(x, fc.weight * self.mask, fc.bias)
        if self.spelling == "low_rank_added":
            return F.linear(x, fc.weight + self.A @ self.B, fc.bias)
        if self.spelling == "einsum":
            return torch.einsum("...i,oi->...o", x, fc.weight) + fc.bias
        return torch.matmul(x, self.w_in_out) + fc.bias


class Activation(nn.Module):
    """tanh, spelled as a module, a function, a method, or through the logistic function."""

    SPELLINGS = ("module", "function", "method", "by_sigmoid")

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.tanh = nn.Tanh()

    def forward(self, x):
        if self.spelling == "module":
            return self.tanh(x)
        if self.spelling == "function":
            return torch.tanh(x)
        if self.spelling == "method":
            return x.tanh()
        return 2.0 * torch.sigmoid(2.0 * x) - 1.0


class Square(nn.Module):
    """x²: a power, a product of a tensor with itself, a method."""

    SPELLINGS = ("power", "self_product", "torch_mul", "square", "method_pow")

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        if self.spelling == "power":
            return x**2
        if self.spelling == "self_product":
            return x * x
        if self.spelling == "torch_mul":
            return torch.mul(x, x)
        if self.spelling == "square":
            return torch.square(x)
        return x.pow(2)


class Reciprocal(nn.Module):
    """1 / x (x kept positive by the shift before it)."""

    SPELLINGS = ("reciprocal", "one_over", "div_tensor", "power", "method")

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        if self.spelling == "reciprocal":
            return torch.reciprocal(x)
        if self.spelling == "one_over":
            return 1.0 / x
        if self.spelling == "div_tensor":
            return torch.div(torch.ones_like(x), x)
        if self.spelling == "power":
            return x**-1
        return x.reciprocal()


class Halve(nn.Module):
    """x / 2: a division by a constant is a scaling."""

    SPELLINGS = ("divide", "multiply", "torch_div", "method")

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        if self.spelling == "divide":
            return x / 2.0
        if self.spelling == "multiply":
            return x * 0.5
        if self.spelling == "torch_div":
            return torch.div(x, 2.0)
        return x.div(2.0)


class Pool(nn.Module):
    """A 2x2 average or L2 pooling over the last two dimensions."""

    SPELLINGS = {
        "average": ("module", "functional", "by_reshape"),
        "l2": ("module", "functional", "by_hand"),
    }

    def __init__(self, kind, spelling):
        super().__init__()
        self.kind, self.spelling = kind, spelling
        self.pool = nn.AvgPool2d(2) if kind == "average" else nn.LPPool2d(2, 2)

    def forward(self, x):
        if self.spelling == "module":
            return self.pool(x)
        if self.kind == "average":
            if self.spelling == "functional":
                return F.avg_pool2d(x, 2)
            b, c, h, w = x.shape
            return x.reshape(b, c, h // 2, 2, w // 2, 2).mean(dim=(3, 5))
        if self.spelling == "functional":
            return F.lp_pool2d(x, 2, 2)
        return (F.avg_pool2d(x * x, 2) * 4.0).sqrt()


class Flatten(nn.Module):
    """(B, ...) -> (B, n): a view, a reshape, torch.flatten, the module, a transpose and its inverse first."""

    SPELLINGS = ("method", "view", "reshape", "module", "permuted_back")

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.flatten = nn.Flatten()

    def forward(self, x):
        if self.spelling == "method":
            return x.flatten(1)
        if self.spelling == "view":
            return x.contiguous().view(x.shape[0], -1)
        if self.spelling == "reshape":
            return torch.reshape(x, (x.shape[0], -1))
        if self.spelling == "module":
            return self.flatten(x)
        return x.transpose(1, -1).transpose(-1, 1).flatten(1)


class Gate(nn.Module):
    """x · sigmoid(x) (SiLU): the module, the function, a product spelled out."""

    SPELLINGS = ("module", "function", "product", "product_method")

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.silu = nn.SiLU()

    def forward(self, x):
        if self.spelling == "module":
            return self.silu(x)
        if self.spelling == "function":
            return F.silu(x)
        if self.spelling == "product":
            return x * torch.sigmoid(x)
        return x.mul(x.sigmoid())


class Norm(nn.Module):
    """Layer normalisation over the last dimension, with its affine weights."""

    SPELLINGS = ("module", "functional", "by_hand")

    def __init__(self, features, spelling):
        super().__init__()
        self.spelling = spelling
        self.norm = nn.LayerNorm(features)

    def forward(self, x):
        norm = self.norm
        if self.spelling == "module":
            return norm(x)
        if self.spelling == "functional":
            return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        centred = x - x.mean(-1, keepdim=True)
        variance = (centred * centred).mean(-1, keepdim=True)
        return centred / torch.sqrt(variance + norm.eps) * norm.weight + norm.bias


class Attention(nn.Module):
    """nn.MultiheadAttention on a sequence (a module the registry does not model)."""

    SPELLINGS = ("weights_returned", "no_weights", "per_head_weights")

    def __init__(self, features, spelling):
        super().__init__()
        self.spelling = spelling
        self.attention = nn.MultiheadAttention(features, 2, batch_first=True)

    def forward(self, x):
        if self.spelling == "weights_returned":
            return self.attention(x, x, x)[0]
        if self.spelling == "no_weights":
            return self.attention(x, x, x, need_weights=False)[0]
        return self.attention(x, x, x, average_attn_weights=False)[0]


class Recurrent(nn.Module):
    """A one-layer GRU's last hidden state (a module the registry does not model)."""

    SPELLINGS = ("last_output", "hidden_state")

    def __init__(self, features_in, features_out, spelling):
        super().__init__()
        self.spelling = spelling
        self.gru = nn.GRU(features_in, features_out, batch_first=True)

    def forward(self, x):
        output, hidden = self.gru(x)
        return output[:, -1] if self.spelling == "last_output" else hidden[0]


class Pairwise(nn.Module):
    """x₁ᵀ A x₂ + b on the two halves of the features: nn.Bilinear, F.bilinear, an einsum with a 3-D weight."""

    SPELLINGS = ("module", "functional", "einsum")

    def __init__(self, features, features_out, spelling):
        super().__init__()
        self.spelling = spelling
        self.half = features // 2
        self.bilinear = nn.Bilinear(self.half, features - self.half, features_out)

    def forward(self, x):
        left, right = x[:, : self.half], x[:, self.half :]
        bilinear = self.bilinear
        if self.spelling == "module":
            return bilinear(left, right)
        if self.spelling == "functional":
            return F.bilinear(left, right, bilinear.weight, bilinear.bias)
        return torch.einsum("bi,oij,bj->bo", left, bilinear.weight, right) + bilinear.bias


class Tokens(nn.Module):
    """(B, 1, L, D) -> (B, L, D): an image row per token."""

    SPELLINGS = ("squeeze", "index", "view")

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling

    def forward(self, x):
        if self.spelling == "squeeze":
            return x.squeeze(1)
        if self.spelling == "index":
            return x[:, 0]
        return x.view(x.shape[0], x.shape[2], x.shape[3])


# ---- bases: chains of steps -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    name: str
    input_shape: tuple[int, ...]
    # (label, spellings, build(spelling) -> nn.Module): one entry per step, in order
    steps: tuple[tuple[str, tuple[str, ...], Callable[[str], nn.Module]], ...]


def _step(label, kind, *args):
    spellings = kind.SPELLINGS
    return (label, tuple(spellings), lambda spelling: kind(*args, spelling))


def _pool(kind):
    return (f"{kind}_pool", Pool.SPELLINGS[kind], lambda spelling: Pool(kind, spelling))


BASES = (
    # A convolutional net: every rewrite of a weight, tanh, average pooling, a flatten.
    Base(
        "conv_tanh",
        (3, 8, 8),
        (
            _step("shift", Shift, (3, 8, 8)),
            _step("conv", Conv, 3, 2),
            _step("tanh", Activation),
            _pool("average"),
            _step("flatten", Flatten),
            _step("linear", Linear, 32, 3),
        ),
    ),
    # Squares and L2 pooling behind a trainable shift: their Jacobians depend on the input.
    Base(
        "square_l2pool",
        (1, 8, 8),
        (
            _step("shift", Shift, (1, 8, 8)),
            _step("square", Square),
            _step("halve", Halve),
            _pool("l2"),
            _step("flatten", Flatten),
            _step("linear", Linear, 16, 2),
        ),
    ),
    # A reciprocal summed away: only the backward path through the shift sees the input.
    Base(
        "reciprocal",
        (1, 8, 8),
        (
            _step("shift", Shift, (1, 8, 8)),
            _step("reciprocal", Reciprocal),
            _pool("average"),
            _pool("average"),
            _step("flatten", Flatten),
            _step("linear", Linear, 4, 2),
        ),
    ),
    # Tokens: layer norm, SiLU gate, a per-token linear layer.
    Base(
        "token_mlp",
        (1, 8, 8),
        (
            _step("tokens", Tokens),
            _step("norm", Norm, 8),
            _step("linear", Linear, 8, 4),
            _step("gate", Gate),
            _step("flatten", Flatten),
            _step("head", Linear, 32, 3),
        ),
    ),
    # Modules the registry does not know: attention, a GRU, a bilinear form.
    Base(
        "attention",
        (1, 8, 8),
        (
            _step("tokens", Tokens),
            _step("attention", Attention, 8),
            _step("flatten", Flatten),
            _step("head", Linear, 64, 2),
        ),
    ),
    Base(
        "recurrent",
        (1, 8, 8),
        (_step("tokens", Tokens), _step("gru", Recurrent, 8, 4), _step("head", Linear, 4, 2)),
    ),
    Base(
        "bilinear",
        (1, 8, 8),
        (_step("flatten", Flatten), _step("pairwise", Pairwise, 64, 4), _step("head", Linear, 4, 2)),
    ),
)


# Larger and deeper chains for the benchmark's sweep (benchmarks/bench_metamorphic.py), not the test suite.
EXTRA_BASES = (
    Base(
        "conv_deep",
        (3, 12, 12),
        (
            _step("shift", Shift, (3, 12, 12)),
            _step("conv", Conv, 3, 4),
            _step("square", Square),
            _step("conv2", Conv, 4, 2),
            _step("tanh", Activation),
            _pool("average"),
            _step("halve", Halve),
            _step("flatten", Flatten),
            _step("linear", Linear, 72, 4),
            _step("gate", Gate),
            _step("head", Linear, 4, 3),
        ),
    ),
    Base(
        "l2pool_reciprocal",
        (2, 8, 8),
        (
            _step("shift", Shift, (2, 8, 8)),
            _pool("l2"),
            _step("reciprocal", Reciprocal),
            _step("conv", Conv, 2, 2),
            _pool("average"),
            _step("flatten", Flatten),
            _step("head", Linear, 8, 2),
        ),
    ),
    Base(
        "tokens_attention_mlp",
        (1, 6, 8),
        (
            _step("tokens", Tokens),
            _step("norm", Norm, 8),
            _step("attention", Attention, 8),
            _step("linear", Linear, 8, 8),
            _step("gate", Gate),
            _step("flatten", Flatten),
            _step("head", Linear, 48, 3),
        ),
    ),
)


class Chain(nn.Module):
    def __init__(self, steps: list[nn.Module]):
        super().__init__()
        self.steps = nn.ModuleList(steps)

    def forward(self, x):
        for step in self.steps:
            x = step(x)
        return x


@dataclass(frozen=True)
class Variant:
    base: Base
    spellings: tuple[str, ...]  # one per step

    @property
    def name(self) -> str:
        rewrites = [
            f"{label}={spelling}"
            for (label, choices, _), spelling in zip(self.base.steps, self.spellings)
            if spelling != choices[0]
        ]
        return f"{self.base.name}[{', '.join(rewrites) or 'base'}]"

    def build(self) -> nn.Module:
        return Chain([make(spelling) for (_, _, make), spelling in zip(self.base.steps, self.spellings)])


def variants(bases=BASES, mixes: int = 0, seed: int = 0, each_rewrite_once: bool = False) -> Iterator[Variant]:
    """Each base spelled the default way, each single rewrite of one step, then `mixes` random mixes per base.
    `each_rewrite_once`: a rewrite of a step that several bases share (a linear head) only in the first of them."""
    generator = random.Random(seed)
    seen: set[tuple[str, str]] = set()
    for base in bases:
        default = tuple(choices[0] for _, choices, _ in base.steps)
        yield Variant(base, default)
        for position, (label, choices, _) in enumerate(base.steps):
            for spelling in choices[1:]:
                if each_rewrite_once and (label, spelling) in seen:
                    continue
                seen.add((label, spelling))
                yield Variant(base, default[:position] + (spelling,) + default[position + 1 :])
        for _ in range(mixes):
            yield Variant(base, tuple(generator.choice(choices) for _, choices, _ in base.steps))


# ---- the check --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    variant: str
    bound: int
    rank: int
    unknowns: int
    reliable: bool

    @property
    def sound(self) -> bool:
        return self.rank <= self.bound


def static_bound(build: Callable[[], nn.Module], input_shape: tuple[int, ...]) -> tuple[int, int]:
    """The per-sample rank bound rankaudit certifies, and the unknowns, from the model built on the meta device."""
    from rankaudit.count.analysis import analyze
    from rankaudit.count.calls import trace_and_count
    from rankaudit.findings import apply as findings

    with torch.device("meta"):
        model = build()
    traced = trace_and_count(model, tuple(input_shape))
    result = analyze(traced, 1, model="metamorphic", model_name=type(model).__name__, input_shape=tuple(input_shape))
    result = findings.apply_findings(result, traced)
    bound = result.identifiability
    sample = bound.sample.rank_bound if bound.sample is not None else bound.rank_bound
    return sample, bound.unknowns


def measured_rank(build: Callable[[], nn.Module], input_shape: tuple[int, ...], seed: int = 0):
    """rank(∂g/∂x) at a seeded uniform input, random initialisation, float64, cross-entropy on the outputs."""
    from rankaudit.verify.client import draw_labels, loss_name_for
    from rankaudit.verify.rank import jacobian as rank

    torch.manual_seed(seed)
    model = build().double()
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand((1, *input_shape), generator=generator, dtype=torch.float64)
    with torch.no_grad():
        logits = model(images)
    loss = loss_name_for(logits.numel())
    labels = draw_labels(1, loss, logits.numel(), seed)
    return rank.measure(model, images, labels, seed=seed, loss=loss)


def check(variant: Variant, seed: int = 0) -> Outcome:
    bound, unknowns = static_bound(variant.build, variant.base.input_shape)
    measured = measured_rank(variant.build, variant.base.input_shape, seed)
    return Outcome(variant.name, bound, measured.rank, unknowns, measured.reliable)
