"""The federated round (method.md: the round): building and validating it, its static bound, the measured rank of the update
through unrolled local training, and the FedAvg inversion attack."""

import dataclasses
import importlib.util
import math

import pytest
import torch
import torch.nn as nn
from conftest import EXAMPLES

from rankaudit.bound.identifiability import identifiability, round_identifiability
from rankaudit.count.calls import trace_and_count
from rankaudit.errors import UsageError
from rankaudit.model.load import load_model
from rankaudit.settings.pyproject import load_settings
from rankaudit.settings.round import Round, build_round

# the bound section's reference values (one sample, 3x32x32, all gradients shared): (rank bound, certified deficit).
FIG2_BOUNDS = {
    "fig2_a": (3072, 0),
    "fig2_b": (2667, 405),
    "fig2_c": (2667, 405),
    "fig2_d": (3072, 0),
    "fig2_e": (3056, 16),
}
CNN6_PARAMETERS = 125_456


def traced_example(name: str, input_shape=None):
    loaded = load_model(str(EXAMPLES / f"{name}.py"), input_shape, device="meta")
    return trace_and_count(loaded.module, loaded.input_shape)


def example_class(name: str, attribute: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, attribute)


# ---- building and validating a round ------------------------------------------------------------------------------


def test_round_defaults_are_fedsgd_and_steps_count_the_short_batch():
    assert build_round({"batch_size": 4}).fedsgd
    round_ = build_round({"batch_size": 2, "local_samples": 5, "local_epochs": 2})
    assert round_.steps == 6 and round_.step_batch_sizes == [2, 2, 1, 2, 2, 1]
    assert not round_.fedsgd and not round_.secure_aggregation
    assert build_round({"batch_size": 1, "clients": 3}).secure_aggregation


@pytest.mark.parametrize(
    "flags, problem",
    [
        ({"batch_size": 4, "local_samples": 2}, "local samples N = 2 is below the batch size B = 4"),
        ({"batch_size": 1, "local_epochs": 0}, "local epochs E = 0 is not an integer >= 1"),
        ({"batch_size": 1, "clients": 0}, "clients C = 0 is not an integer >= 1"),
        ({"batch_size": 1, "lr": 0.0}, "learning rate 0.0 is not a finite number above 0"),
        ({"batch_size": 1, "lr": -0.1}, "learning rate -0.1 is not a finite number above 0"),
        ({"batch_size": 1, "lr": math.nan}, "learning rate nan is not a finite number above 0"),
        ({"batch_size": 1, "optimizer": "rmsprop"}, "unknown optimizer 'rmsprop'"),
        ({"batch_size": 1, "momentum": 1.0}, "momentum 1.0 is outside [0, 1)"),
        ({"batch_size": 1, "optimizer": "adam", "momentum": 0.9}, "momentum 0.9 given with the adam optimizer"),
    ],
)
def test_invalid_rounds_are_one_line_usage_errors(flags, problem):
    with pytest.raises(UsageError) as caught:
        build_round(flags)
    assert caught.value.problem.startswith(problem) and caught.value.fix and caught.value.exit_code == 2


def write_config(tmp_path, body: str):
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\n" + body, encoding="utf-8")
    model = tmp_path / "model.py"
    model.write_text("", encoding="utf-8")
    return model


def test_config_round_table_and_flags_win(tmp_path):
    model = write_config(
        tmp_path,
        "[tool.rankaudit.round]\nlocal-samples = 500\nbatch-size = 32\nlocal-epochs = 2\nlr = 0.05\nclients = 100\n",
    )
    settings = load_settings(model)
    assert settings.batch_size == 32
    assert settings.round == {"local_samples": 500, "local_epochs": 2, "lr": 0.05, "clients": 100}
    round_ = build_round({"batch_size": settings.batch_size, "local_epochs": 3, "lr": None}, settings.round)
    assert (round_.samples, round_.batch_size, round_.local_epochs, round_.lr, round_.clients) == (
        500,
        32,
        3,
        0.05,
        100,
    )
    assert round_.steps == 3 * 16


@pytest.mark.parametrize(
    "body, problem",
    [
        ("[tool.rankaudit.round]\nlocal-epoch = 2\n", "unknown key local-epoch in [tool.rankaudit.round]"),
        ("[tool.rankaudit.round]\nlocal-epochs = 1.5\n", "round.local-epochs must be an integer >= 1"),
        ('[tool.rankaudit.round]\nlr = "fast"\n', "round.lr must be a number"),
        ("[tool.rankaudit.round]\noptimizer = 3\n", "round.optimizer must be a string"),
        ("batch-size = 8\n[tool.rankaudit.round]\nbatch-size = 4\n", "batch-size is 8 in [tool.rankaudit] but 4"),
    ],
)
def test_config_round_errors(tmp_path, body, problem):
    with pytest.raises(UsageError) as caught:
        load_settings(write_config(tmp_path, body))
    assert problem in caught.value.problem


# ---- the static bound ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FIG2_BOUNDS))
def test_fedsgd_round_is_the_single_gradient_bound(name):
    traced = traced_example(name)
    bound = round_identifiability(traced, Round(batch_size=1))
    assert dataclasses.replace(bound, sample=None) == identifiability(traced, 1)  # + the per-sample bound (method.md)
    assert (bound.rank_bound, bound.certified_deficit) == FIG2_BOUNDS[name]
    assert bound.round is None


def test_round_formula_on_hand_checkable_cases():
    """cnn6 (|x| = 3,072, |θ_s| = 125,456, R(1) = 3,072, R(2) = 6,144: full rank, method.md: numerical check):

    - N = 3, B = 2, E = 2: steps at batch 2, 1, 2, 1: Σ R = 2·6,144 + 2·3,072 = 18,432 >= n = 9,216: no cap binds.
    - N = 64, B = 4: n = 196,608 > |θ_s|: R = 125,456, deficit 71,152, ρ = 0.638 > 0.5: partial.
    fig2_b (R(1) = 2,667 = |θ_s|, method.md: the bound), N = B = 1, C = 2: n = 6,144, Σ R = 5,334, R = min = 2,667: protected.
    """
    cnn6 = traced_example("cnn6")
    bound = round_identifiability(cnn6, build_round({"batch_size": 2, "local_samples": 3, "local_epochs": 2}))
    assert {(term.batch_size, term.steps, term.rank_bound) for term in bound.round.terms} == {
        (2, 2, 6144),
        (1, 2, 3072),
    }
    assert (bound.unknowns, bound.round.steps_bound, bound.rank_bound, bound.verdict) == (9216, 18432, 9216, "exposed")
    assert bound.round.binding == "unknowns"
    bound = round_identifiability(cnn6, build_round({"batch_size": 4, "local_samples": 64}))
    assert (bound.unknowns, bound.round.update_values, bound.rank_bound) == (196_608, CNN6_PARAMETERS, CNN6_PARAMETERS)
    assert bound.certified_deficit == 71_152 and bound.verdict == "partial"
    assert bound.round.explanation == "the update has only 125,456 values for 196,608 unknowns"
    fig2_b = traced_example("fig2_b")
    bound = round_identifiability(fig2_b, build_round({"batch_size": 1, "clients": 2}))
    assert (bound.unknowns, bound.round.steps_bound, bound.rank_bound, bound.verdict) == (6144, 5334, 2667, "protected")


def test_parameter_cap_certifies_once_the_samples_outnumber_the_update():
    """cnn6 at B = 1: every step is full rank (R(1) = |x|), so only the update's 125,456 values can cap the round:
    N = 40 (122,880 unknowns) is exposed, N = 41 (125,952) has a certified deficit of 496."""
    cnn6 = traced_example("cnn6")
    below = round_identifiability(cnn6, build_round({"batch_size": 1, "local_samples": 40}))
    above = round_identifiability(cnn6, build_round({"batch_size": 1, "local_samples": 41}))
    assert (below.certified_deficit, below.verdict) == (0, "exposed")
    assert (above.certified_deficit, above.round.binding) == (41 * 3072 - CNN6_PARAMETERS, "update-values")
    assert len(above.round.terms) == 1  # the bound's network ran once for the 41 steps of one kind


def test_secure_aggregation_over_two_clients_doubles_the_unknowns():
    cnn6 = traced_example("cnn6")
    one = round_identifiability(cnn6, build_round({"batch_size": 1, "local_samples": 2}))
    two = round_identifiability(cnn6, build_round({"batch_size": 1, "local_samples": 2, "clients": 2}))
    assert two.unknowns == 2 * one.unknowns == 12_288
    assert two.round.steps_bound == 2 * one.round.steps_bound


def test_withheld_gradients_still_carry_influence_before_the_last_step():
    """A withheld layer's weights move during local training and later steps read them: only the last step's
    withheld gradient is lost to the server."""
    fig2_b = traced_example("fig2_b")
    layers = [record.name for record in map(fig2_b.record, fig2_b.order) if record.counting.weights]
    withheld = [layers[-1]]
    bound = round_identifiability(fig2_b, build_round({"batch_size": 1, "local_samples": 3}), withheld_layers=withheld)
    terms = {term.every_gradient: term for term in bound.round.terms}
    assert terms[True].steps == 2 and terms[False].steps == 1
    assert terms[True].rank_bound == identifiability(fig2_b, 1).rank_bound
    assert terms[False].rank_bound == identifiability(fig2_b, 1, withheld_layers=withheld).rank_bound


# ---- the client's local training ----------------------------------------------------------------------------------


@pytest.mark.parametrize("optimizer, momentum", [("sgd", 0.0), ("sgd", 0.9), ("adam", 0.0)])
def test_local_training_matches_torch_optim(optimizer, momentum):
    from rankaudit.verify.client import LocalTraining

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    x, y = torch.rand(5, 6, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0])
    round_ = build_round(
        {
            "batch_size": 2,
            "local_samples": 5,
            "local_epochs": 2,
            "lr": 0.05,
            "optimizer": optimizer,
            "momentum": momentum,
        }
    )
    names = [name for name, _ in net.named_parameters()]
    simulated = LocalTraining(net, round_, "cross-entropy", names).update(x[None], y[None])
    trained = [p.detach().clone() for p in net.parameters()]
    copy = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    copy.load_state_dict(net.state_dict())
    opt = (
        torch.optim.SGD(copy.parameters(), lr=0.05, momentum=momentum)
        if optimizer == "sgd"
        else torch.optim.Adam(copy.parameters(), lr=0.05)
    )
    for _ in range(2):
        for start in range(0, 5, 2):
            opt.zero_grad()
            nn.functional.cross_entropy(copy(x[start : start + 2]), y[start : start + 2]).backward()
            opt.step()
    expected = torch.cat([(p.detach() - p0).reshape(-1) for p, p0 in zip(copy.parameters(), trained)])
    assert torch.allclose(simulated, expected, atol=1e-12, rtol=1e-9)


# ---- the measured rank of the update (the round section's exact check) -----------------------------------------------------

# Measured (seed 0, ResNet2Tiny width 4 at 3x8x8: 2,004 parameters, 192 unknowns per sample, uniform random
# inputs, lr 0.1, float64): (N, B, E) = (2, 2, 1): 295; (2, 1, 1): 303; (2, 1, 2): 384 of 384. At 3x16x16 and
# width 8 (5,140 parameters, as in method.md: the round) the same rounds measure 1,476, 1,337 and 1,536 of 1,536 (README).
ROUNDS = [(2, 2, 1), (2, 1, 1), (2, 1, 2)]


@pytest.fixture(scope="module")
def residual_round_ranks():
    from rankaudit.verify.rank.round_jacobian import measure_round

    build = example_class("resnet2_tiny", "ResNet2Tiny")
    torch.manual_seed(0)
    net = build(width=4)
    with torch.device("meta"):
        traced = trace_and_count(build(width=4), (3, 8, 8))
    generator = torch.Generator().manual_seed(0)
    found = {}
    for samples, batch, epochs in ROUNDS:
        round_ = build_round({"local_samples": samples, "batch_size": batch, "local_epochs": epochs})
        x = torch.rand((1, samples, 3, 8, 8), generator=generator, dtype=torch.float64)
        y = torch.randint(20, (1, samples), generator=generator)
        found[(samples, batch, epochs)] = (measure_round(net, x, y, round_), round_identifiability(traced, round_))
    return found


def test_second_epoch_adds_rank_and_the_bound_holds(residual_round_ranks):
    ranks = {key: measurement.rank for key, (measurement, _) in residual_round_ranks.items()}
    assert ranks[(2, 1, 2)] >= ranks[(2, 1, 1)]
    assert ranks[(2, 1, 1)] < 384 and ranks[(2, 2, 1)] < 384  # one epoch leaves directions hidden
    assert ranks[(2, 1, 2)] == 384  # the second epoch determines both samples
    for measurement, bound in residual_round_ranks.values():
        assert measurement.unknowns == bound.unknowns == 384
        assert measurement.rank <= bound.rank_bound
        assert measurement.reliable and math.isfinite(measurement.sigma_max)


@pytest.mark.parametrize("optimizer, momentum", [("sgd", 0.9), ("adam", 0.0)])
def test_round_rank_with_momentum_and_adam_stays_under_the_bound(optimizer, momentum):
    from rankaudit.verify.rank.round_jacobian import measure_round

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3), nn.Tanh(), nn.Linear(3, 2))
    with torch.device("meta"):
        traced = trace_and_count(nn.Sequential(nn.Flatten(), nn.Linear(12, 3), nn.Tanh(), nn.Linear(3, 2)), (1, 3, 4))
    round_ = build_round(
        {
            "local_samples": 4,
            "batch_size": 2,
            "local_epochs": 2,
            "optimizer": optimizer,
            "momentum": momentum,
            "clients": 2,
        }
    )
    x = torch.rand((2, 4, 1, 3, 4), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = torch.tensor([[0, 1, 1, 0], [1, 0, 0, 1]])
    measured = measure_round(net, x, y, round_)
    bound = round_identifiability(traced, round_)
    # 96 unknowns, an update of 47 values: the |θ_s| cap binds and the measurement stays under it.
    assert (bound.unknowns, bound.rank_bound, bound.round.binding) == (96, 47, "update-values")
    assert measured.unknowns == 96 and 0 < measured.rank <= 47


def test_round_rank_refuses_rounds_beyond_its_limits():
    from rankaudit.verify.rank.round_jacobian import MAX_STEPS, check_round_size

    with pytest.raises(
        UsageError,
        match=r"needs .* GiB for its .* float64 sketch .* 2 \(--clients\) x 1 \(--local-samples\) x 3x256x256",
    ):
        check_round_size(build_round({"batch_size": 1, "local_samples": 1, "clients": 2}), (3, 256, 256))
    with pytest.raises(UsageError, match=f"above the {MAX_STEPS}"):
        check_round_size(build_round({"batch_size": 1, "local_samples": 2, "local_epochs": MAX_STEPS}), (1, 2, 2))


# ---- the FedAvg attack --------------------------------------------------------------------------------------------


class SmallCNN(nn.Module):
    """conv 3->8 (3x3), LeakyReLU, linear to 10 classes: 5,354 parameters on 3x8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.act = nn.LeakyReLU(0.2)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        return self.fc(self.act(self.conv(x)).flatten(1))


def photographs(count: int) -> torch.Tensor:
    from rankaudit.bound import images as data

    images, _ = data.load_images(None, (3, 8, 8), count, 0)
    return images


def test_fedavg_attack_recovers_a_two_step_round_in_one_batch(monkeypatch):
    """Measured: 2 photographs at 3x8x8, N = 2, B = 1 (two local steps), 150 steps x 4 restarts: PSNR 32.0 and
    30.5 dB at the round prior's 0.2 (38.0 and 42.5 dB at the earlier 0.02, which fell behind at 32 px)."""
    from rankaudit.verify import client
    from rankaudit.verify.attacks import fedavg

    calls = []
    original = client.LocalTraining.update
    monkeypatch.setattr(client.LocalTraining, "update", lambda self, *a: calls.append(1) or original(self, *a))
    torch.manual_seed(0)
    round_ = build_round({"local_samples": 2, "batch_size": 1})
    attack = fedavg.invert_round(
        SmallCNN(),
        photographs(2).reshape(1, 2, 3, 8, 8),
        torch.tensor([[3, 7]]),
        round_,
        "cross-entropy",
        steps=150,
        restarts=4,
    )
    assert min(attack.psnr[0]) > 28 and attack.median_mse < 2e-3
    # One simulated round per optimisation step for all four restarts (vmap), plus the target, the prior's scale at
    # the starting points and the final score.
    assert len(calls) == 150 + 3 and attack.candidates_per_pass == 4


def test_fedavg_attack_on_an_aggregate_reports_each_client():
    """Measured: 2 clients x 2 images under secure aggregation, 150 steps x 2 restarts: PSNR 28.0, 30.8 (client 0)
    and 28.3, 24.8 dB (client 1), medians 29.4 and 26.5 dB; every image matched to an original of its label."""
    from rankaudit.verify.attacks import fedavg

    torch.manual_seed(0)
    round_ = build_round({"local_samples": 2, "batch_size": 1, "clients": 2})
    attack = fedavg.invert_round(
        SmallCNN(),
        photographs(4).reshape(2, 2, 3, 8, 8),
        torch.tensor([[0, 1], [2, 3]]),
        round_,
        "cross-entropy",
        steps=150,
        restarts=2,
    )
    assert len(attack.client_median_psnr) == 2 and len(attack.psnr[1]) == 2
    assert all(value > 20 for value in attack.client_median_psnr)
    assert attack.reconstructions.shape == (2, 2, 3, 8, 8)


# ---- the command line and the reports -----------------------------------------------------------------------------

CNN6 = EXAMPLES / "cnn6.py"


def test_cli_round_reaches_json_table_and_sarif(run_cli):
    import json

    code, out, _ = run_cli(CNN6, "--local-samples", 64, "--batch-size", 4, "--format", "json")
    payload = json.loads(out)
    assert payload["round"] == {
        "local_samples": 64,
        "batch_size": 4,
        "local_epochs": 1,
        "steps": 16,
        "lr": 0.1,
        "optimizer": "sgd",
        "momentum": 0.0,
        "clients": 1,
        "secure_aggregation": False,
        "fedsgd": False,
        "server_rounds": 1,
        "server_rounds_known": False,
        "available_clients": 1,
        "bn_mode": "train",
    }
    assert (
        # read on energy: 125,456 of the 64 samples' directions leave less than 5 % of their energy hidden
        payload["identifiability"]["verdict"] == "exposed"
        and payload["identifiability"]["rank_bound"] == CNN6_PARAMETERS
    )
    assert payload["verdict"] == "exposed"  # method.md: each sample: each sample's bound is R(1) = 3,072 = |x|
    assert payload["identifiability"]["round"]["binding"] == "update-values"
    code, out, _ = run_cli(CNN6, "--local-samples", 4, "--batch-size", 2, "--local-epochs", 2, "--clients", 3)
    header = out.splitlines()[0]
    assert header.endswith(
        "FedAvg round: N = 4 local samples, batch 2, 2 local epochs, K = 4 steps of sgd, lr 0.1; "
        "secure aggregation over C = 3 clients"
    )
    assert "Round: rank <= min(n = 36,864 unknowns, |θ_s| = 125,456 update values" in out
    assert "R-GAP has no multi-step form" in out and code == 1
    code, out, _ = run_cli(CNN6, "--local-samples", 4, "--batch-size", 2, "--local-epochs", 2, "--format", "sarif")
    verdict = next(r for r in json.loads(out)["runs"][0]["results"] if r["ruleId"] == "RA004")
    assert verdict["properties"]["round"]["steps"] == 4 and verdict["properties"]["binding_cap"] == "unknowns"


def test_cli_fedsgd_output_has_no_round_lines(run_cli):
    _, plain, _ = run_cli(CNN6)
    _, explicit, _ = run_cli(CNN6, "--local-samples", 1, "--local-epochs", 1, "--clients", 1)
    assert plain == explicit and "Round:" not in plain and "FedAvg" not in plain


@pytest.mark.parametrize(
    "args, message",
    [
        (["--local-samples", 1, "--batch-size", 2], "local samples N = 1 is below the batch size B = 2"),
        (["--local-epochs", 0], "local epochs E = 0 is not an integer >= 1"),
        (["--clients", -1], "clients C = -1 is not an integer >= 1"),
        (["--lr", "inf"], "learning rate inf is not a finite number above 0"),
        (["--optimizer", "rmsprop"], "unknown optimizer 'rmsprop'"),
        (["--momentum", 0.9, "--optimizer", "adam"], "momentum 0.9 given with the adam optimizer"),
    ],
)
def test_cli_round_errors_exit_2_in_one_line(run_cli, args, message):
    code, out, err = run_cli(CNN6, *args)
    assert code == 2 and message in err and "fix:" in err and len(err.strip().splitlines()) == 1


def test_config_round_table_drives_the_check_and_flags_win(run_cli, tmp_path):
    import json
    import shutil

    shutil.copy(CNN6, tmp_path / "cnn6.py")
    (tmp_path / "pyproject.toml").write_text(
        "[tool.rankaudit.round]\nlocal-samples = 64\nbatch-size = 4\nclients = 2\n", encoding="utf-8"
    )
    _, out, _ = run_cli(tmp_path / "cnn6.py", "--format", "json")
    payload = json.loads(out)
    # the round as a whole (128 samples, 125,456 update values) hides 0.09 % of their energy: exposed on energy too
    assert payload["round"]["clients"] == 2 and payload["identifiability"]["verdict"] == "exposed"
    assert payload["verdict"] == "exposed"  # method.md: each sample: the round as a whole, not each sample
    _, out, _ = run_cli(tmp_path / "cnn6.py", "--format", "json", "--clients", 1, "--local-samples", 8)
    shown = json.loads(out)["round"]
    assert (shown["clients"], shown["local_samples"], shown["batch_size"]) == (1, 8, 4)


def test_suggest_with_a_round_finds_n_e_and_c(run_cli):
    """cnn6, N = 4, B = 2, E = 2: each sample is exposed (R_s = min(3,072, 125,456, 2 x 3,072) = |x|, method.md: each sample),
    and no N, E or C changes that. The round as a whole, read on energy as `check` reads its round line, is
    protected from N = 159,265 (|θ_s| = 125,456 values over 159,265 samples: 0.79 directions each, where 90 % of
    such rounds keep half of the samples' detail hidden; the mean share got there at 158,632) or C = 39,817
    (4 x 39,817 samples): reported beside, as what it is, and `check` agrees at those rounds."""
    import json

    from rankaudit.audit import audit
    from rankaudit.settings.round import Round

    code, out, _ = run_cli(
        "suggest", CNN6, "--local-samples", 4, "--batch-size", 2, "--local-epochs", 2, "--format", "json"
    )
    review = json.loads(out)["round_review"]
    settings = {s["knob"]: s for s in review["settings"]}
    assert (review["verdict"], review["rank_bound"], review["unknowns"]) == ("exposed", 3072, 3072)
    assert (review["whole_verdict"], review["whole_rank_bound"], review["whole_unknowns"]) == ("exposed", 12288, 12288)
    assert (
        settings["local-samples"]["value"] is None
        and "protected from N = 159,265" in settings["local-samples"]["explanation"]
    )
    assert settings["clients"]["value"] is None and "protected from C = 39,817" in settings["clients"]["explanation"]
    for samples, level in ((159_265, "protected"), (159_264, "partial")):
        bound = audit(str(CNN6), round_=Round(batch_size=2, local_samples=samples, local_epochs=2)).identifiability
        assert (bound.verdict, bound.rank_bound) == (level, 125_456)
    assert settings["local-epochs"]["value"] is None and not settings["local-epochs"]["unbounded"]
    _, table, _ = run_cli("suggest", CNN6, "--local-samples", 4, "--batch-size", 2, "--local-epochs", 2)
    assert (
        "Smallest number of securely aggregated clients C for each sample protected: none (no C protects a "
        "sample" in table
    )
    # Withholding all but conv1 leaves |θ_s| = 576 of 3,072 directions (protected on directions), but they show all
    # but 0.28 % of a photograph's detail on average: only sending nothing protects a sample, so noise is the way.
    assert "Withholding gradients: no set of layers that still shares some gradient" in table
    assert "No structural edit protects a sample" in table


def test_suggest_largest_epochs_before_the_steps_fill_the_unknowns():
    """fig2_b has R(1) = 2,667 = |θ_s| per step (method.md: the bound). As a round of N = 8, B = 1 (24,576 unknowns) the |θ_s|
    cap keeps ρ = 0.11 whatever E; each sample keeps R_s = min(3,072, 2,667, E x 2,667) = 2,667 (ρ_s 0.87) at every
    E, N and C (method.md: each sample). On energy, as `check` reads them, both are exposed: 2,667 directions per sample, or 333
    per sample of the round, show more than 95 % of the detail of photographs; the round as a whole is
    protected from N = 3,447 (0.77 directions per sample)."""
    from rankaudit.design.round_review import round_review

    fig2_b = traced_example("fig2_b")
    review = round_review(fig2_b, build_round({"batch_size": 1, "local_samples": 8}))
    epochs = next(s for s in review.settings if s.knob == "local-epochs")
    assert review.whole_verdict == "exposed" and review.verdict == "exposed" and review.rank_bound == 2667
    assert epochs.value is None and not epochs.unbounded and "even one local epoch" in epochs.explanation
    review = round_review(fig2_b, build_round({"batch_size": 1}))
    assert review.verdict == review.whole_verdict == "exposed"
    samples = next(s for s in review.settings if s.knob == "local-samples")
    assert samples.value is None and "the round as a whole is protected from N = 3,447" in samples.explanation


def test_suggest_smallest_samples_is_one_batch_when_the_cap_already_protects():
    """resnet2_tiny (|θ_s| = 5,140, |x| = 768) at B = 32: one batch is 24,576 unknowns, ρ = 0.21, protected on
    directions from N = 32; on energy, as `check` reads the round line, 90 % of such rounds keep half of the
    samples' detail hidden from N = 6,768 on (0.76 directions per sample). Each sample is not (R(1) = 768 = |x|)."""
    from rankaudit.design.round_review import round_review

    review = round_review(traced_example("resnet2_tiny"), build_round({"batch_size": 32, "local_samples": 500}))
    samples = next(s for s in review.settings if s.knob == "local-samples")
    assert samples.value is None and "the round as a whole is protected from N = 6,768" in samples.explanation
    assert (review.verdict, review.rank_bound, review.unknowns) == ("exposed", 768, 768)


def test_verify_rank_and_rgap_use_the_round(run_cli, tmp_path):
    import json

    model = tmp_path / "res.py"
    model.write_text(
        (EXAMPLES / "resnet2_tiny.py")
        .read_text(encoding="utf-8")
        .replace("INPUT_SHAPE = (3, 16, 16)", "INPUT_SHAPE = (3, 8, 8)")
        .replace("width: int = 8", "width: int = 4"),
        encoding="utf-8",
    )
    code, out, err = run_cli(
        model,
        "--local-samples",
        2,
        "--batch-size",
        1,
        "--local-epochs",
        2,
        "--verify",
        "rank",
        "--verify",
        "rgap",
        "--steps",
        20,
        "--format",
        "json",
        "-q",
    )
    payload = json.loads(out)
    rank = payload["verification"]["rank"]
    assert (rank["rank"], rank["unknowns"], rank["round"]["steps"]) == (384, 384, 4)
    assert rank["bound"]["consistent"] and "the update determines the input" in rank["agreement"]
    attack = payload["verification"]["rgap"]
    assert attack["attack"] == "fedavg-inversion" and len(attack["samples"]) == 2
    assert any("R-GAP has no multi-step form" in note for note in attack["notes"])
    code, _, err = run_cli(model, "--local-samples", 2, "--batch-size", 1, "--verify", "gdbr")
    assert code == 2 and "--verify gdbr reads one shared gradient" in err


def test_the_rounds_rank_check_reports_each_samples_hidden_part(run_cli, tmp_path):
    """The verdicts over a round section's inputs: (N, B, E) = (2, 1, 1) on the 3x8x8, width-4 residual net leaves 81 of 384
    directions invisible (rank 303); the projection runs over both samples at once and each gets its share."""
    import json

    model = tmp_path / "res.py"
    model.write_text(
        (EXAMPLES / "resnet2_tiny.py")
        .read_text(encoding="utf-8")
        .replace("INPUT_SHAPE = (3, 16, 16)", "INPUT_SHAPE = (3, 8, 8)")
        .replace("width: int = 8", "width: int = 4"),
        encoding="utf-8",
    )
    code, out, _ = run_cli(
        model,
        "--local-samples",
        2,
        "--batch-size",
        1,
        "--verify",
        "rank",
        "--format",
        "json",
        "-q",
        "--fail-on",
        "never",
    )
    rank = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON"))["verification"]["rank"]
    assert code == 0 and rank["deficit"] == 384 - rank["rank"] > 0
    entries = rank["samples"][0]["inputs"]
    assert [entry["index"] for entry in entries] == [0, 1]
    assert all(0 < entry["hidden_energy"] < 1 for entry in entries)
    assert rank["hidden_energy_median"] == pytest.approx(
        sorted(e["hidden_energy"] for e in entries)[0] / 2 + sorted(e["hidden_energy"] for e in entries)[1] / 2
    )
    assert rank["visible_reading"]


def test_html_round_card_names_the_round_and_its_cap():
    from rankaudit.audit import audit
    from rankaudit.report import html

    result = audit(str(CNN6), round_=build_round({"batch_size": 4, "local_samples": 64, "clients": 2}))
    page = html.render([result])
    card = page[page.index("Federated round") :]
    card = card[: card.index("</section>")]
    for shown in (
        "64",
        "16",
        "393,216",
        "125,456",
        "update-values",
        "31.9 %",  # ρ as levels.percent writes it
        "The update has only 125,456 values for 393,216 unknowns",
    ):
        assert shown in card
    assert "Federated round" not in html.render([audit(str(CNN6))])


def test_round_rank_with_a_withheld_layer_stays_under_the_bound():
    """Flatten, Linear(12, 3), Tanh, Linear(3, 2) with the last layer's gradient withheld; N = 4, B = 2, E = 2:
    48 unknowns, an update of the first layer's 39 values (the withheld layer still trains locally). Measured:
    rank 39, the bound 39 (the |θ_s| cap)."""
    from rankaudit.verify.rank.jacobian import shared_parameter_names
    from rankaudit.verify.rank.round_jacobian import measure_round

    def build():
        return nn.Sequential(nn.Flatten(), nn.Linear(12, 3), nn.Tanh(), nn.Linear(3, 2))

    torch.manual_seed(0)
    net = build()
    with torch.device("meta"):
        traced = trace_and_count(build(), (1, 3, 4))
    round_ = build_round({"local_samples": 4, "batch_size": 2, "local_epochs": 2})
    bound = round_identifiability(traced, round_, withheld_layers=["3"])
    x = torch.rand((1, 4, 1, 3, 4), generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    measured = measure_round(net, x, torch.tensor([[0, 1, 1, 0]]), round_, shared_parameter_names(net, None, ["3"]))
    assert (bound.unknowns, bound.round.update_values, measured.shared_gradient_size) == (48, 39, 39)
    assert 0 < measured.rank <= bound.rank_bound <= 39


def test_fedavg_attack_keeps_each_restarts_best_iterate_at_the_models_precision():
    """Issue 21: the reconstruction is the winning restart's best iterate (never worse than its last one), and the
    attack runs in the model's dtype (the verifier's float64), not float32."""
    from rankaudit.verify.attacks import fedavg
    from rankaudit.verify.attacks.invert_match import gradient_distances
    from rankaudit.verify.client import LocalTraining

    torch.manual_seed(0)
    model = SmallCNN().double()
    round_ = build_round({"local_samples": 2, "batch_size": 1})
    images, labels = photographs(2).double().reshape(1, 2, 3, 8, 8), torch.tensor([[3, 7]])
    attack = fedavg.invert_round(model, images, labels, round_, "cross-entropy", steps=20, restarts=2, lr=0.3)
    assert attack.dtype == "float64" and len(attack.best_distances) == len(attack.last_iterate_distances) == 2
    assert all(best <= last for best, last in zip(attack.best_distances, attack.last_iterate_distances))
    assert attack.final_distance == min(attack.best_distances)
    # The returned images are that iterate (distinct labels: the matching leaves the order alone).
    training = LocalTraining(model, round_, "cross-entropy", [n for n, _ in model.named_parameters()])
    with torch.no_grad():
        target = training.update(images, labels)
        found = training.update(attack.reconstructions, labels)
    distance = float(gradient_distances([found.unsqueeze(0)], [(target / target.norm()).unsqueeze(0)])[0])
    assert distance == pytest.approx(attack.final_distance, rel=1e-9, abs=1e-15)
    assert (
        fedavg.invert_round(SmallCNN(), images.float(), labels, round_, "cross-entropy", steps=2, restarts=1).dtype
        == "float32"
    )
    # A coarse run (lr 1, 4 steps) overshoots: restart 1's last iterate (distance 0.324) is worse than its best
    # (0.292), and that best beats every last iterate (0.321 at best), so keeping the last one loses the winner.
    coarse = fedavg.invert_round(model, images, labels, round_, "cross-entropy", steps=4, restarts=2, lr=1.0)
    assert coarse.best_distances[1] < coarse.last_iterate_distances[1]
    assert coarse.final_distance < min(coarse.last_iterate_distances)
