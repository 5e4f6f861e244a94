"""method.md: the round: the per-sample bound over every server round the client takes part in, and over batch statistics in
training mode, each against the exact rank of one sample's Jacobian measured on real float64 tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.bound.identifiability import sample_identifiability
from rankaudit.bound.statistics import batch_statistics
from rankaudit.count.calls import trace_and_count
from rankaudit.settings.round import Round, build_round


class PatchNet(nn.Module):
    """3x8x8 -> a 4x4 stride-4 patch convolution to one channel -> SELU -> Linear 4 -> classes (method.md: the round), with an
    optional BatchNorm1d(192, affine=False) on the flattened input."""

    def __init__(self, batch_norm: bool = False, classes: int = 10):
        super().__init__()
        self.norm = nn.BatchNorm1d(192, affine=False) if batch_norm else None
        self.patch = nn.Conv2d(3, 1, 4, stride=4)
        self.act = nn.SELU()
        self.head = nn.Linear(4, classes)

    def forward(self, x):
        if self.norm is not None:
            x = self.norm(x.flatten(1)).view(-1, 3, 8, 8)
        return self.head(self.act(self.patch(x)).flatten(1))


def traced(batch_norm=False, classes=10):
    with torch.device("meta"):
        model = PatchNet(batch_norm, classes)
    return trace_and_count(model, (3, 8, 8))


def real(batch_norm=False, classes=10, seed=0):
    torch.manual_seed(seed)
    return PatchNet(batch_norm, classes).double().train()


def numerical_rank(jacobian: torch.Tensor) -> int:
    values = torch.linalg.svdvals(jacobian.reshape(jacobian.shape[0], -1))
    return int((values > values[0] * 1e-9).sum())


def rounds_ranks(model: nn.Module, batch: torch.Tensor, labels: torch.Tensor, rounds: int, lr=0.1, seed=1) -> list[int]:
    """rank(∂[u_1; …; u_t]/∂x_0) for t = 1 … `rounds`: sample 0 read by FedSGD in each round; between rounds the
    weights move by the client's own step (which depends on x_0) and other clients' step (a fixed random one).
    The first t rounds' updates are the first rows of the stacked Jacobian, so one Jacobian gives every t."""
    generator = torch.Generator().manual_seed(seed)
    start = {name: p.detach().clone().requires_grad_() for name, p in model.named_parameters()}
    others = [
        {name: 0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype) for name, p in start.items()}
        for _ in range(rounds)
    ]

    def updates(sample):
        inputs = torch.cat([sample[None], batch[1:]])
        weights, sent = dict(start), []
        for round_index in range(rounds):
            loss = F.cross_entropy(torch.func.functional_call(model, weights, (inputs,)), labels)
            grads = torch.autograd.grad(loss, list(weights.values()), create_graph=True)
            step = {name: -lr * g for name, g in zip(weights, grads, strict=True)}
            sent.append(torch.cat([s.reshape(-1) for s in step.values()]))
            weights = {name: weights[name] + step[name] + others[round_index][name] for name in weights}
        return torch.cat(sent)

    jacobian = torch.autograd.functional.jacobian(updates, batch[0], vectorize=True)
    per_round = jacobian.shape[0] // rounds
    return [numerical_rank(jacobian[: t * per_round]) for t in range(1, rounds + 1)]


# ---- every round the server reads -----------------------------------------------------------------------------------


def test_rounds_sum_and_stay_above_the_measured_rank_round_after_round():
    """The round section's reference: measured 51, 100, 147, 192 of 192 over 1-4 rounds; each round alone is bounded by 53."""
    model_graph = traced()
    model = real()
    torch.manual_seed(2)
    batch, labels = torch.rand(1, 3, 8, 8, dtype=torch.float64), torch.tensor([3])
    bounds = []
    for rounds in (1, 2, 3, 4):
        round_ = build_round({"server_rounds": rounds})
        bound = sample_identifiability(model_graph, round_)
        assert (bound.rounds, bound.rounds_known, bound.round_bound) == (rounds, True, 53)
        bounds.append(bound.rank_bound)
    measured = rounds_ranks(model, batch, labels, 4)
    assert bounds == [53, 106, 159, 192]
    assert measured == [51, 100, 147, 192]
    assert all(rank <= bound for rank, bound in zip(measured, bounds, strict=True))
    assert sample_identifiability(model_graph, build_round({"server_rounds": 4})).level == "exposed"


def test_rounds_not_known_count_one_round_and_the_same_round_given_counts_one_too():
    model_graph = traced()
    unknown = sample_identifiability(model_graph, build_round({}))
    assert (unknown.rank_bound, unknown.rounds, unknown.rounds_known, unknown.round_bound) == (53, 1, False, 53)
    stated_one = sample_identifiability(model_graph, build_round({"server_rounds": 1}))
    assert (stated_one.rank_bound, stated_one.rounds, stated_one.rounds_known) == (53, 1, True)
    # [tool.rankaudit.round]'s value counts as stated too; the flag wins over it
    configured = build_round({"server_rounds": None}, {"server_rounds": 3})
    assert (configured.rounds_counted, configured.server_rounds_known) == (3, True)
    assert build_round({"server_rounds": 2}, {"server_rounds": 3}).rounds_counted == 2


def test_rounds_cap_each_round_at_the_update_values():
    """min(|θ_s|, E·R(1)) per round: E = 4 local epochs reach |θ_s| = 99 in one round, two rounds 192."""
    model_graph = traced()
    one = sample_identifiability(model_graph, build_round({"local_epochs": 4, "local_samples": 2, "batch_size": 1}))
    assert (one.round_bound, one.binding) == (99, "update-values")
    assert one.rank_bound == 99
    two = sample_identifiability(
        model_graph, build_round({"local_epochs": 4, "local_samples": 2, "batch_size": 1, "server_rounds": 2})
    )
    assert (two.rank_bound, two.binding) == (192, "unknowns")


# ---- batch statistics in training mode ------------------------------------------------------------------------------


def one_step_rank(model: nn.Module, batch: torch.Tensor, labels: torch.Tensor) -> int:
    """rank(∂g/∂x_0) of one batch gradient, the rest of the batch fixed, in the model's mode."""
    weights = dict(model.named_parameters())

    def gradient(sample):
        inputs = torch.cat([sample[None], batch[1:]])
        loss = F.cross_entropy(torch.func.functional_call(model, weights, (inputs,)), labels)
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, list(weights.values()), create_graph=True)])

    return numerical_rank(
        torch.autograd.functional.jacobian(gradient, batch[0], vectorize=True, strategy="forward-mode")
    )


def test_batch_statistics_in_training_mode_bound_the_measured_rank():
    """method.md: the round: BatchNorm1d(192, affine=False) before the patch convolution, B = 16: measured 107 in training
    mode (a 100-class head; with 10 classes |θ_s| = 99 caps it, see the rank check's test), against 51 in eval
    mode (bound 53)."""
    classes, measured_rank, bound_value = 100, 107, 113
    model_graph = traced(batch_norm=True, classes=classes)
    torch.manual_seed(3)
    batch, labels = torch.rand(16, 3, 8, 8, dtype=torch.float64), torch.randint(0, classes, (16,))
    # A client that sends its parameters alone (no state_dict): the norm's running statistics stay local.
    train = sample_identifiability(model_graph, build_round({"batch_size": 16}), withheld_layers=["norm"])
    assert train.batch_statistics == ["norm"]
    # Sent, the running mean moves by the batch's mean: with the rest of the batch known, all 192 values of x_i.
    assert sample_identifiability(model_graph, build_round({"batch_size": 16})).rank_bound == 192
    rank_train = one_step_rank(real(True, classes), batch, labels)
    assert rank_train == measured_rank
    assert train.rank_bound == bound_value >= rank_train
    evaluated = sample_identifiability(model_graph, build_round({"batch_size": 16, "bn_mode": "eval"}))
    assert evaluated.batch_statistics == [] and evaluated.rank_bound == 53
    rank_eval = one_step_rank(real(True, classes).eval(), batch, labels)
    assert rank_eval == 51 <= evaluated.rank_bound


def test_batch_statistics_are_read_by_batch_norms_not_by_per_sample_norms():
    class Norms(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.batch = nn.BatchNorm2d(4)
            self.instance = nn.InstanceNorm2d(4, track_running_stats=True)
            self.group = nn.GroupNorm(2, 4)
            self.no_running = nn.BatchNorm2d(4, track_running_stats=False)
            self.fc = nn.Linear(144, 2)

        def forward(self, x):
            x = self.no_running(self.group(self.instance(self.batch(self.conv(x)))))
            return self.fc(F.batch_norm(x, None, None, training=True).flatten(1))

    with torch.device("meta"):
        model_graph = trace_and_count(Norms(), (3, 8, 8))
    names = lambda mode: [model_graph.record(n).name for n in batch_statistics(model_graph, mode)]  # noqa: E731
    assert names("train") == ["batch", "no_running", "batch_norm"]
    # eval mode: running statistics, except where the module keeps none or the call's mode is not recorded
    assert names("eval") == ["no_running", "batch_norm"]


class HandBatchNorm(nn.Module):
    """Another library's batch normalisation, written by hand: traced as one op, taken at its name's word."""

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) / (x.var(0, keepdim=True, unbiased=False) + 1e-5).sqrt()


class HandNormNet(PatchNet):
    """The spec's patch net behind a hand-written batch normalisation of every input value."""

    def __init__(self):
        super().__init__(classes=100)
        self.norm = HandBatchNorm()

    def forward(self, x):
        return self.head(self.act(self.patch(self.norm(x))).flatten(1))


def test_a_batch_norm_of_another_library_couples_the_samples():
    """Its statistics are one per value (2 x 192 here, not 2 x 3 channels): the bound counts every value."""
    with torch.device("meta"):
        model_graph = trace_and_count(HandNormNet(), (3, 8, 8))
    bound = sample_identifiability(model_graph, Round(batch_size=16), withheld_layers=["norm"])  # statistics kept
    assert bound.batch_statistics == ["norm"]
    torch.manual_seed(3)
    batch, labels = torch.rand(16, 3, 8, 8, dtype=torch.float64), torch.randint(0, 100, (16,))
    torch.manual_seed(0)
    measured = one_step_rank(HandNormNet().double(), batch, labels)
    assert measured == 107 <= bound.rank_bound == 113


def test_batch_norm_mode_is_validated_and_configurable(tmp_path):
    from rankaudit.errors import UsageError
    from rankaudit.settings.pyproject import load_settings

    assert Round().bn_mode == "train"
    with pytest.raises(UsageError, match="BatchNorm mode 'test'"):
        build_round({"bn_mode": "test"})
    (tmp_path / "pyproject.toml").write_text('[tool.rankaudit.round]\nbn-mode = "eval"\nserver-rounds = 5\n')
    (tmp_path / "model.py").write_text("")
    settings = load_settings(tmp_path / "model.py")
    round_ = build_round({}, settings.round)
    assert (round_.bn_mode, round_.server_rounds, round_.server_rounds_known) == ("eval", 5, True)


# ---- the exact check simulates what the bound covers ----------------------------------------------------------------


def test_round_rank_check_stacks_the_server_rounds_under_the_bound():
    """measure_round over three server rounds at moving weights: the per-sample rank grows past one round's bound
    (53) and stays under the three rounds' (159)."""
    from rankaudit.verify.rank.round_jacobian import measure_round

    round_ = build_round({"server_rounds": 3})
    bound = sample_identifiability(traced(), round_)
    torch.manual_seed(4)
    inputs = torch.rand(1, 1, 3, 8, 8, dtype=torch.float64)
    measured = measure_round(real(), inputs, torch.tensor([[3]]), round_, seed=0)
    (rank_i,) = measured.sample_ranks
    assert measured.shared_gradient_size == 3 * 99
    assert bound.round_bound == 53 < rank_i <= bound.rank_bound == 159
    assert rank_i == 147


def test_rank_check_in_training_mode_reads_the_batch_statistics():
    """The single-gradient check normalises each batch with its own statistics unless told eval: rank(J_i) 94
    (bound 99) against 51 (bound 53) on the same batch of 16 (the 10-class head: a sketch of 115 rows)."""
    from rankaudit.verify.rank import jacobian

    torch.manual_seed(3)
    batch, labels = torch.rand(16, 3, 8, 8, dtype=torch.float64), torch.randint(0, 10, (16,))
    model = real(True, 10)
    train = jacobian.measure(model, batch, labels, bn_mode="train")
    evaluated = jacobian.measure(model, batch, labels, bn_mode="eval")
    kept = sample_identifiability(traced(True), Round(batch_size=16), withheld_layers=["norm"])  # statistics kept
    assert max(train.sample_ranks) == 94 <= kept.rank_bound == 99
    assert max(evaluated.sample_ranks) == 51
    assert model.norm.track_running_stats and model.training  # the caller's model is left as it was


PATCH_MODEL = """
from torch import nn


class PatchNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.patch = nn.Conv2d(3, 1, 4, stride=4)
        self.act = nn.SELU()
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        return self.head(self.act(self.patch(x)).flatten(1))


INPUT_SHAPE = (3, 8, 8)
"""


def test_the_report_says_what_one_verdict_covers(run_cli, tmp_path):
    import json

    model = tmp_path / "patch.py"
    model.write_text(PATCH_MODEL)
    code, out, _ = run_cli(model, "--fail-on", "never")
    # one round: 53 of 192 directions (on energy still exposed: they show most of a typical photo); this test reads
    # what the verdict covers
    assert code == 0 and "rank <= 53 of 192" in out
    assert (
        "Covers: One server round (the rounds are not known): each further round the client takes part in can add "
        "up to 53 directions; after 4 rounds nothing is certified hidden." in out
    )
    code, out, _ = run_cli(model, "--server-rounds", 4, "--available-clients", 10, "--format", "json")
    payload = json.loads(out)
    assert code == 1 and payload["verdict"] == "exposed"
    sample = payload["identifiability"]["sample"]
    assert (sample["rank_bound"], sample["rounds"], sample["rounds_known"], sample["round_bound"]) == (192, 4, True, 53)
    assert sample["covers"].startswith("All 4 server rounds: 4 x 53 = 212 directions at most")
    assert (payload["round"]["server_rounds"], payload["round"]["available_clients"]) == (4, 10)
    assert payload["round"]["bn_mode"] == "train"
    code, _, err = run_cli(model, "--bn-mode", "test")
    assert code == 2 and "--bn-mode" in err
