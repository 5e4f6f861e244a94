"""Spec §14: the per-sample bound R_s = min(|x|, |θ_s|, E_i·R(1)), its verdict and its findings."""
import pytest
import torch
import torch.nn as nn

from conftest import EXAMPLES
from rankaudit.bound import round_identifiability, sample_identifiability
from rankaudit.round import Round
from rankaudit.trace import trace_model


def traced_example(name: str):
    from rankaudit.load import load_model
    loaded = load_model(str(EXAMPLES / f"{name}.py"), None, device="meta")
    return trace_model(loaded.module, loaded.input_shape)


class PooledMLP(nn.Module):
    """3x8x8 -> 2x2 average pool (48 values) -> Linear 6 -> ReLU -> Linear 300: R(1) = 48 with every gradient
    shared (the pooled tensor is the cut), 6 with fc1 withheld (the hidden units are), |θ_s| = 6·300 + 300."""

    def __init__(self):
        super().__init__()
        self.pool = nn.AvgPool2d(2)
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(48, 6)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(6, 300)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(self.flatten(self.pool(x)))))


def traced_pooled():
    with torch.device("meta"):
        model = PooledMLP()
    return trace_model(model, (3, 8, 8))


# The MLP of spec §14 (examples/mlp_bias.py): |x| = 3·8·8 = 192; |θ_s| = 192·6 + 6 + 6·10 + 10 = 1,228; R(1) = 192
# (the input feeds fc1's 1,158-value gradient directly). R_s = min(192, 1,228, E·192) = 192 for every round:
# exposed, while the round's bound at N = 32, B = 8, E = 1 is min(6,144, 1,228, 4·R(8)) = 1,228 (ρ 0.20).
@pytest.mark.parametrize("round_", [Round(), Round(batch_size=8), Round(batch_size=8, local_samples=32),
                                    Round(batch_size=4, local_samples=16, local_epochs=2),
                                    Round(batch_size=32, local_samples=5000, clients=10)])
def test_mlp_sample_bound_is_the_whole_sample_at_every_round(round_):
    bound = round_identifiability(traced_example("mlp_bias"), round_)
    sample = bound.sample
    assert (sample.rank_bound, sample.unknowns, sample.single_sample_bound) == (192, 192, 192)
    assert sample.level == "exposed" and sample.recoverable_fraction == 1.0 and sample.binding == "unknowns"
    assert sample.steps_per_sample == round_.local_epochs


def test_mlp_round_of_the_issue_is_protected_as_a_batch_only():
    bound = round_identifiability(traced_example("mlp_bias"), Round(batch_size=8, local_samples=32))
    assert (bound.rank_bound, bound.unknowns, bound.verdict) == (1228, 6144, "protected")
    assert bound.sample.level == "exposed"


def test_fig2_b_sample_bound_is_r1_times_epochs_capped():
    traced = traced_example("fig2_b")          # spec §9: R(1) = 2,667 of 3,072; |θ_s| = 2,667 too
    for round_ in (Round(), Round(batch_size=8), Round(batch_size=8, local_samples=16)):
        sample = sample_identifiability(traced, round_)
        assert (sample.rank_bound, sample.binding, sample.level) == (2667, "steps", "partial")
        assert sample.recoverable_fraction == pytest.approx(2667 / 3072)
    sample = sample_identifiability(traced, Round(batch_size=8, local_epochs=2))
    # min(3,072, 2,667, 2·2,667): the update's values bind
    assert (sample.rank_bound, sample.binding, sample.steps_per_sample) == (2667, "update-values", 2)


def test_withheld_gradients_follow_the_round_rule_per_sample():
    traced = traced_pooled()
    withheld = {"withheld_layers": ["fc1"]}
    # FedSGD: the one step is the last, only fc2's gradient leaves: R_shared(1) = 6 at any batch size.
    for batch in (1, 8):
        sample = sample_identifiability(traced, Round(batch_size=batch), **withheld)
        assert (sample.rank_bound, sample.single_sample_bound, sample.binding) == (6, 6, "steps")
        assert sample.level == "protected"
    # N = B = 1, E = 3: the sample is read by all three steps; the first two carry fc1 on (R_all(1) = 48) and the
    # last does not (6): 2·48 + 6 = 102 of 192.
    sample = sample_identifiability(traced, Round(batch_size=1, local_epochs=3), **withheld)
    assert (sample.rank_bound, sample.steps_per_sample, sample.single_sample_bound) == (102, 3, 48)
    assert sample.binding == "steps" and sample.level == "partial"
    # N = 2, B = 1, E = 3: the first sample is never in the last step: 3·48 = 144.
    sample = sample_identifiability(traced, Round(batch_size=1, local_samples=2, local_epochs=3), **withheld)
    assert sample.rank_bound == 144
    # every gradient shared: 3·48 = 144 whatever the order; one epoch: 48
    assert sample_identifiability(traced, Round(batch_size=1, local_epochs=3)).rank_bound == 144
    assert sample_identifiability(traced, Round(batch_size=4, local_samples=8)).rank_bound == 48


def test_update_values_bind_when_few_gradients_are_shared():
    # mlp_bias with only fc2 shared: |θ_s| = 70 < |x| = 192 <= E·R_all(1) = 192
    traced = traced_example("mlp_bias")
    sample = sample_identifiability(traced, Round(batch_size=8, local_samples=16), shared_layers=["fc2"])
    assert (sample.rank_bound, sample.binding, sample.level) == (70, "update-values", "protected")


def test_sample_bound_uses_the_round_cache():
    traced = traced_example("mlp_bias")
    cache = {}
    round_identifiability(traced, Round(batch_size=8, local_samples=32), cache=cache)
    assert (1, False) in cache and cache["update_values"] == 1228
    before = dict(cache)
    round_identifiability(traced, Round(batch_size=4, local_samples=32, local_epochs=3), cache=cache)
    assert cache[(1, False)] is before[(1, False)]


def test_fedsgd_batch_one_sample_level_equals_the_batch_level():
    for name in ("fig2_b", "fig2_e", "mlp_bias", "lenet"):
        bound = round_identifiability(traced_example(name), Round())
        assert bound.sample.rank_bound == bound.rank_bound and bound.sample.unknowns == bound.unknowns
        assert bound.sample.level == bound.verdict
