"""method.md: counting against Qian et al.'s propositions: when a batch of B samples is over-determined."""

import pytest
from conftest import analyse_module
from torch import nn


def _mlp(d, n):
    return lambda: nn.Sequential(nn.Linear(d, n), nn.ReLU(), nn.Linear(n, 1))


@pytest.mark.parametrize("d", [3, 16, 100])
@pytest.mark.parametrize("n", [1, 4, 10, 33])
@pytest.mark.parametrize("batch", [1, 2, 8, 32, 64])
def test_proposition_2_first_linear(d, n, batch):
    """A first Linear d->n with bias is over-determined iff n >= B·d/(d+1+B) (Qian et al., Prop. 2)."""
    first = analyse_module(_mlp(d, n), (d,), batch).layers[0]
    assert (first.inputs, first.weights, first.outputs) == (batch * d, n * d + n, batch * n)
    assert (first.ra_i <= 0) == (n * (d + 1 + batch) >= batch * d)
    # Dense (excluded from the critical search) only while B <= out_features (method.md: counting).
    assert first.dense == (batch <= n)


def test_a_batch_wider_than_a_layer_makes_it_deficient_and_the_deficit_propagates():
    result = analyse_module(_mlp(100, 10), (100,), batch_size=64)
    first, head = result.layers
    assert not first.dense and first.ra_i == 64 * 100 - (100 * 10 + 10) - 64 * 10  # 4750
    # V = -4750 after the first layer raises the index of the head (method.md: counting: V may go negative).
    assert head.virtual == -4750 and head.ra_i == 64 * 10 - 11 - 64 * 1 + 4750
    assert (result.critical_layer, result.ra_i) == ("2", 5315)
    # The batch as a whole keeps a certified deficit (at most half of its directions recoverable), each sample does
    # not (R(1) = 100: the first Linear reads it all). Feature vectors without --data certify no share of energy,
    # so both read exposed on energy.
    whole = result.identifiability
    assert whole.certified_deficit > 0 and whole.recoverable_fraction <= 0.5 and whole.verdict == "exposed"
    assert result.verdict == "exposed" and result.identifiability.sample.rank_bound == 100
    # One sample: both layers are dense (B <= out_features), so the model is exposed.
    single = analyse_module(_mlp(100, 10), (100,), batch_size=1)
    assert [r.dense for r in single.layers] == [True, True] and single.verdict == "exposed"


@pytest.mark.parametrize(
    "channels, kernels, size, kernel, stride",
    [
        (3, 12, 32, 4, 2),
        (3, 3, 32, 4, 2),
        (3, 27, 32, 3, 3),
        (3, 26, 32, 3, 3),
        (1, 4, 28, 2, 2),
        (1, 3, 28, 2, 2),
    ],
)
@pytest.mark.parametrize("batch", [1, 16])
def test_proposition_3_conv_weight_constraints(channels, kernels, size, kernel, stride, batch):
    """A conv's weight constraints alone cover its input iff h·d'^2 >= C·d^2 (Qian et al., Prop. 3)."""
    out_size = (size - kernel) // stride + 1

    def build():
        return nn.Sequential(
            nn.Conv2d(channels, kernels, kernel, stride=stride, bias=False),
            nn.Flatten(),
            nn.Linear(kernels * out_size**2, 1),
        )

    conv = analyse_module(build, (channels, size, size), batch).layers[0]
    assert (conv.inputs, conv.outputs) == (batch * channels * size * size, batch * kernels * out_size**2)
    assert (conv.outputs >= conv.inputs) == (kernels * out_size**2 >= channels * size**2)


def test_gradient_constraints_do_not_scale_with_the_batch():
    one = analyse_module(_mlp(20, 5), (20,), 1).layers[0]
    many = analyse_module(_mlp(20, 5), (20,), 10).layers[0]
    assert many.weights == one.weights and many.inputs == 10 * one.inputs and many.outputs == 10 * one.outputs
