"""Spec §13: the DP reconstruction bound B(κ), its accountant, the noise search and the attack that meets it."""
from __future__ import annotations

import builtins
import math

import numpy as np
import pytest
import torch

pytest.importorskip("dp_accounting")
from scipy.stats import norm  # noqa: E402  (dp-accounting brings scipy)

from rankaudit import dp  # noqa: E402
from rankaudit.errors import UsageError  # noqa: E402
from rankaudit.round import DPSettings  # noqa: E402
from rankaudit.verify.dp import clopper_pearson, informed_attack  # noqa: E402

from conftest import EXAMPLES  # noqa: E402

# Spec §13's reference table: (q, σ, T) -> ε at δ = 1e-5, B(0.1), B(0.01), B(0.001).
EXACT_ROWS = [((1.0, 1.0, 1), 4.38, (0.389, 0.0924, 0.0183)),
              ((1.0, 4.0, 1), 0.93, (0.151, 0.0189, 0.0023))]
ACCOUNTANT_ROWS = [((0.01, 1.0, 1000), 1.83, (0.194, 0.0291, 0.0041)),
                   ((0.01, 0.8, 2000), 4.29, (0.333, 0.0744, 0.0146))]


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
    assert values == sorted(values)                          # B grows with κ
    assert all(b >= k for k, b in result.curve)               # never below guessing


def test_monotone_in_noise_rate_steps_and_prior():
    def b(sigma=1.0, q=0.1, steps=10, kappa=0.01):
        return dp.bound_at(sigma, q, steps, kappa)

    assert b(sigma=0.7) > b(sigma=1.0) > b(sigma=2.0)
    assert b(q=0.3) > b(q=0.1) > b(q=0.02)
    assert b(steps=100) > b(steps=10) > b(steps=1)
    assert b(kappa=0.1) > b(kappa=0.01) > b(kappa=0.001)


def test_thousands_of_steps_stay_a_fraction_of_a_second():
    dp.bound_at(1.0, 0.01, 10, 0.01)     # imports and warm-up
    result = _bound(0.01, 1.0, 10_000)
    assert result.seconds < 1.0
    assert 0.15 < result.bounds["0.01"] < 0.16    # 0.154 at discretisation 1e-3 (0.1540 at 1e-4)


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
    assert 'pip install "rankaudit[dp]"' in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("settings, message", [
    (dict(noise_multiplier=0.0), "noise multiplier must be positive"),
    (dict(noise_multiplier=1.0, clip=-1.0), "clip norm must be positive"),
    (dict(noise_multiplier=1.0, sample_rate=0.0), r"sample rate must lie in \(0, 1\]"),
    (dict(noise_multiplier=1.0, sample_rate=1.5), r"sample rate must lie in \(0, 1\]"),
    (dict(noise_multiplier=1.0, steps=0), "steps must be at least 1"),
    (dict(noise_multiplier=1.0, delta=0.0), r"δ must lie in \(0, 1\)"),
    (dict(noise_multiplier=1.0, prior=1.0), r"prior κ must lie in \(0, 1\)"),
    (dict(noise_multiplier=1.0, level="user"), "unknown DP level"),
    (dict(noise_multiplier=1.0, max_reconstruction=1.5), "--max-reconstruction must lie in"),
])
def test_settings_no_accountant_can_take_are_refused(settings, message):
    with pytest.raises(UsageError, match=message):
        dp.validate(DPSettings(**settings))


# --- the attack -------------------------------------------------------------------------------------------------

def bayes_optimal(candidates: int, sigma: float) -> float:
    """∫ φ(z) Φ(z + 1/σ)^(M-1) dz: the best guess among M orthogonal candidates of norm c, one noisy step."""
    z = np.linspace(-12, 12, 24001)
    return float(np.trapezoid(norm.pdf(z) * norm.cdf(z + 1 / sigma) ** (candidates - 1), z))


@pytest.mark.parametrize("sigma, expected, bound", [(0.5, 0.674, 0.764), (1.0, 0.341, 0.389), (2.0, 0.199, 0.217)])
@pytest.mark.parametrize("draw_limit", [dp_full := 2 ** 28, 0], ids=["full-draw", "span-draw"])
def test_orthogonal_candidates_reach_the_bayes_optimal_success(sigma, expected, bound, draw_limit):
    """M = 10 candidates whose clipped gradients are orthogonal with norm c = 2; the known rest of the batch."""
    clip, candidates = 2.0, 10
    gradients = clip * torch.eye(candidates, 24, dtype=torch.float64)
    known = torch.randn((3, 24), generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    outcome = informed_attack(gradients, known, noise_multiplier=sigma, clip=clip, sample_rate=1.0, steps=1,
                              trials=3000, seed=11, full_draw_limit=draw_limit)
    assert outcome.draw == ("full" if draw_limit else "span")
    low, high = clopper_pearson(outcome.successes, outcome.trials)
    assert bayes_optimal(candidates, sigma) == pytest.approx(expected, abs=1e-3)
    assert low <= expected <= high
    assert dp.bound_at(sigma, 1.0, 1, 1 / candidates) == pytest.approx(bound, abs=1e-3)


def test_subsampled_steps_stay_below_the_bound():
    """q = 0.1 over T = 50 steps: the mixture likelihood's success stays under B(1/M)."""
    gradients = torch.eye(10, 12, dtype=torch.float64)
    outcome = informed_attack(gradients, None, noise_multiplier=1.0, clip=1.0, sample_rate=0.1, steps=50,
                              trials=2000, seed=3)
    low, high = clopper_pearson(outcome.successes, outcome.trials)
    bound = dp.bound_at(1.0, 0.1, 50, 0.1)
    assert low <= bound
    assert outcome.successes / outcome.trials > 0.2       # the attack works: far above the prior 0.1


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
    from rankaudit.verify.dp import verify_dp

    settings = DPSettings(noise_multiplier=sigma, clip=1.0)
    measured = verify_dp(lenet_result, str(EXAMPLES / "lenet.py"), settings, trials=1500, seed=0, device="cpu")
    assert measured["draw"] == "full" and measured["device"] == "cpu"
    assert measured["bound"] == pytest.approx(norm.cdf(norm.ppf(0.1) + 1 / sigma), abs=1e-3)
    assert measured["interval"][0] <= measured["success_rate"] <= measured["interval"][1]
    assert measured["interval"][0] <= measured["bound"]
    assert measured["success_rate"] > 0.1      # the noise does not hide everything: above the prior
    assert measured["internal_error"] is None
    assert lenet_result.verification["dp"] is measured
