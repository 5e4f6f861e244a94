"""The privacy accountant the DP settings are stated in: δ(ε) of the subsampled Gaussian, from Google's dp-accounting.

method.md: DP. The bound reads its privacy profile, and a target ε read from an app becomes a noise multiplier by it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from rankaudit import install_hint
from rankaudit.errors import UsageError

# The PLD's loss grid. Its pessimistic rounding errs by about C·Δ² (measured: Δ 1e-3 -> 1e-4 -> 1e-5
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
        pld = import_pld()
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


def import_pld():
    try:
        from dp_accounting.pld import privacy_loss_distribution
    except ImportError as exc:
        raise UsageError(
            "the differential-privacy bound needs Google's dp-accounting library, which is not installed", INSTALL_HINT
        ) from exc
    return privacy_loss_distribution
