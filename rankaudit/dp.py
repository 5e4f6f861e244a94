"""Differential privacy (spec §13): the bound B(κ) on any reconstruction from a DP accountant's privacy profile."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rankaudit.errors import UsageError
from rankaudit.result import DPBound, DPNoiseSuggestion
from rankaudit.round import DP_LEVELS, NOISE_BY, DPSettings, Round, dp_for_round

# The priors every DP section reports, as JSON keys; the user's --prior is added beside them.
REPORTED_PRIORS = ("0.1", "0.01", "0.001")
# κ values of the curve the HTML card draws: log-spaced, from one in ten thousand to even odds.
CURVE_PRIORS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 0.5)
# The PLD's loss grid. 1e-3 keeps T = 10,000 steps a fraction of a second; its pessimistic rounding moves the
# spec's reference bounds (computed at 1e-4) by under 0.5 % relative, always upwards.
DEFAULT_DISCRETIZATION = 1e-3
# ε range of the minimisation: the hockey-stick inequality P(E) <= e^ε Q(E) + δ(ε) holds for every real ε, so
# negative ε are admissible (they matter only for priors near even odds).
_EPSILON_FLOOR = -10.0
_EPSILON_CEILING = 60.0    # used where the profile keeps mass at infinite loss above κ·1e-6
# The golden-section search stops when its bracket is this narrow: far below the PLD's loss grid (1e-3), and the
# bounds agree with a search to 1e-6 in their first 6 digits on the spec's table.
_EPSILON_TOLERANCE = 1e-4
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


def reconstruction_bounds(profile: PrivacyProfile, priors: Sequence[float]) -> list[float]:
    """B(κ) = inf over ε of (e^ε κ + δ(ε)) for each κ: no attack whose baseline success is κ succeeds more often.

    e^ε κ + δ(ε) is convex in t = e^ε (δ is a sum of hinge functions of t), so it is unimodal in ε: a
    golden-section search over [_EPSILON_FLOOR, the ε at which δ(ε) <= κ·1e-6] finds its minimum (beyond that ε
    the objective only grows: e^ε κ does, δ >= 0). Every value evaluated is itself a valid bound (the profile is
    pessimistic), so the smallest one evaluated is reported: never below the true infimum.
    """
    with _one_blas_thread():
        return [_bound_at_prior(profile, float(prior)) for prior in priors]


def _bound_at_prior(profile: PrivacyProfile, prior: float) -> float:
    if not 0.0 < prior < 1.0:
        raise ValueError(f"the prior must lie in (0, 1), got {prior}")

    def value(epsilon: float) -> float:
        return math.exp(epsilon) * prior + profile.delta(epsilon)

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


def _one_blas_thread():
    """dp-accounting's δ(ε) is a dot product over the PLD (tens of thousands of values), one per search step:
    OpenBLAS's threads gain nothing there and, on a loaded machine, stall each call tenfold (measured: 1.4 s instead
    of 0.06 s for three priors at T = 10,000). threadpoolctl (in the [dp] extra) keeps BLAS on one thread for the
    search; without it the search runs as it is."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        return contextlib.nullcontext()
    return threadpool_limits(limits=1, user_api="blas")


def reconstruction_bound(profile: PrivacyProfile, prior: float) -> float:
    """B(κ) at one prior."""
    return reconstruction_bounds(profile, [prior])[0]


# The DP options: config key in [tool.rankaudit.dp] -> (DPSettings field, type, test, what a valid value is).
# The flag is --dp-KEY, except --prior and --max-reconstruction. One table for the flags, the config and validate().
OPTION_RULES = {
    "noise": ("noise_multiplier", float, lambda v: v > 0, "a number above 0", "1.0"),
    "clip": ("clip", float, lambda v: v > 0, "a number above 0", "1.0"),
    "sample-rate": ("sample_rate", float, lambda v: 0 < v <= 1,
                    "a rate in (0, 1] (batch size over dataset size; 1 for full batches)", "0.01"),
    "steps": ("steps", int, lambda v: v >= 1, "an integer >= 1", "1000"),
    "delta": ("delta", float, lambda v: 0 < v < 1, "a probability in (0, 1)", "1e-5"),
    "level": ("level", str, lambda v: v in DP_LEVELS, " or ".join(DP_LEVELS), "sample"),
    "prior": ("prior", float, lambda v: 0 < v < 1,
              "a probability in (0, 1) (an attack's success without the update)", "0.01"),
    "max-reconstruction": ("max_reconstruction", float, lambda v: 0 < v <= 1, "a probability in (0, 1]", "0.05"),
    "noise-by": ("noise_by", str, lambda v: v in NOISE_BY, " or ".join(NOISE_BY), "client"),
}
# Without a noise multiplier there is no mechanism; these keys only make sense with one.
_NEEDS_NOISE = ("clip", "sample-rate", "steps", "delta", "level", "prior", "max-reconstruction", "noise-by")


def flag_name(key: str) -> str:
    return f"--{key}" if key in ("prior", "max-reconstruction", "noise-by") else f"--dp-{key}"


def check_option(key: str, value, where: str | None = None):
    """`value` for option `key`, or a one-line UsageError naming it (`where`: the config file, else the flag)."""
    field, kind, test, expected, example = OPTION_RULES[key]
    name = f"{where}: [tool.rankaudit.dp] {key}" if where else flag_name(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    valid = isinstance(value, kind) and not isinstance(value, bool)
    if valid and kind is float:
        valid = math.isfinite(value)
    if not valid or not test(value):
        written = f'"{example}"' if kind is str else example      # as TOML writes it
        fix = f"set e.g. {key} = {written} in {where}" if where else f"pass e.g. {flag_name(key)} {example}"
        raise UsageError(f"{name} must be {expected}, got {value!r}", fix)
    return value


def settings_from(options: dict) -> DPSettings | None:
    """DPSettings from checked option values keyed as in OPTION_RULES (flags already merged over the config);
    None without any. DP keys without a noise multiplier are an error: there is no mechanism to bound."""
    if "noise" not in options:
        orphans = [flag_name(key) for key in _NEEDS_NOISE if key in options]
        if orphans:
            raise UsageError(f"{', '.join(orphans)} given without a noise multiplier: no DP mechanism to bound",
                             "add --dp-noise σ (or noise = σ in [tool.rankaudit.dp])")
        return None
    settings = DPSettings(**{OPTION_RULES[key][0]: value for key, value in options.items()})
    validate(settings)
    return settings


def noise_search(options: dict, round_: Round | None = None,
                 given: dict[str, str] | None = None) -> DPNoiseSuggestion | None:
    """`suggest`'s DP request from checked options (keyed as OPTION_RULES): None without any; the least noise
    meeting max-reconstruction otherwise, at the given (or default) δ and prior, and at the q and T of `round_`
    (default: FedSGD) unless `given` names them (DPSettings field -> where given; round.dp_for_round). The noise
    itself is ignored: it is what is searched."""
    if not options:
        return None
    if "max-reconstruction" not in options:
        raise UsageError("suggest with DP options searches the least noise meeting a ceiling, but none is given",
                         "add --max-reconstruction P (e.g. 0.05)")
    defaults = DPSettings(noise_multiplier=1.0)
    value = {key: options.get(key, getattr(defaults, field)) for key, (field, *_) in OPTION_RULES.items()}
    settings = dp_for_round(round_ or Round(), DPSettings(noise_multiplier=1.0, sample_rate=value["sample-rate"],
                                                          steps=value["steps"], level=value["level"]), given or {})
    found = least_noise(value["max-reconstruction"], value["prior"], settings.sample_rate, settings.steps,
                        value["delta"], value["level"])
    return dataclasses.replace(found, sample_rate_source=settings.sample_rate_source,
                               steps_source=settings.steps_source, notes=list(settings.notes))


def validate(settings: DPSettings) -> None:
    """One-line errors for settings no accountant can take (every field by OPTION_RULES, and the prior below the
    ceiling); the CLI, the config reader and the library calls share it."""
    for key, (field, *_) in OPTION_RULES.items():
        value = getattr(settings, field)
        if value is not None:
            check_option(key, value)
    if settings.max_reconstruction is not None:
        _check_ceiling(settings.max_reconstruction, settings.prior)


def _check_ceiling(ceiling: float, prior: float) -> None:
    """B(κ) >= κ for every mechanism: a ceiling at or below the prior can never be met."""
    if not prior < ceiling <= 1:
        raise UsageError(f"--max-reconstruction {ceiling:g} is not above the prior {prior:g}: no amount of noise "
                         "brings an attack below guessing", "raise --max-reconstruction above --prior")


def mechanism_of(settings: DPSettings) -> SubsampledGaussian:
    """Both levels are the same mechanism; only the unit differs (a sample, or a client's whole update)."""
    return SubsampledGaussian(settings.noise_multiplier, settings.sample_rate, settings.steps)


def dp_bound(settings: DPSettings, accountant: Accountant | None = None, curve: bool = True) -> DPBound:
    """ε at the user's δ and B(κ) for the reported priors, the user's prior and (for the HTML card) a curve."""
    validate(settings)
    accountant = accountant or PLDAccountant()
    if isinstance(accountant, PLDAccountant):
        _import_pld()     # its import (scipy's, mostly) takes a second or more: not part of the computation's time
    start = time.perf_counter()
    profile = accountant.profile(mechanism_of(settings))
    epsilon = profile.epsilon(settings.delta)
    reported = [float(key) for key in REPORTED_PRIORS]
    priors = sorted({*reported, settings.prior, *(CURVE_PRIORS if curve else ())})
    bound_of = dict(zip(priors, reconstruction_bounds(profile, priors)))
    bounds = {key: bound_of[float(key)] for key in REPORTED_PRIORS}
    prior_bound = bound_of[settings.prior]
    points = [(kappa, bound_of[kappa]) for kappa in CURVE_PRIORS] if curve else []
    return DPBound(level=settings.level, noise_multiplier=settings.noise_multiplier, clip=settings.clip,
                   sample_rate=settings.sample_rate, steps=settings.steps, delta=settings.delta,
                   epsilon=epsilon if math.isfinite(epsilon) else None, prior=settings.prior,
                   reconstruction_bound=prior_bound, bounds=bounds, accountant=accountant.name,
                   max_reconstruction=settings.max_reconstruction, curve=points, noise_by=settings.noise_by,
                   seconds=round(time.perf_counter() - start, 3), sample_rate_source=settings.sample_rate_source,
                   steps_source=settings.steps_source, notes=list(settings.notes))


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


def least_noise(target: float, prior: float, sample_rate: float, steps: int, delta: float, level: str = "sample",
                accountant: Accountant | None = None) -> DPNoiseSuggestion:
    """The least noise multiplier σ with B(κ) <= target at this q and T, by bisection on log σ.

    B(κ) falls as σ grows (more noise, a dominated mechanism), so the σ meeting the target form an interval
    [σ*, ∞); the answer is the upper end of the final bracket rounded up to 3 decimals, so it always meets it.
    """
    _check_ceiling(target, prior)
    accountant = accountant or PLDAccountant()
    start = time.perf_counter()
    search = (f"bisection on log σ over [{NOISE_FLOOR:g}, {NOISE_CEILING:g}] to {NOISE_RELATIVE_TOLERANCE:.1%} "
              "relative, rounded up to 0.001")

    def meets(sigma: float) -> bool:
        return bound_at(sigma, sample_rate, steps, prior, accountant) <= target

    def answer(sigma: float | None, at_floor: bool = False) -> DPNoiseSuggestion:
        epsilon = bound = None
        if sigma is not None:
            profile = accountant.profile(SubsampledGaussian(sigma, sample_rate, steps))
            epsilon, bound = profile.epsilon(delta), reconstruction_bound(profile, prior)
            epsilon = epsilon if math.isfinite(epsilon) else None
        return DPNoiseSuggestion(target, prior, sample_rate, steps, delta, level, accountant.name, sigma, epsilon,
                                 bound, at_floor, search, round(time.perf_counter() - start, 3))

    low, high = NOISE_FLOOR, 1.0
    if meets(high):
        if meets(low):
            return answer(low, at_floor=True)
    else:
        while not meets(high * 2):
            high *= 2
            if high * 2 > NOISE_CEILING:
                return answer(None)
        low, high = high, high * 2
    while high / low > 1 + NOISE_RELATIVE_TOLERANCE:
        middle = math.sqrt(low * high)
        if meets(middle):
            high = middle
        else:
            low = middle
    return answer(math.ceil(high * 1000) / 1000)
