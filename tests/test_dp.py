"""method.md: DP: the DP reconstruction bound B(κ), its accountant, the noise search and the attack that meets it."""

from __future__ import annotations

import builtins
import dataclasses
import json
import math
import re
import shutil
import textwrap
import xml.dom.minidom

import numpy as np
import pytest
import torch

pytest.importorskip("dp_accounting", reason="needs dp-accounting, not installed (pip install -e '.[dp]')")
from conftest import EXAMPLES, SMALL_CNN
from scipy.stats import norm

from rankaudit.bound import dp
from rankaudit.errors import UsageError
from rankaudit.settings import accountant, dp_options
from rankaudit.settings.round import DPSettings
from rankaudit.verify.attacks.dp import clopper_pearson, informed_attack

# the DP section's reference table: (q, σ, T) -> ε at δ = 1e-5, B(0.1), B(0.01), B(0.001).
EXACT_ROWS = [((1.0, 1.0, 1), 4.38, (0.389, 0.0924, 0.0183)), ((1.0, 4.0, 1), 0.93, (0.151, 0.0189, 0.0023))]
ACCOUNTANT_ROWS = [
    ((0.01, 1.0, 1000), 1.83, (0.194, 0.0291, 0.0041)),
    ((0.01, 0.8, 2000), 4.29, (0.333, 0.0744, 0.0146)),
]


def _bound(q, sigma, steps, **extra):
    return dp.dp_bound(DPSettings(noise_multiplier=sigma, sample_rate=q, steps=steps, **extra), curve=False)


@pytest.mark.parametrize("row", EXACT_ROWS)
def test_exact_rows_match_the_closed_form(row):
    (q, sigma, steps), epsilon, bounds = row
    result = _bound(q, sigma, steps)
    assert result.epsilon == pytest.approx(epsilon, abs=0.01)
    for key, expected in zip(dp.REPORTED_PRIORS, bounds):
        closed_form = norm.cdf(norm.ppf(float(key)) + 1 / sigma)
        assert result.bounds[key] == pytest.approx(expected, abs=1e-3)
        # The pessimistic PLD never reports less than the exact value, and not much more.
        assert closed_form - 1e-9 <= result.bounds[key] <= closed_form + 1e-3


@pytest.mark.parametrize("row", ACCOUNTANT_ROWS)
def test_accountant_rows_match_the_spec_to_two_percent(row):
    (q, sigma, steps), epsilon, bounds = row
    result = _bound(q, sigma, steps)
    assert result.epsilon == pytest.approx(epsilon, rel=0.02)
    for key, expected in zip(dp.REPORTED_PRIORS, bounds):
        assert result.bounds[key] == pytest.approx(expected, rel=0.02)


def test_the_users_prior_is_reported_and_results_are_finite():
    result = dp.dp_bound(DPSettings(noise_multiplier=1.0, prior=0.05))
    assert result.reconstruction_bound == pytest.approx(norm.cdf(norm.ppf(0.05) + 1.0), abs=1e-3)
    assert len(result.curve) == len(dp.CURVE_PRIORS)
    values = [b for _, b in result.curve]
    assert all(math.isfinite(v) and 0 < v <= 1 for v in values)
    assert values == sorted(values)  # B grows with κ
    assert all(b >= k for k, b in result.curve)  # never below guessing


def test_monotone_in_noise_rate_steps_and_prior():
    def b(sigma=1.0, q=0.1, steps=10, kappa=0.01):
        return dp.bound_at(sigma, q, steps, kappa)

    assert b(sigma=0.7) > b(sigma=1.0) > b(sigma=2.0)
    assert b(q=0.3) > b(q=0.1) > b(q=0.02)
    assert b(steps=100) > b(steps=10) > b(steps=1)
    assert b(kappa=0.1) > b(kappa=0.01) > b(kappa=0.001)


def test_thousands_of_steps_stay_a_fraction_of_a_second():
    dp.bound_at(1.0, 0.01, 10, 0.01)  # imports and warm-up
    result = _bound(0.01, 1.0, 10_000)
    assert result.seconds < 1.0
    assert 0.15 < result.bounds["0.01"] < 0.16  # 0.154 at discretisation 1e-3 (0.1540 at 1e-4)


def test_least_noise_meets_the_target_and_a_little_less_does_not():
    found = dp.least_noise(0.05, 0.01, 0.01, 1000, 1e-5)
    assert found.noise_multiplier == pytest.approx(0.78, abs=0.01)
    assert found.bound <= 0.05
    assert dp.bound_at(found.noise_multiplier * 0.98, 0.01, 1000, 0.01) > 0.05
    assert 3.0 < found.epsilon < 3.8
    with pytest.raises(UsageError, match="not above the prior"):
        dp.least_noise(0.01, 0.01, 0.01, 1000, 1e-5)


def test_the_missing_extra_is_one_line_with_the_install_command(monkeypatch):
    real_import = builtins.__import__

    def without_dp_accounting(name, *args, **kwargs):
        if name.startswith("dp_accounting"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without_dp_accounting)
    with pytest.raises(UsageError) as error:
        dp.dp_bound(DPSettings(noise_multiplier=1.0))
    # The packages by name: the line works in whatever environment rankaudit runs in (a clone, a pre-commit hook).
    assert 'fix: pip install "dp-accounting>=0.4" "threadpoolctl>=3"' in str(error.value)
    assert "\n" not in str(error.value) and "@" not in str(error.value)


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(noise_multiplier=0.0), r"--dp-noise must be a number above 0 \(from 1e-100 to 1e\+100.*\), got 0.0"),
        (dict(noise_multiplier=1.0, clip=-1.0), "--dp-clip must be a number above 0"),
        (dict(noise_multiplier=1.0, sample_rate=0.0), r"--dp-sample-rate must be a rate in \(0, 1\]"),
        (dict(noise_multiplier=1.0, sample_rate=1.5), r"--dp-sample-rate must be a rate in \(0, 1\]"),
        (dict(noise_multiplier=1.0, steps=0), "--dp-steps must be an integer >= 1"),
        (dict(noise_multiplier=1.0, delta=0.0), r"--dp-delta must be a probability in \(0, 1\)"),
        (dict(noise_multiplier=1.0, prior=1.0), r"--prior must be a probability in \(0, 1\)"),
        (dict(noise_multiplier=1.0, level="user"), "--dp-level must be sample or client"),
        (dict(noise_multiplier=1.0, max_reconstruction=1.5), "--max-reconstruction must be a probability"),
        (dict(noise_multiplier=1.0, max_reconstruction=0.01, prior=0.01), "is not above the prior"),
        (
            dict(noise_multiplier=float("nan")),
            r"--dp-noise must be a number above 0 \(from 1e-100 to 1e\+100.*\), got nan",
        ),
    ],
)
def test_settings_no_accountant_can_take_are_refused(settings, message):
    with pytest.raises(UsageError, match=message) as error:
        dp_options.validate(DPSettings(**settings))
    assert "; fix: " in str(error.value) and "\n" not in str(error.value)


# --- the attack -------------------------------------------------------------------------------------------------


def bayes_optimal(candidates: int, sigma: float) -> float:
    """∫ φ(z) Φ(z + 1/σ)^(M-1) dz: the best guess among M orthogonal candidates of norm c, one noisy step."""
    z = np.linspace(-12, 12, 24001)
    return float(np.trapezoid(norm.pdf(z) * norm.cdf(z + 1 / sigma) ** (candidates - 1), z))


@pytest.mark.parametrize("sigma, expected, bound", [(0.5, 0.674, 0.764), (1.0, 0.341, 0.389), (2.0, 0.199, 0.217)])
@pytest.mark.parametrize("draw_limit", [dp_full := 2**28, 0], ids=["full-draw", "span-draw"])
def test_orthogonal_candidates_reach_the_bayes_optimal_success(sigma, expected, bound, draw_limit):
    """M = 10 candidates whose clipped gradients are orthogonal with norm c = 2; the known rest of the batch."""
    clip, candidates = 2.0, 10
    gradients = clip * torch.eye(candidates, 24, dtype=torch.float64)
    known = torch.randn((3, 24), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    outcome = informed_attack(
        gradients,
        known,
        noise_multiplier=sigma,
        clip=clip,
        sample_rate=1.0,
        steps=1,
        trials=3000,
        seed=11,
        full_draw_limit=draw_limit,
    )
    assert outcome.draw == ("full" if draw_limit else "span")
    low, high = clopper_pearson(outcome.successes, outcome.trials)
    assert bayes_optimal(candidates, sigma) == pytest.approx(expected, abs=1e-3)
    assert low <= expected <= high
    assert dp.bound_at(sigma, 1.0, 1, 1 / candidates) == pytest.approx(bound, abs=1e-3)


def test_subsampled_steps_stay_below_the_bound():
    """q = 0.1 over T = 50 steps: the mixture likelihood's success stays under B(1/M)."""
    gradients = torch.eye(10, 12, dtype=torch.float64)
    outcome = informed_attack(
        gradients, None, noise_multiplier=1.0, clip=1.0, sample_rate=0.1, steps=50, trials=2000, seed=3
    )
    low, high = clopper_pearson(outcome.successes, outcome.trials)
    bound = dp.bound_at(1.0, 0.1, 50, 0.1)
    assert low <= bound
    assert outcome.successes / outcome.trials > 0.2  # the attack works: far above the prior 0.1


def test_clopper_pearson_matches_known_values():
    assert clopper_pearson(0, 10) == pytest.approx((0.0, 0.3085), abs=1e-4)
    low, high = clopper_pearson(50, 100)
    assert (low, high) == pytest.approx((0.3983, 0.6017), abs=1e-4)


@pytest.fixture(scope="module")
def lenet_result():
    from rankaudit.audit import audit

    return audit(str(EXAMPLES / "lenet.py"))


@pytest.mark.parametrize("sigma", [0.5, 1.0, 2.0])
def test_the_attack_on_real_clipped_gradients_stays_below_the_bound(lenet_result, sigma):
    from rankaudit.verify.attacks.dp import verify_dp

    settings = DPSettings(noise_multiplier=sigma, clip=1.0)
    measured = verify_dp(lenet_result, str(EXAMPLES / "lenet.py"), settings, trials=1500, seed=0, device="cpu")
    assert measured["draw"] == "full" and measured["device"] == "cpu"
    assert measured["bound"] == pytest.approx(norm.cdf(norm.ppf(0.1) + 1 / sigma), abs=1e-3)
    assert measured["interval"][0] <= measured["success_rate"] <= measured["interval"][1]
    assert measured["interval"][0] <= measured["bound"]
    assert measured["success_rate"] > 0.1  # the noise does not hide everything: above the prior
    assert measured["internal_error"] is None
    assert lenet_result.verification["dp"] is measured


# --- the command line, the configuration and the reports ----------------------------------------------------------

DP_FLAGS = ("--dp-noise", "1.0", "--dp-clip", "1.0", "--dp-sample-rate", "0.01", "--dp-steps", "1000")


def test_the_issue_example_prints_the_verdict_and_the_spec_bound(run_cli):
    code, out, _ = run_cli(EXAMPLES / "cnn6.py", *DP_FLAGS, "--fail-on", "never")
    assert code == 0
    assert "exposed" in out  # the structural verdict stays
    assert (
        "DP-SGD: ε 1.83 at δ 1e-05; any reconstruction succeeds with probability at most 0.0291 when its "
        "prior baseline is 0.01." in out
    )
    assert "0.194   0.0291  0.00407" in out


@pytest.mark.parametrize("ceiling, code", [("0.05", 0), ("0.02", 1)])
def test_max_reconstruction_sets_the_exit_code(run_cli, ceiling, code):
    got, out, _ = run_cli(
        EXAMPLES / "cnn6.py",
        *DP_FLAGS,
        "--fail-on",
        "never",
        "--max-reconstruction",
        ceiling,
        "--prior",
        "0.01",
        "--format",
        "json",
    )
    payload = json.loads(out)
    assert got == code and payload["policy"]["passed"] is (code == 0)
    section = payload["dp"]
    assert set(section) >= {
        "level",
        "noise_multiplier",
        "clip",
        "sample_rate",
        "steps",
        "delta",
        "epsilon",
        "prior",
        "reconstruction_bound",
        "bounds",
        "accountant",
    }
    assert section["bounds"]["0.01"] == pytest.approx(0.0291, rel=0.02) and section["epsilon"] == pytest.approx(
        1.83, rel=0.02
    )
    assert section["max_reconstruction"] == float(ceiling)
    if code:
        assert any("--max-reconstruction" in reason for reason in payload["policy"]["reasons"])


def test_the_quiet_line_carries_the_dp_sentence(run_cli):
    code, out, _ = run_cli(EXAMPLES / "fig2_a.py", "-q", "--dp-noise", "4", "--fail-on", "never")
    assert code == 0 and out.count("\n") == 1
    assert out.rstrip().endswith("; DP: reconstruction <= 0.0189 at prior 0.01; exit 0: pass")


def test_without_dp_options_nothing_changes(run_cli):
    code, out, _ = run_cli(EXAMPLES / "fig2_a.py", "--format", "json")
    assert json.loads(out)["dp"] is None
    code_table, table, _ = run_cli(EXAMPLES / "fig2_a.py")
    assert code_table == code and "DP-SGD" not in table and "DP-FedAvg" not in table


@pytest.mark.parametrize(
    "args, message",
    [
        (("--dp-noise", "-1"), "--dp-noise must be a number above 0"),
        (("--dp-noise", "1", "--dp-sample-rate", "0"), r"--dp-sample-rate must be a rate in \(0, 1\]"),
        (("--dp-noise", "1", "--dp-steps", "0"), "--dp-steps must be an integer >= 1"),
        (("--dp-noise", "1", "--prior", "1.5"), r"--prior must be a probability in \(0, 1\)"),
        (("--dp-noise", "1", "--dp-level", "user"), "--dp-level must be sample or client"),
        (
            (
                "--dp-sample-rate",
                "0.01",
            ),
            "given without a noise multiplier",
        ),
        (
            (
                "--max-reconstruction",
                "0.05",
            ),
            "given without a noise multiplier",
        ),
        (
            (
                "--prior",
                "0.1",
            ),
            "--prior given without a noise multiplier",
        ),
        (("--verify", "dp"), "no noise multiplier is given"),
        (("--dp-noise", "1", "--dp-candidates", "5"), "--dp-candidates sets the candidates of --verify dp"),
    ],
)
def test_bad_dp_flags_are_one_line_exit_2(run_cli, args, message):
    code, _, err = run_cli(EXAMPLES / "fig2_a.py", *args)
    assert code == 2 and re.search(message, err) and err.count("\n") == 1


def _project(tmp_path, table: str):
    (tmp_path / "pyproject.toml").write_text(
        '[tool.rankaudit]\nfail-on = "never"\n\n[tool.rankaudit.dp]\n' + textwrap.dedent(table)
    )
    model = tmp_path / "net.py"
    shutil.copy(EXAMPLES / "fig2_a.py", model)
    return model


def test_the_config_table_applies_and_flags_win(run_cli, tmp_path):
    model = _project(
        tmp_path,
        """
        noise = 4.0
        sample-rate = 1
        level = "client"
        max-reconstruction = 0.05
    """,
    )
    code, out, _ = run_cli(model, "--format", "json")
    section = json.loads(out)["dp"]
    assert code == 0 and section["level"] == "client" and section["noise_multiplier"] == 4.0
    assert section["reconstruction_bound"] == pytest.approx(0.0189, abs=1e-3)  # below the config's 0.05
    code, out, _ = run_cli(model, "--format", "json", "--dp-noise", "1.0")  # the flag wins: B = 0.0924
    assert code == 1 and json.loads(out)["dp"]["reconstruction_bound"] == pytest.approx(0.0924, abs=1e-3)


@pytest.mark.parametrize(
    "table, message",
    [
        (
            "noise = 0\n",
            r"\[tool.rankaudit.dp\] noise must be a number above 0 \(.*\), got 0.0; fix: set e.g. noise = 1.0",
        ),
        ("noise = 1.0\nsteps = 2.5\n", r"\[tool.rankaudit.dp\] steps must be an integer >= 1"),
        ("noise = 1.0\nlevel = 3\n", r"\[tool.rankaudit.dp\] level must be sample or client.*level = \"sample\""),
        ("noise = 1.0\nsigma = 2\n", r"unknown key sigma in \[tool.rankaudit.dp\]"),
    ],
)
def test_config_errors_name_the_key(run_cli, tmp_path, table, message):
    code, _, err = run_cli(_project(tmp_path, table))
    assert code == 2 and re.search(message, err) and err.count("\n") == 1


def test_sarif_ra009_when_the_bound_is_above_the_ceiling(run_cli):
    code, out, _ = run_cli(
        EXAMPLES / "fig2_a.py",
        "--dp-noise",
        "1",
        "--max-reconstruction",
        "0.05",
        "--format",
        "sarif",
        "--fail-on",
        "never",
    )
    log = json.loads(out)
    found = [r for r in log["runs"][0]["results"] if r["ruleId"] == "RA009"]
    assert code == 1 and len(found) == 1 and found[0]["level"] == "error"
    assert found[0]["properties"]["reconstruction_bound"] == pytest.approx(0.0924, abs=1e-3)
    assert "RA009" in {rule["id"] for rule in log["runs"][0]["tool"]["driver"]["rules"]}
    _, out, _ = run_cli(
        EXAMPLES / "fig2_a.py",
        "--dp-noise",
        "4",
        "--max-reconstruction",
        "0.05",
        "--format",
        "sarif",
        "--fail-on",
        "never",
    )
    assert not [r for r in json.loads(out)["runs"][0]["results"] if r["ruleId"] == "RA009"]


def test_html_card_draws_the_curve_and_the_measured_attack(run_cli, tmp_path):
    page = tmp_path / "r.html"
    code, _, _ = run_cli(
        EXAMPLES / "lenet.py",
        "--dp-noise",
        "1",
        "--verify",
        "dp",
        "--samples",
        "300",
        "--fail-on",
        "never",
        "--html",
        page,
        "-q",
    )
    text = page.read_text()
    assert code == 0 and "Differential privacy" in text
    curve = re.search(r'<svg class="dpcurve".*?</svg>', text, re.S).group(0)
    xml.dom.minidom.parseString(curve)  # XML-valid
    assert "http" not in curve and curve.count("<circle") == len(dp.CURVE_PRIORS) + 1
    assert "measured attack success" in curve  # the --verify dp point with its interval


def test_client_level_units_are_whole_rounds_of_local_training():
    """DP-FedAvg at the client level: a candidate is a client's whole local dataset, its unit the update of
    the round's simulated local training, clipped; the other clients the server samples from are known."""
    from rankaudit.audit import audit
    from rankaudit.settings.round import Round
    from rankaudit.verify.attacks.dp import KNOWN_CLIENTS, verify_dp

    round_ = Round(batch_size=2, local_samples=4, local_epochs=2, clients=2, available_clients=4, server_rounds=4)
    result = audit(str(EXAMPLES / "lenet.py"), round_=round_)
    measured = verify_dp(
        result,
        str(EXAMPLES / "lenet.py"),
        DPSettings(noise_multiplier=0.5, sample_rate=0.5, steps=4, level="client"),
        candidates=4,
        trials=400,
        seed=2,
        device="cpu",
    )
    notes = " ".join(measured["notes"])
    assert measured["level"] == "client" and measured["candidates"] == 4
    assert (
        "unit: a client's whole round: its update θ_K − θ₀ from simulated local training (FedAvg round: N = 4 "
        "local samples, batch 2, 2 local epochs, K = 4 steps of sgd" in notes
    )
    assert f"{min(3, KNOWN_CLIENTS)} other clients of the 3 the server samples from" in notes
    assert measured["bound"] == pytest.approx(dp.bound_at(0.5, 0.5, 4, 0.25), abs=1e-9)
    assert measured["interval"][0] <= measured["bound"] and measured["success_rate"] > 0.25


def test_a_one_step_clients_update_is_its_scaled_negative_gradient():
    """The client-level units come from the round's local training: with one step (N = B, E = 1) the update is
    −η · the batch gradient, so its clipped direction is exactly opposite the gradient's."""
    from rankaudit.settings.round import Round
    from rankaudit.verify.attacks.dp import client_updates, unit_gradients
    from rankaudit.verify.model import build_real_model

    model, _ = build_real_model(str(EXAMPLES / "fig2_a.py"), (3, 32, 32), 0)
    inputs = torch.rand((3, 2, 3, 32, 32), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    labels = torch.tensor([[-1.0, 1.0], [1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)  # logistic: ±1
    updates = client_updates(model, Round(batch_size=2, lr=0.05), inputs, labels, "logistic", 1e9, "cpu")
    gradients = unit_gradients(model, inputs, labels, "logistic", 1e9, "cpu")
    assert torch.allclose(updates, -0.05 * gradients, rtol=1e-9, atol=1e-12)
    clipped = client_updates(model, Round(batch_size=2, lr=0.05), inputs, labels, "logistic", 0.01, "cpu")
    # Clipped to c = 0.01, in units of c as every unit the attack reads (verify.dp.clip_in_units): norm 1.
    assert torch.allclose(clipped.norm(dim=1), torch.full((3,), 1.0, dtype=torch.float64))


def test_verify_dp_from_the_command_line_stays_below_the_bound(run_cli):
    code, out, err = run_cli(
        EXAMPLES / "lenet.py",
        "--dp-noise",
        "2",
        "--verify",
        "dp",
        "--samples",
        "400",
        "--dp-candidates",
        "5",
        "--format",
        "json",
        "--fail-on",
        "never",
    )
    attack = json.loads(out)["verification"]["dp"]
    assert code == 0 and "internal error" not in err
    assert set(attack) >= {"candidates", "trials", "success_rate", "interval", "bound", "seconds", "device"}
    assert attack["candidates"] == 5 and attack["trials"] == 400
    assert attack["bound"] == pytest.approx(norm.cdf(norm.ppf(0.2) + 0.5), abs=1e-3)
    assert attack["interval"][0] <= attack["bound"]


def test_an_interval_above_the_bound_is_an_internal_error_on_stderr(run_cli, monkeypatch):
    from rankaudit.verify.attacks import dp as attack_module

    real = attack_module.informed_attack
    monkeypatch.setattr(
        attack_module, "informed_attack", lambda *a, **k: dataclasses.replace(real(*a, **k), successes=k["trials"])
    )  # a mechanism that leaks everything
    code, out, err = run_cli(
        EXAMPLES / "lenet.py", "--dp-noise", "2", "--verify", "dp", "--samples", "50", "-q", "--fail-on", "never"
    )
    assert "internal error: the attack's success rate 1.000" in err and "lies above the certified bound" in err


def test_suggest_names_the_least_noise(run_cli, tmp_path):
    """The CLI's search at q = 0.01, T = 100 (cheaper than the T = 1000 the direct test covers). With DP options the
    Fisher review measures each design sample by sample: a small CNN keeps that quick (the noise does not depend on
    the model)."""
    small = tmp_path / "small_cnn.py"
    small.write_text(SMALL_CNN)
    code, out, _ = run_cli(
        "suggest",
        small,
        "--dp-sample-rate",
        "0.01",
        "--dp-steps",
        "100",
        "--max-reconstruction",
        "0.05",
        "--format",
        "json",
    )
    noise = json.loads(out)["dp_noise"]
    assert code == 0 and noise["bound"] <= 0.05 and noise["steps"] == 100 and noise["epsilon"] > 0
    assert 0.25 < noise["noise_multiplier"] < 0.78  # fewer steps need less noise than T = 1000's 0.78
    _, table, _ = run_cli(
        "suggest",
        small,
        "--dp-noise",
        "1",
        "--max-reconstruction",
        "0.5",
        "--prior",
        "0.1",
        "--top",
        "1",
    )
    assert (
        "DP noise (q 1, T 1, prior 0.1, --max-reconstruction 0.5): the least noise multiplier meeting it is σ ="
        in table
    )
    code, _, err = run_cli("suggest", small, "--dp-sample-rate", "0.01")
    assert code == 2 and "add --max-reconstruction" in err


# --- never crash, never overstate, within 1 % of a finer grid -------------------------------------------


@pytest.mark.parametrize("q, sigma, steps", [(0.01, 0.1, 1000), (1.0, 0.5, 1000)])
def test_noise_too_small_to_bound_anything_gives_one_not_an_overflow(q, sigma, steps):
    result = _bound(q, sigma, steps)
    assert all(value == 1.0 for value in result.bounds.values())
    from rankaudit.findings.meaning import dp_sentence

    assert dp_sentence(result).endswith("(the noise bounds nothing here)")


def test_vanishing_noise_is_bounded_by_the_chance_the_sample_is_used():
    result = _bound(0.01, 1e-9, 10)
    used = 1 - 0.99**10
    for key, value in result.bounds.items():
        assert value == pytest.approx(min(1.0, float(key) + used), rel=1e-9)
    assert "used at all" in result.accountant


def test_steps_beyond_the_accountant_are_refused_naming_the_flag_and_the_limit():
    with pytest.raises(UsageError) as refused:
        _bound(0.01, 1.0, 10**12)
    assert "--dp-steps 1,000,000,000,000" in refused.value.problem and "at most" in refused.value.problem
    assert "steps in [tool.rankaudit.dp]" in refused.value.fix


def test_steps_at_q_one_compose_exactly_to_one_gaussian():
    # T Gaussian steps are one of noise σ/√T: the closed form holds at any T (here σ 4, T 16 -> σ 1).
    result = _bound(1.0, 4.0, 16)
    for key, value in result.bounds.items():
        exact = norm.cdf(norm.ppf(float(key)) + 1.0)
        assert exact <= value <= exact * 1.005


@pytest.mark.parametrize("q, sigma, steps", [(0.001, 4.0, 100), (0.001, 2.0, 1), (0.01, 4.0, 100)])
def test_the_default_grid_is_within_one_percent_of_a_ten_times_finer_one(q, sigma, steps):
    from dp_accounting.pld import privacy_loss_distribution as pld

    mechanism = accountant.SubsampledGaussian(sigma, q, steps)
    grid = accountant.grid_for(mechanism)
    finer = pld.from_gaussian_mechanism(
        standard_deviation=sigma,
        sampling_prob=q,
        pessimistic_estimate=True,
        value_discretization_interval=grid.discretization / 10,
    ).self_compose(steps)
    profile = accountant._PLDProfile(finer, accountant.used_at_all(mechanism), "finer")
    result = _bound(q, sigma, steps)
    assert result.epsilon == pytest.approx(profile.epsilon(1e-5), rel=0.01)
    fine = dp.reconstruction_bounds(profile, [0.1, 0.01, 0.001])
    for ours, theirs in zip(result.bounds.values(), fine):
        assert ours == pytest.approx(theirs, rel=0.01)
    # The former fixed grid (1e-3) was 85 % loose in ε at (0.001, 4, 100): the fitted grid is much finer there.
    assert grid.discretization < 1e-4 if q == 0.001 else grid.discretization <= 1e-3
