"""Differential privacy (spec §13): the bound B(κ) on any reconstruction from a DP accountant's privacy profile."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from rankaudit.errors import UsageError
from rankaudit.result import DPBound
from rankaudit.round import DP_LEVELS, DPSettings

# The priors every DP section reports, as JSON keys; the user's --prior is added beside them.
REPORTED_PRIORS = ("0.1", "0.01", "0.001")
# κ values of the curve the HTML card draws: log-spaced, from one in ten thousand to even odds.
CURVE_PRIORS = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5)
# The PLD's loss grid. 1e-3 keeps T = 10,000 steps a fraction of a second; its pessimistic rounding moves the
# spec's reference bounds (computed at 1e-4) by under 0.5 % relative, always upwards.
DEFAULT_DISCRETIZATION = 1e-3
# ε search interval of the 1-D minimisation: the hockey-stick inequality P(E) <= e^ε Q(E) + δ(ε) holds for every
# real ε, so negative ε are admissible (they matter only for priors near even odds).
_EPSILON_FLOOR = -10.0
_EPSILON_CEILING = 60.0    # where the profile has mass at infinite loss above κ·1e-6
_EPSILON_TOLERANCE = 1e-6
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
INSTALL_HINT = 'pip install "rankaudit[dp]"'


@dataclass(frozen=True)
class SubsampledGaussian:
    """The mechanism both DP levels share: T compositions of a Gaussian of noise multiplier σ (sensitivity 1,
    the clip norm divides out) applied to a Poisson subsample of rate q."""

    noise_multiplier: float
    sample_rate: float
    steps: int


class PrivacyProfile(Protocol):
    """δ(ε) of a composed mechanism, upper bounds only (a pessimistic accountant)."""

    def delta(self, epsilon: float) -> float: ...

    def epsilon(self, delta: float) -> float: ...


class Accountant(Protocol):
    """What the bound needs from an accounting library: swap in another (Opacus' PRV, say) by implementing it."""

    name: str

    def profile(self, mechanism: SubsampledGaussian) -> PrivacyProfile: ...


class _PLDProfile:
    def __init__(self, distribution):
        self._distribution = distribution

    def delta(self, epsilon: float) -> float:
        # dp-accounting returns the larger of the add and remove directions: a bound for either neighbour.
        return float(self._distribution.get_delta_for_epsilon(epsilon))

    def epsilon(self, delta: float) -> float:
        return float(self._distribution.get_epsilon_for_delta(delta))


class PLDAccountant:
    """Google's dp-accounting privacy-loss distributions, pessimistic rounding on a loss grid of `discretization`."""

    def __init__(self, discretization: float = DEFAULT_DISCRETIZATION):
        self.discretization = discretization
        self.name = f"dp-accounting PLD (pessimistic, discretisation {discretization:g})"

    def profile(self, mechanism: SubsampledGaussian) -> PrivacyProfile:
        pld = _import_pld()
        distribution = pld.from_gaussian_mechanism(
            standard_deviation=mechanism.noise_multiplier, sensitivity=1.0, sampling_prob=mechanism.sample_rate,
            value_discretization_interval=self.discretization, pessimistic_estimate=True)
        if mechanism.steps > 1:
            distribution = distribution.self_compose(mechanism.steps)
        return _PLDProfile(distribution)


def _import_pld():
    try:
        from dp_accounting.pld import privacy_loss_distribution
    except ImportError as exc:
        raise UsageError("the differential-privacy bound needs Google's dp-accounting library, which is not "
                         "installed", INSTALL_HINT) from exc
    return privacy_loss_distribution


def reconstruction_bound(profile: PrivacyProfile, prior: float) -> float:
    """B(κ) = inf over ε of (e^ε κ + δ(ε)): no attack whose baseline success is κ succeeds more often.

    e^ε κ + δ(ε) is convex in t = e^ε (δ is a sum of hinge functions of t), so it is unimodal in ε and a
    golden-section search finds its minimum. Every value evaluated is itself a valid bound (the profile is
    pessimistic), so the smallest one evaluated is reported: never below the true infimum.
    """
    if not 0.0 < prior < 1.0:
        raise ValueError(f"the prior must lie in (0, 1), got {prior}")

    def value(epsilon: float) -> float:
        return math.exp(epsilon) * prior + profile.delta(epsilon)

    # Past the ε at which δ(ε) <= κ·1e-6, e^ε κ + δ(ε) exceeds its value there by at most a millionth: the search
    # can stop. (The interval only decides how tight the result is; every value evaluated is a valid bound.)
    high = profile.epsilon(prior * 1e-6)
    high = high + 1.0 if math.isfinite(high) else _EPSILON_CEILING
    low = _EPSILON_FLOOR
    left, right = high - _GOLDEN * (high - low), low + _GOLDEN * (high - low)
    f_left, f_right = value(left), value(right)
    best = min(value(0.0), f_left, f_right, value(high))
    while high - low > _EPSILON_TOLERANCE:
        if f_left < f_right:
            high, right, f_right = right, left, f_left
            left = high - _GOLDEN * (high - low)
            f_left = value(left)
            best = min(best, f_left)
        else:
            low, left, f_left = left, right, f_right
            right = low + _GOLDEN * (high - low)
            f_right = value(right)
            best = min(best, f_right)
    if not math.isfinite(best):
        raise ValueError("the accountant returned a non-finite δ(ε)")
    # No attack can do worse than guessing from the prior, and no probability exceeds 1.
    return min(max(best, prior), 1.0)


def validate(settings: DPSettings) -> None:
    """One-line errors for settings no accountant can take; the CLI and the config reader both call this."""
    checks = [
        (math.isfinite(settings.noise_multiplier) and settings.noise_multiplier > 0,
         f"the noise multiplier must be positive, got {settings.noise_multiplier:g}", "pass --dp-noise > 0, e.g. 1.0"),
        (math.isfinite(settings.clip) and settings.clip > 0,
         f"the clip norm must be positive, got {settings.clip:g}", "pass --dp-clip > 0, e.g. 1.0"),
        (0 < settings.sample_rate <= 1,
         f"the sample rate must lie in (0, 1], got {settings.sample_rate:g}",
         "pass --dp-sample-rate q with 0 < q <= 1 (batch size over dataset size; 1 for full batches)"),
        (settings.steps >= 1, f"the number of steps must be at least 1, got {settings.steps}", "pass --dp-steps >= 1"),
        (0 < settings.delta < 1, f"δ must lie in (0, 1), got {settings.delta:g}",
         "pass --dp-delta below one over the number of units, e.g. 1e-5"),
        (settings.level in DP_LEVELS, f"unknown DP level {settings.level!r}",
         "pass --dp-level " + " or ".join(DP_LEVELS)),
        (0 < settings.prior < 1, f"the prior κ must lie in (0, 1), got {settings.prior:g}",
         "pass --prior as an attack's success probability without the update, e.g. 0.01"),
        (settings.max_reconstruction is None or 0 < settings.max_reconstruction <= 1,
         f"--max-reconstruction must lie in (0, 1], got {settings.max_reconstruction}",
         "pass the highest acceptable success probability of a reconstruction, e.g. 0.05"),
    ]
    for ok, problem, fix in checks:
        if not ok:
            raise UsageError(problem, fix)


def mechanism_of(settings: DPSettings) -> SubsampledGaussian:
    """Both levels are the same mechanism; only the unit differs (a sample, or a client's whole update)."""
    return SubsampledGaussian(settings.noise_multiplier, settings.sample_rate, settings.steps)


def dp_bound(settings: DPSettings, accountant: Accountant | None = None, curve: bool = True) -> DPBound:
    """ε at the user's δ and B(κ) for the reported priors, the user's prior and (for the HTML card) a curve."""
    validate(settings)
    accountant = accountant or PLDAccountant()
    start = time.perf_counter()
    profile = accountant.profile(mechanism_of(settings))
    epsilon = profile.epsilon(settings.delta)
    bounds = {key: reconstruction_bound(profile, float(key)) for key in REPORTED_PRIORS}
    known = {float(key): value for key, value in bounds.items()}
    prior_bound = known.get(settings.prior)
    if prior_bound is None:
        prior_bound = reconstruction_bound(profile, settings.prior)
    points = [(kappa, known.get(kappa) or reconstruction_bound(profile, kappa)) for kappa in CURVE_PRIORS] \
        if curve else []
    return DPBound(level=settings.level, noise_multiplier=settings.noise_multiplier, clip=settings.clip,
                   sample_rate=settings.sample_rate, steps=settings.steps, delta=settings.delta,
                   epsilon=epsilon if math.isfinite(epsilon) else None, prior=settings.prior,
                   reconstruction_bound=prior_bound, bounds=bounds, accountant=accountant.name,
                   max_reconstruction=settings.max_reconstruction, curve=points,
                   seconds=round(time.perf_counter() - start, 3))


def bound_at(noise_multiplier: float, sample_rate: float, steps: int, prior: float,
             accountant: Accountant | None = None) -> float:
    """B(κ) of one mechanism: what the attack verifier and the noise search compare against."""
    profile = (accountant or PLDAccountant()).profile(SubsampledGaussian(noise_multiplier, sample_rate, steps))
    return reconstruction_bound(profile, prior)


# The noise search: σ below this floor makes the PLD's loss range (and its cost) explode; above the ceiling the
# bound is the prior to any precision that matters.
NOISE_FLOOR = 0.25
NOISE_CEILING = 256.0
NOISE_RELATIVE_TOLERANCE = 0.005


@dataclass(frozen=True)
class NoiseSuggestion:
    noise_multiplier: float | None    # the least σ found meeting the target; None: none up to NOISE_CEILING
    epsilon: float | None             # ε at δ of that σ
    bound: float | None               # B(κ) at that σ
    at_floor: bool                    # NOISE_FLOOR already meets the target: less noise may too
    evaluations: int


def least_noise(target: float, prior: float, sample_rate: float, steps: int, delta: float,
                accountant: Accountant | None = None) -> NoiseSuggestion:
    """The least noise multiplier σ with B(κ) <= target at this q and T, by bisection on log σ.

    B(κ) falls as σ grows (more noise, a dominated mechanism), so the set of σ meeting the target is an interval
    [σ*, ∞); the answer is the upper end of the final bracket, rounded up, so it always meets the target.
    """
    if not prior < target <= 1:
        raise UsageError(f"--max-reconstruction {target:g} is not above the prior {prior:g}: no amount of noise "
                         "brings an attack below guessing", "raise --max-reconstruction above --prior")
    accountant = accountant or PLDAccountant()
    evaluations = 0

    def meets(sigma: float) -> bool:
        nonlocal evaluations
        evaluations += 1
        return bound_at(sigma, sample_rate, steps, prior, accountant) <= target

    low, high = NOISE_FLOOR, 1.0
    if meets(high):
        if meets(low):
            return _suggestion(low, delta, sample_rate, steps, prior, accountant, True, evaluations)
    else:
        low = high
        while not meets(high * 2):
            high *= 2
            low = high
            if high * 2 > NOISE_CEILING:
                return NoiseSuggestion(None, None, None, False, evaluations)
        high *= 2
    while high / low > 1 + NOISE_RELATIVE_TOLERANCE:
        middle = math.sqrt(low * high)
        if meets(middle):
            high = middle
        else:
            low = middle
    sigma = math.ceil(high * 1000) / 1000
    return _suggestion(sigma, delta, sample_rate, steps, prior, accountant, False, evaluations)


def _suggestion(sigma, delta, sample_rate, steps, prior, accountant, at_floor, evaluations) -> NoiseSuggestion:
    profile = accountant.profile(SubsampledGaussian(sigma, sample_rate, steps))
    epsilon = profile.epsilon(delta)
    return NoiseSuggestion(sigma, epsilon if math.isfinite(epsilon) else None,
                           reconstruction_bound(profile, prior), at_floor, evaluations)
