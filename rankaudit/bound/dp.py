"""Differential privacy (spec §13): the bound B(κ) on any reconstruction from a DP accountant's privacy profile."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from rankaudit import install_hint
from rankaudit.errors import UsageError
from rankaudit.result import DPBound, DPNoiseSuggestion
from rankaudit.settings.round import DP_LEVELS, NOISE_BY, DPSettings, Round, dp_for_round

# The priors every DP section reports, as JSON keys; the user's --prior is added beside them.
REPORTED_PRIORS = ("0.1", "0.01", "0.001")
# κ values of the curve the HTML card draws: log-spaced, from one in ten thousand to even odds.
CURVE_PRIORS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 0.5)
# The PLD's loss grid (issue 23). Its pessimistic rounding errs by about C·Δ² (measured: Δ 1e-3 -> 1e-4 -> 1e-5
# shrinks ε's excess ~60x then ~100x), with C growing as one step's privacy loss shrinks: a fixed 1e-3 was within
# 0.5 % at q = 1 but 85-108 % loose in ε at q = 0.001. So Δ follows the spread s of one step's loss: s/8 keeps ε and
# B(κ) within 0.25 % of a 10x finer grid (benchmarks/bench_dp_accuracy.py); where the PLD stays small (under
# _CHEAP_POINTS values) the grid is finer still, min(1e-3, s/20), which costs nothing there.
DEFAULT_DISCRETIZATION = 1e-3
_GRID_PER_LOSS_SPREAD = 8
_FINE_GRID_PER_LOSS_SPREAD = 20
_CHEAP_POINTS = 50_000
# The accountant's arrays: past this many loss values (8 MB a PLD, about a second to compose) the grid is widened
# (grid_for), and past _MAX_COARSENING times the user is told the largest T it can hold at this q and σ.
MAX_LOSS_POINTS = 1_000_000
_MAX_COARSENING = 10.0
# Width of a composed PLD in spreads of its loss (√T·spread per side; dp-accounting truncates the tails at 1e-15):
# measured 17 at q = 1 (T = 10,000, σ = 0.5) and 15-19 at q = 0.01.
_COMPOSED_WIDTH = 20.0
# ε range of the minimisation: the hockey-stick inequality P(E) <= e^ε Q(E) + δ(ε) holds for every real ε, so
# negative ε are admissible (they matter only for priors near even odds).
_EPSILON_FLOOR = -10.0
# δ(ε) is read at this many ε in one vectorised pass (a grid step of about 0.01 for κ = 1e-4) to place the search,
# then refined by golden section.
_EPSILON_GRID_POINTS = 2001
# The golden-section search stops when its bracket is this narrow: well below the PLD's loss grid at the spec's
# rows, and the bounds agree with a search to 1e-6 in their first 6 digits on the spec's table.
_EPSILON_TOLERANCE = 1e-4
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0
INSTALL_HINT = install_hint("dp")


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
    """δ(ε) from dp-accounting's PLD, capped by the chance the unit is used at all (both are upper bounds)."""

    def __init__(self, distribution, used_at_all: float, description: str):
        self._distribution = distribution
        self._used = _UsedAtAllProfile(used_at_all, description)
        self.description = description

    def delta(self, epsilon: float) -> float:
        # dp-accounting returns the larger of the add and remove directions: a bound for either neighbour.
        return min(float(self._distribution.get_delta_for_epsilon(epsilon)), self._used.delta(epsilon))

    def deltas(self, epsilons):
        """δ at many sorted ε, to place the search (the reported bound is re-evaluated with delta()): dp-accounting's
        own vectorised δ is a Python loop over the PLD (seconds at a million losses), so the hockey-stick sums are
        read off its dense PMFs with numpy; a library without those attributes falls back to delta() per ε."""
        import numpy as np

        epsilons = np.asarray(epsilons, dtype=float)
        try:
            pmfs = [self._distribution._pmf_remove]
            if not self._distribution._symmetric:
                pmfs.append(self._distribution._pmf_add)
            found = np.max([_hockey_stick(pmf.to_dense_pmf(), epsilons) for pmf in pmfs], axis=0)
        except AttributeError:
            found = np.array([float(self._distribution.get_delta_for_epsilon(e)) for e in epsilons])
        return np.minimum(found, self._used.deltas(epsilons))

    def epsilon(self, delta: float) -> float:
        return min(float(self._distribution.get_epsilon_for_delta(delta)), self._used.epsilon(delta))


def _hockey_stick(pmf, epsilons):
    """δ(ε) = m∞ + Σ_{ℓ>ε} p_ℓ (1 - e^{ε-ℓ}) for sorted ε, from suffix sums of p and p·e^{-ℓ} over the loss grid."""
    import numpy as np

    losses = (np.arange(len(pmf._probs)) + pmf._lower_loss) * pmf._discretization
    probs = np.asarray(pmf._probs, dtype=float)
    floor = float(epsilons.min())
    # Losses at or below the smallest ε never enter a sum; dropping them keeps e^{-ℓ} from overflowing.
    keep = losses > floor
    losses, probs = losses[keep], probs[keep]
    mass = np.append(np.cumsum(probs[::-1])[::-1], 0.0)
    weighted = np.append(np.cumsum((probs * np.exp(-losses))[::-1])[::-1], 0.0)
    first = np.searchsorted(losses, epsilons, side="right")
    return np.maximum(pmf._infinity_mass + mass[first] - np.exp(epsilons) * weighted[first], 0.0)


class _UsedAtAllProfile:
    """The profile of a mechanism known only to leave the output alone unless the unit is drawn: with u the chance
    it is drawn in any of the T steps, the total variation is at most u, so δ(ε) <= u + max(0, 1 - e^ε) (P(E) <=
    Q(E) + u). Sound for any σ; all there is where σ is too small for the PLD's grid, where it is also tight (a
    noiseless step reveals the unit exactly when it is drawn)."""

    def __init__(self, used_at_all: float, description: str):
        self.used_at_all = used_at_all
        self.description = description

    def delta(self, epsilon: float) -> float:
        return min(1.0, self.used_at_all + max(0.0, -math.expm1(epsilon)))

    def deltas(self, epsilons):
        import numpy as np

        return np.minimum(1.0, self.used_at_all + np.maximum(0.0, -np.expm1(np.asarray(epsilons, dtype=float))))

    def epsilon(self, delta: float) -> float:
        return 0.0 if delta >= self.used_at_all else math.inf


def used_at_all(mechanism: SubsampledGaussian) -> float:
    """1 - (1 - q)^T: the chance a unit takes part in at least one of the T steps."""
    return -math.expm1(mechanism.steps * math.log1p(-mechanism.sample_rate)) if mechanism.sample_rate < 1 else 1.0


def _loss_moments(noise_multiplier: float, sample_rate: float) -> tuple[float, float]:
    """(standard deviation, width) of one step's privacy loss (remove direction, the wider one), by quadrature over
    the noisy output x ~ (1-q)·N(0, σ²) + q·N(1, σ²): what the PLD's grid has to resolve, and how far it reaches."""
    import numpy as np

    sigma, q = noise_multiplier, sample_rate
    floor = math.log1p(-q) if q < 1 else -math.inf

    def loss_at(x):  # the loss is increasing in x: log((1-q) + q·N(1, σ²)/N(0, σ²) at x)
        return np.logaddexp(floor, math.log(q) + (2 * x - 1) / (2 * sigma * sigma))

    width = float(loss_at(np.float64(1 + 12 * sigma)) - loss_at(np.float64(-12 * sigma)))
    if not width < MAX_LOSS_POINTS * DEFAULT_DISCRETIZATION:
        return math.inf, width  # no grid of the accountant's holds one step: nothing more to measure
    x = np.linspace(-12 * sigma, 1 + 12 * sigma, 40_001)
    loss = loss_at(x)
    density = (1 - q) * np.exp(-x * x / (2 * sigma * sigma)) + q * np.exp(-((x - 1) ** 2) / (2 * sigma * sigma))
    density /= density.sum()
    mean = float((density * loss).sum())
    spread = math.sqrt(max(float((density * (loss - mean) ** 2).sum()), 0.0))
    return spread, width


@dataclass(frozen=True)
class Grid:
    """The PLD's loss grid for one mechanism, and whether the accountant can hold it."""

    discretization: float
    fits: bool
    coarsened: bool  # Δ widened past the accuracy rule to fit MAX_LOSS_POINTS (still sound, looser)
    max_steps: int  # the largest T the accountant holds at this q and σ


def grid_for(mechanism: SubsampledGaussian, discretization: float | None = None) -> Grid:
    """Δ from one step's loss spread s: min(1e-3, s/20) where that PLD stays under _CHEAP_POINTS values, widened
    towards s/8 where it would not; or `discretization` when given.

    The composed PLD spans about one step's loss width, or _COMPOSED_WIDTH·√T spreads, over Δ values. Past
    MAX_LOSS_POINTS, Δ is widened up to _MAX_COARSENING times (pessimistic rounding stays sound, only looser; where
    that happens the bound is 1 or close to it, ε in the hundreds); past that the accountant cannot hold it."""
    spread, width = _loss_moments(mechanism.noise_multiplier, mechanism.sample_rate)
    if not math.isfinite(spread):
        return Grid(discretization or DEFAULT_DISCRETIZATION, False, False, 0)
    span = max(width, _COMPOSED_WIDTH * math.sqrt(mechanism.steps) * spread)
    if discretization is None and spread > 0:
        accurate = spread / _GRID_PER_LOSS_SPREAD
        fine = min(DEFAULT_DISCRETIZATION, spread / _FINE_GRID_PER_LOSS_SPREAD)
        discretization = min(accurate, max(fine, span / _CHEAP_POINTS))
    discretization = discretization or DEFAULT_DISCRETIZATION
    coarsest = discretization * _MAX_COARSENING
    max_steps = int(min((MAX_LOSS_POINTS * coarsest / (_COMPOSED_WIDTH * spread)) ** 2, 1e18)) if spread else 10**18
    if span <= MAX_LOSS_POINTS * discretization:
        return Grid(discretization, True, False, max_steps)
    needed = span / MAX_LOSS_POINTS
    return Grid(needed, needed <= coarsest, True, max_steps)


class PLDAccountant:
    """Google's dp-accounting privacy-loss distributions, pessimistic rounding on a loss grid fitted to the
    mechanism (grid_for) unless `discretization` fixes it."""

    def __init__(self, discretization: float | None = None):
        self.discretization = discretization
        fixed = f"{discretization:g}" if discretization else "fitted to one step's loss spread"
        self.name = f"dp-accounting PLD (pessimistic, discretisation {fixed})"

    def profile(self, mechanism: SubsampledGaussian) -> PrivacyProfile:
        pld = _import_pld()
        used = used_at_all(mechanism)
        composed = mechanism
        if mechanism.sample_rate >= 1.0 and mechanism.steps > 1:
            # T Gaussian steps compose to one Gaussian of noise σ/√T exactly: no grid error piles up over T.
            composed = SubsampledGaussian(mechanism.noise_multiplier / math.sqrt(mechanism.steps), 1.0, 1)
        grid = grid_for(composed, self.discretization)
        if not grid.fits:
            if grid_for(
                SubsampledGaussian(composed.noise_multiplier, composed.sample_rate, 1), self.discretization
            ).fits:
                raise UsageError(
                    f"--dp-steps {mechanism.steps:,} is more than the DP accountant can hold at noise "
                    f"{mechanism.noise_multiplier:g} and sample rate {mechanism.sample_rate:g}: at most "
                    f"{grid.max_steps:,} steps",
                    f"lower --dp-steps (steps in [tool.rankaudit.dp]) to {grid.max_steps:,} or fewer, or raise "
                    "--dp-noise",
                )
            # σ so small that one step's loss outgrows the grid: the noise bounds nothing beyond whether the unit
            # is drawn at all, and that bound is tight as σ -> 0.
            return _UsedAtAllProfile(
                used,
                "noise too small for the PLD accountant's grid (σ, or σ/√T over T steps at q = 1): δ(ε) from the chance "
                f"1-(1-q)^T = {used:.3g} that the unit is used at all",
            )
        distribution = pld.from_gaussian_mechanism(
            standard_deviation=composed.noise_multiplier,
            sensitivity=1.0,
            sampling_prob=composed.sample_rate,
            value_discretization_interval=grid.discretization,
            pessimistic_estimate=True,
        )
        if composed.steps > 1:
            distribution = distribution.self_compose(composed.steps)
        looser = ", widened to fit: looser than the default grid" if grid.coarsened else ""
        return _PLDProfile(
            distribution, used, f"dp-accounting PLD (pessimistic, discretisation {grid.discretization:.3g}{looser})"
        )


def _import_pld():
    try:
        from dp_accounting.pld import privacy_loss_distribution
    except ImportError as exc:
        raise UsageError(
            "the differential-privacy bound needs Google's dp-accounting library, which is not installed", INSTALL_HINT
        ) from exc
    return privacy_loss_distribution


def reconstruction_bounds(profile: PrivacyProfile, priors: Sequence[float]) -> list[float]:
    """B(κ) = inf over ε of (e^ε κ + δ(ε)) for each κ: no attack whose baseline success is κ succeeds more often.

    Past ε = log(1/κ) the term e^ε·κ alone is >= 1, which B never exceeds, so the infimum lies in [_EPSILON_FLOOR,
    log(1/κ)] (and e^ε cannot overflow, however large the profile's ε: issue 23). δ(ε) is read on a grid of that
    range in one vectorised call for every prior, then the objective, convex in t = e^ε (δ is a sum of hinge
    functions of t) and so unimodal in ε, is narrowed by golden section between the grid minimum's neighbours.
    Every value evaluated is itself a valid bound (the profile is pessimistic), so the smallest one evaluated is
    reported: never below the true infimum.
    """
    import numpy as np

    priors = [float(prior) for prior in priors]
    for prior in priors:
        if not 0.0 < prior < 1.0:
            raise ValueError(f"the prior must lie in (0, 1), got {prior}")
    if not priors:
        return []
    with _one_blas_thread():
        grid = np.unique(np.append(np.linspace(_EPSILON_FLOOR, -math.log(min(priors)), _EPSILON_GRID_POINTS), 0.0))
        deltas = _deltas(profile, grid)
        if not np.all(np.isfinite(deltas)):
            raise ValueError("the accountant returned a non-finite δ(ε)")
        return [_bound_at_prior(profile, prior, grid, deltas) for prior in priors]


def _deltas(profile: PrivacyProfile, epsilons):
    import numpy as np

    many = getattr(profile, "deltas", None)
    if many is not None:
        return np.asarray(many(epsilons), dtype=float)
    return np.array([profile.delta(float(epsilon)) for epsilon in epsilons])


def _bound_at_prior(profile: PrivacyProfile, prior: float, grid, deltas) -> float:
    import numpy as np

    def value(epsilon: float) -> float:
        return math.exp(epsilon) * prior + profile.delta(epsilon)

    inside = grid <= -math.log(prior)
    located = np.exp(grid[inside]) * prior + deltas[inside]
    index = int(np.argmin(located))
    if located[index] >= 1.0:
        return 1.0  # the trivial bound, sound whatever the grid's rounding: no search needed
    best = value(float(grid[index]))  # the grid only places the search: every reported value is delta()'s
    low, high = float(grid[max(index - 1, 0)]), float(grid[min(index + 1, int(inside.sum()) - 1)])
    left, right = high - _GOLDEN * (high - low), low + _GOLDEN * (high - low)
    f_left, f_right = value(left), value(right)
    best = min(best, f_left, f_right)
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
    "sample-rate": (
        "sample_rate",
        float,
        lambda v: 0 < v <= 1,
        "a rate in (0, 1] (batch size over dataset size; 1 for full batches)",
        "0.01",
    ),
    "steps": ("steps", int, lambda v: v >= 1, "an integer >= 1", "1000"),
    "delta": ("delta", float, lambda v: 0 < v < 1, "a probability in (0, 1)", "1e-5"),
    "level": ("level", str, lambda v: v in DP_LEVELS, " or ".join(DP_LEVELS), "sample"),
    "prior": (
        "prior",
        float,
        lambda v: 0 < v < 1,
        "a probability in (0, 1) (an attack's success without the update)",
        "0.01",
    ),
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
        written = f'"{example}"' if kind is str else example  # as TOML writes it
        fix = f"set e.g. {key} = {written} in {where}" if where else f"pass e.g. {flag_name(key)} {example}"
        raise UsageError(f"{name} must be {expected}, got {value!r}", fix)
    return value


def settings_from(options: dict) -> DPSettings | None:
    """DPSettings from checked option values keyed as in OPTION_RULES (flags already merged over the config);
    None without any. DP keys without a noise multiplier are an error: there is no mechanism to bound."""
    if "noise" not in options:
        orphans = [flag_name(key) for key in _NEEDS_NOISE if key in options]
        if orphans:
            raise UsageError(
                f"{', '.join(orphans)} given without a noise multiplier: no DP mechanism to bound",
                "add --dp-noise σ (or noise = σ in [tool.rankaudit.dp])",
            )
        return None
    settings = DPSettings(**{OPTION_RULES[key][0]: value for key, value in options.items()})
    validate(settings)
    return settings


def noise_search(
    options: dict, round_: Round | None = None, given: dict[str, str] | None = None
) -> DPNoiseSuggestion | None:
    """`suggest`'s DP request from checked options (keyed as OPTION_RULES): None without any; the least noise
    meeting max-reconstruction otherwise, at the given (or default) δ and prior, and at the q and T of `round_`
    (default: FedSGD) unless `given` names them (DPSettings field -> where given; round.dp_for_round). The noise
    itself is ignored: it is what is searched."""
    if not options:
        return None
    if "max-reconstruction" not in options:
        raise UsageError(
            "suggest with DP options searches the least noise meeting a ceiling, but none is given",
            "add --max-reconstruction P (e.g. 0.05)",
        )
    defaults = DPSettings(noise_multiplier=1.0)
    value = {key: options.get(key, getattr(defaults, field)) for key, (field, *_) in OPTION_RULES.items()}
    settings = dp_for_round(
        round_ or Round(),
        DPSettings(noise_multiplier=1.0, sample_rate=value["sample-rate"], steps=value["steps"], level=value["level"]),
        given or {},
    )
    found = least_noise(
        value["max-reconstruction"],
        value["prior"],
        settings.sample_rate,
        settings.steps,
        value["delta"],
        value["level"],
    )
    return dataclasses.replace(
        found,
        sample_rate_source=settings.sample_rate_source,
        steps_source=settings.steps_source,
        notes=list(settings.notes),
    )


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
        raise UsageError(
            f"--max-reconstruction {ceiling:g} is not above the prior {prior:g}: no amount of noise "
            "brings an attack below guessing",
            "raise --max-reconstruction above --prior",
        )


def mechanism_of(settings: DPSettings) -> SubsampledGaussian:
    """Both levels are the same mechanism; only the unit differs (a sample, or a client's whole update)."""
    return SubsampledGaussian(settings.noise_multiplier, settings.sample_rate, settings.steps)


def dp_bound(settings: DPSettings, accountant: Accountant | None = None, curve: bool = True) -> DPBound:
    """ε at the user's δ and B(κ) for the reported priors, the user's prior and (for the HTML card) a curve."""
    validate(settings)
    accountant = accountant or PLDAccountant()
    if isinstance(accountant, PLDAccountant):
        _import_pld()  # its import (scipy's, mostly) takes a second or more: not part of the computation's time
    start = time.perf_counter()
    profile = accountant.profile(mechanism_of(settings))
    epsilon = profile.epsilon(settings.delta)
    reported = [float(key) for key in REPORTED_PRIORS]
    priors = sorted({*reported, settings.prior, *(CURVE_PRIORS if curve else ())})
    bound_of = dict(zip(priors, reconstruction_bounds(profile, priors)))
    bounds = {key: bound_of[float(key)] for key in REPORTED_PRIORS}
    prior_bound = bound_of[settings.prior]
    points = [(kappa, bound_of[kappa]) for kappa in CURVE_PRIORS] if curve else []
    return DPBound(
        level=settings.level,
        noise_multiplier=settings.noise_multiplier,
        clip=settings.clip,
        sample_rate=settings.sample_rate,
        steps=settings.steps,
        delta=settings.delta,
        epsilon=epsilon if math.isfinite(epsilon) else None,
        prior=settings.prior,
        reconstruction_bound=prior_bound,
        bounds=bounds,
        accountant=getattr(profile, "description", accountant.name),
        max_reconstruction=settings.max_reconstruction,
        curve=points,
        noise_by=settings.noise_by,
        seconds=round(time.perf_counter() - start, 3),
        sample_rate_source=settings.sample_rate_source,
        steps_source=settings.steps_source,
        notes=list(settings.notes),
    )


def bound_at(
    noise_multiplier: float, sample_rate: float, steps: int, prior: float, accountant: Accountant | None = None
) -> float:
    """B(κ) of one mechanism: what the attack verifier and the noise search compare against."""
    profile = (accountant or PLDAccountant()).profile(SubsampledGaussian(noise_multiplier, sample_rate, steps))
    return reconstruction_bound(profile, prior)


# The noise search: σ below this floor makes the PLD's loss range (and its cost) explode; above the ceiling the
# bound is the prior to any precision that matters.
NOISE_FLOOR = 0.25
NOISE_CEILING = 256.0
NOISE_RELATIVE_TOLERANCE = 0.005


def least_noise(
    target: float,
    prior: float,
    sample_rate: float,
    steps: int,
    delta: float,
    level: str = "sample",
    accountant: Accountant | None = None,
) -> DPNoiseSuggestion:
    """The least noise multiplier σ with B(κ) <= target at this q and T, by bisection on log σ.

    B(κ) falls as σ grows (more noise, a dominated mechanism), so the σ meeting the target form an interval
    [σ*, ∞); the answer is the upper end of the final bracket rounded up to 3 decimals, so it always meets it.
    """
    _check_ceiling(target, prior)
    accountant = accountant or PLDAccountant()
    start = time.perf_counter()
    search = (
        f"bisection on log σ over [{NOISE_FLOOR:g}, {NOISE_CEILING:g}] to {NOISE_RELATIVE_TOLERANCE:.1%} "
        "relative, rounded up to 0.001"
    )

    def meets(sigma: float) -> bool:
        return bound_at(sigma, sample_rate, steps, prior, accountant) <= target

    def answer(sigma: float | None, at_floor: bool = False) -> DPNoiseSuggestion:
        epsilon = bound = None
        if sigma is not None:
            profile = accountant.profile(SubsampledGaussian(sigma, sample_rate, steps))
            epsilon, bound = profile.epsilon(delta), reconstruction_bound(profile, prior)
            epsilon = epsilon if math.isfinite(epsilon) else None
        return DPNoiseSuggestion(
            target,
            prior,
            sample_rate,
            steps,
            delta,
            level,
            accountant.name,
            sigma,
            epsilon,
            bound,
            at_floor,
            search,
            round(time.perf_counter() - start, 3),
        )

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
