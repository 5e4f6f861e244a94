"""The identifiability bound (method.md: the bound) and RA-i on branching graphs (method.md: counting revised), against hand-derived values."""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import EXAMPLES, analyse_module, row
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rankaudit.bound.identifiability import SINK, SOURCE, FlowNetwork, identifiability, shared_predicate
from rankaudit.count.calls import trace_and_count
from rankaudit.model.load import load_model


def traced_example(name: str):
    loaded = load_model(str(EXAMPLES / f"{name}.py"), None, device="meta")
    return trace_and_count(loaded.module, loaded.input_shape)


@pytest.mark.parametrize(
    "name, rank_bound, deficit, verdict",
    [
        ("fig2_a", 3072, 0, "exposed"),
        ("fig2_b", 2667, 405, "partial"),
        ("fig2_c", 2667, 405, "partial"),
        ("fig2_d", 3072, 0, "exposed"),
        ("fig2_e", 3056, 16, "partial"),
        ("strided_stem", 452, 2620, "protected"),
    ],
)
def test_spec_hand_values(name, rank_bound, deficit, verdict):
    bound = identifiability(traced_example(name))
    assert (bound.unknowns, bound.rank_bound, bound.certified_deficit, bound.verdict) == (
        3072,
        rank_bound,
        deficit,
        verdict,
    )
    assert bound.recoverable_fraction == pytest.approx(rank_bound / 3072)
    assert bound.max_recoverable == 0.5


def test_the_ceiling_moves_the_level_not_the_bound():
    traced = traced_example("fig2_e")  # R/n = 3056/3072 = 0.9948
    assert identifiability(traced, max_recoverable=0.995).verdict == "protected"
    assert identifiability(traced, max_recoverable=0.994).verdict == "partial"
    strict = identifiability(traced_example("strided_stem"), max_recoverable=0.1)  # R/n = 452/3072 = 0.147
    assert (strict.rank_bound, strict.verdict, strict.max_recoverable) == (452, "partial", 0.1)
    assert identifiability(traced_example("fig2_a"), max_recoverable=1.0).verdict == "exposed"


def _networkx_max_flow(traced, batch_size=1, **sharing):
    import networkx as nx

    network = FlowNetwork(traced, batch_size, shared_predicate(sharing.get("shared"), sharing.get("withheld")))
    return nx.maximum_flow_value(network.to_networkx(), SOURCE, SINK)


@pytest.mark.parametrize(
    "name",
    sorted(
        p.stem
        for p in EXAMPLES.glob("*.py")
        if p.stem not in {"bert_tiny", "gpt2_tiny", "gpt2_lora_tiny", "llama_tiny"}
    ),
)
@pytest.mark.parametrize("batch_size", [1, 7])
def test_own_max_flow_agrees_with_networkx(name, batch_size):
    traced = traced_example(name)
    assert identifiability(traced, batch_size).rank_bound == _networkx_max_flow(traced, batch_size)


def test_min_cut_names_the_bottleneck():
    # fig2-b: the two gradients (144 + 2523 values) are the narrowest place between the input and the sink.
    assert identifiability(traced_example("fig2_b")).bottleneck == ["∇conv1", "∇fc"]
    # fig2-e: all three gradients together (300 + 256 + 2500 = 3056).
    assert identifiability(traced_example("fig2_e")).bottleneck == ["∇conv1", "∇conv2", "∇fc"]
    # an exposed model: the cut is the input itself.
    assert identifiability(traced_example("fig2_a")).bottleneck == ["input"]


def test_batch_size_scales_tensors_but_not_gradients():
    traced = traced_example("fig2_a")
    # B = 2: 6144 unknowns; the gradients hold 192 + 3364 = 3556 values, all reachable.
    bound = identifiability(traced, 2)
    assert (bound.unknowns, bound.rank_bound, bound.certified_deficit) == (6144, 3556, 2588)
    assert bound.verdict == "partial"  # 3556 / 6144 = 58 % of the directions still recoverable


def test_withheld_gradients_lower_the_bound():
    traced = traced_example("fig2_a")
    # Only fc's gradient (3364 values) is sent: its rows still reach all 3072 unknowns.
    assert identifiability(traced, withheld_layers=["conv1"]).rank_bound == 3072
    # Only conv1's (192 values): the bound drops to 192.
    only_conv = identifiability(traced, withheld_layers=["fc"])
    assert (only_conv.rank_bound, only_conv.certified_deficit) == (192, 2880)
    assert identifiability(traced, shared_layers=["fc"]).rank_bound == 3072


class _NormedHead(nn.Module):
    """1x1 conv 3->2 (6 weights), GroupNorm with an affine scale and shift (4 values), mean, Linear 2->1 (2)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 1, bias=False)
        self.norm = nn.GroupNorm(1, 2)
        self.fc = nn.Linear(2, 1, bias=False)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x)).mean((2, 3)))


def test_parameters_used_outside_layers_are_gradients_too():
    with torch.device("meta"):
        model = _NormedHead()
    bound = identifiability(trace_and_count(model, (3, 8, 8)))
    # The gradients hold 6 + 2 layer weights and the norm's 4 affine values, all reachable through the 128-value
    # conv output: the norm's gradients are shared and count (method.md: the bound), else the bound would be 8, too low.
    assert bound.rank_bound == 12 and bound.certified_deficit == 192 - 12
    assert set(bound.bottleneck) == {"∇conv", "∇fc", "∇norm.weight", "∇norm.bias"}


class _ClassToken(nn.Module):
    """A 4x4 patch conv to 4 tokens of width 2, a class token and position embedding; the logits read the class token."""

    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(1, 2, kernel_size=4, stride=4, bias=False)  # 32 weights; 8 token values
        self.cls_token = nn.Parameter(torch.zeros(1, 1, 2))
        self.pos_embed = nn.Parameter(torch.zeros(1, 5, 2))
        self.head = nn.Linear(2, 2, bias=False)

    def forward(self, x):
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.pos_embed
        return self.head(torch.tanh(tokens)[:, 0])


def test_parameters_used_directly_are_gradients_and_add_no_unknowns():
    """64 unknowns. The patch weights (32) read the input itself; everything else passes the 8 token values.

    With the class token's and the position embedding's gradients (2 + 10 values) fed by δ of the tokens (tanh's
    Jacobian reads them), those 8 values all reach a gradient: R = 32 + 8 = 40. Without them only the class
    token's slot reaches the head: R would be 32 + 2 = 34, too low: an unsound bound.
    """
    result = analyse_module(_ClassToken, (1, 8, 8))
    assert "expand" not in [r.name for r in result.layers]  # an op on a parameter alone is no row
    bound = result.identifiability
    assert (bound.unknowns, bound.rank_bound, bound.certified_deficit) == (64, 40, 24)
    gradient, tokens = sorted(bound.bottleneck, key=lambda name: not name.startswith("∇"))
    # The 8 token values, reshaped: the layer (`patch (Conv2d)`) or the line of the reshaping op (`transpose at ...`).
    assert gradient == "∇patch" and tokens.split(" ")[0] in {"patch", "flatten", "transpose"}


class _TinyDense(nn.Module):
    """stem conv 1->2; A reads [stem]; B reads [stem, A]; the pool reads [stem, A, B]; a dense Linear 4->2."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 2, 3, padding=1, bias=False)
        self.conv_a = nn.Conv2d(2, 1, 3, padding=1, bias=False)
        self.conv_b = nn.Conv2d(3, 1, 3, padding=1, bias=False)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        h = self.stem(x)
        a = self.conv_a(h)
        b = self.conv_b(torch.cat([h, a], 1))
        return self.fc(torch.flatten(self.pool(torch.cat([h, a, b], 1)), 1))


def test_dense_concatenation_counts_shared_history_once():
    """Input 1x4x4 (16 unknowns). s_ℓ = max(z-x, 0) - max(x-z-W, 0) (method.md: counting), V = Σ s over the upstream *set*.

    stem: x 16, W 18, z 32, V 0  -> RA -34; s_stem = 16
    A:    x 32, W 18, z 16, V 16 -> RA -18; s_A = -max(32-16-18, 0) = 0
    B:    x 48 (cat h, a), W 27, z 16, V = s_stem + s_A = 16 -> RA -11; s_B = -max(48-16-27, 0) = -5
    pool: x 64 (cat h, a, b), W 0, z 4, V = 16 + 0 - 5 = 11 (stem counted once, not once per path) -> RA 49
    fc:   x 4, W 10, z 2, V = 11 - max(64-4-0, 0) = -49 -> RA 41, dense
    Summing the operands' V at every cat instead would give B's V 32 and the pool's 43.
    """
    result = analyse_module(_TinyDense, (1, 4, 4))
    assert [(r.name, r.inputs, r.weights, r.outputs, r.virtual, r.ra_i) for r in result.layers] == [
        ("stem", 16, 18, 32, 0, -34),
        ("conv_a", 32, 18, 16, 16, -18),
        ("conv_b", 48, 27, 16, 16, -11),
        ("pool", 64, 0, 4, 11, 49),
        ("fc", 4, 10, 2, -49, 41),
    ]
    assert (result.ra_i, result.critical_layer) == (49, "pool")
    # RA-i calls it protected at the pool, but nothing cuts the input off from the gradients: 16 unknowns,
    # 18 stem weights read the input directly.
    assert result.identifiability.rank_bound == 16 and result.verdict == "exposed"


def test_densenet_example_is_finite():
    result = analyse_module(
        lambda: load_model(str(EXAMPLES / "densenet_tiny.py"), None, device="meta").module, (3, 16, 16)
    )
    assert max(abs(r.virtual) for r in result.layers) < 10 * 768 + 12_298
    assert result.verdict == "exposed"


class _Squeeze(nn.Module):
    """conv, then a squeeze-and-excitation gate: the pooled side branch only scales the data path."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.reduce = nn.Linear(8, 2)
        self.expand = nn.Linear(2, 8)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        h = self.conv(x)
        gate = torch.sigmoid(self.expand(F.relu(self.reduce(h.mean((2, 3))))))
        return self.fc(torch.flatten(h * gate[:, :, None, None], 1))


def test_squeeze_excitation_branch_is_side_and_never_critical():
    result = analyse_module(_Squeeze, (3, 8, 8))
    side = {r.name for r in result.layers if r.side}
    assert side == {"mean", "reduce", "expand"}
    # Without the side rule the global pooling (x 512, W 0, z 8) would be critical with RA_i ~ 500.
    assert result.critical_layer not in side
    assert row(result, "mean").ra_i > result.ra_i


def test_attention_query_and_key_are_side():
    result = analyse_module(lambda: load_model(str(EXAMPLES / "vit_tiny.py"), None, device="meta").module, (3, 16, 16))
    qkv_slices = [r for r in result.layers if r.op == "getitem" and r.inputs == 1632]
    assert [r.side for r in qkv_slices] == [True, True, False, True, True, False]  # q, k side; v data
    assert result.verdict == "exposed" and result.ra_i > 0  # R-GAP stops at the class token; the bound does not


# ---- property: random branching nets ------------------------------------------------------------------


class _RandomBranching(nn.Module):
    """A random DAG of 3x3 convs over a pool of feature maps, merged by cat, add or an SE-style gate."""

    def __init__(self, plan):
        super().__init__()
        self.plan = plan
        self.convs = nn.ModuleList()
        channels = [3]
        for op, picks, width in plan:
            a, b = (p % len(channels) for p in picks)
            if op == "conv":
                self.convs.append(nn.Conv2d(channels[a], width, 3, padding=1, bias=False))
                channels.append(width)
            elif op == "cat":
                self.convs.append(nn.Identity())
                channels.append(channels[a] + channels[b])
            else:  # add or gate: align b's channels to a's with a 1x1 conv
                self.convs.append(nn.Conv2d(channels[b], channels[a], 1, bias=False))
                channels.append(channels[a])
        self.head = nn.Linear(channels[-1], 3)
        self.channels = channels

    def forward(self, x):
        maps = [x]
        for (op, picks, _), layer in zip(self.plan, self.convs):
            a, b = (p % len(maps) for p in picks)
            if op == "conv":
                maps.append(layer(maps[a]))
            elif op == "cat":
                maps.append(torch.cat([maps[a], maps[b]], 1))
            elif op == "add":
                maps.append(maps[a] + layer(maps[b]))
            else:
                maps.append(maps[a] * torch.sigmoid(layer(maps[b]).mean((2, 3), keepdim=True)))
        return self.head(maps[-1].mean((2, 3)))


PLANS = st.lists(
    st.tuples(
        st.sampled_from(["conv", "conv", "cat", "add", "gate"]),
        st.tuples(st.integers(0, 20), st.integers(0, 20)),
        st.integers(1, 6),
    ),
    min_size=1,
    max_size=9,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=PLANS)
def test_random_branching_nets_have_finite_bounded_indices(plan):
    result = analyse_module(lambda: _RandomBranching(plan), (3, 6, 6))
    # |s_ℓ| <= max(|x_ℓ|, |z_ℓ|), so a sum over a set of layers stays below all unknowns counted plus parameters;
    # a sum over paths would grow exponentially with the merges.
    limit = sum(r.inputs + r.outputs for r in result.layers) + result.parameters
    for r in result.layers:
        assert math.isfinite(r.ra_i) and abs(r.ra_i) <= limit and abs(r.virtual) <= limit, (r, plan)
    bound = result.identifiability
    assert 0 <= bound.rank_bound <= bound.unknowns == 108
    assert bound.rank_bound <= result.parameters
    traced = trace_and_count(_meta(lambda: _RandomBranching(plan)), (3, 6, 6))
    assert bound.rank_bound == _networkx_max_flow(traced)


def _meta(build):
    with torch.device("meta"):
        return build()


def test_a_share_below_one_never_prints_as_100_percent():
    """A partial verdict with R = n - 1 must not read "100 % recoverable" (nor a sliver of hidden energy "0 %")."""
    from rankaudit.settings.levels import percent

    assert [percent(x) for x in (0.995, 0.5, 0.005, 1.0, 0.0)] == ["99.5 %", "50 %", "0.5 %", "100 %", "0 %"]
    assert percent(3071 / 3072) == "99.97 %" and percent(1e-7) == "0.00001 %"


class _TwoHeadsAdded(torch.nn.Module):
    """fc1(x) + fc2(x) -> 64 -> 3 with fc1 and fc2 withheld: the cut lies at the add (2 values), a function call."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(8, 2), torch.nn.Linear(8, 2)
        self.out, self.head = torch.nn.Linear(2, 64), torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.head(torch.relu(self.out(self.fc1(x) + self.fc2(x))))


def test_min_cut_names_code_lines_and_layers_not_graph_nodes():
    from rankaudit.trace.records import NodeRecord

    with torch.device("meta"):
        model = _TwoHeadsAdded()
    bound = identifiability(trace_and_count(model, (8,)), 1, withheld_layers=["fc1", "fc2"])
    assert bound.rank_bound == 2  # the add's 2 values carry all that reaches the shared gradients
    assert len(bound.bottleneck) == 1 and bound.bottleneck[0].startswith("add at ")
    assert bound.bottleneck[0].endswith("test_bound.py:" + str(_TwoHeadsAdded.forward.__code__.co_firstlineno + 1))
    dropout = NodeRecord("transformer_drop", "transformer.drop", "Dropout", "dropout", None, 1, None, [])
    assert dropout.shown_name == "transformer.drop (Dropout)"
    assert NodeRecord("conv1", "conv1", "Conv2d", "conv", None, 1, None, []).shown_name == "conv1 (Conv2d)"
