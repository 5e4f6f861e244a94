"""Differential privacy (method.md: DP): the bound B(κ) on any reconstruction from a DP accountant's privacy profile."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Sequence

from rankaudit.errors import UsageError
from rankaudit.result import DPBound, DPNoiseSuggestion
from rankaudit.settings.accountant import Accountant, PLDAccountant, PrivacyProfile, SubsampledGaussian, import_pld
from rankaudit.settings.dp_options import OPTION_RULES, check_ceiling, validate
from rankaudit.settings.round import DPSettings, Round, dp_for_round

# The priors every DP section reports, as JSON keys; the user's --prior is added beside them.
REPORTED_PRIORS = ("0.1", "0.01", "0.001")
# κ values of the curve the HTML card draws: log-spaced, from one in ten thousand to even odds.
CURVE_PRIORS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 0.5)
# ε range of the minimisation: the hockey-stick inequality P(E) <= e^ε Q(E) + δ(ε) holds for every real ε, so
# negative ε are admissible (they matter only for priors near even odds).
_EPSILON_FLOOR = -10.0
# δ(ε) is read at this many ε in one vectorised pass (a grid step of about 0.01 for κ = 1e-4) to place the search,
# then refined by golden section.
_EPSILON_GRID_POINTS = 2001
# The golden-section search stops when its bracket is this narrow: well below the PLD's loss grid at the reference
# rows, and the bounds agree with a search to 1e-6 in their first 6 digits on the reference table (method.md: DP).
_EPSILON_TOLERANCE = 1e-4
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def reconstruction_bounds(profile: PrivacyProfile, priors: Sequence[float]) -> list[float]:
    """B(κ) = inf over ε of (e^ε κ + δ(ε)) for each κ: no attack whose baseline success is κ succeeds more often.

    Past ε = log(1/κ) the term e^ε·κ alone is >= 1, which B never exceeds, so the infimum lies in [_EPSILON_FLOOR,
    log(1/κ)] (and e^ε cannot overflow, however large the profile's ε). δ(ε) is read on a grid of that
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


def noise_search(
    options: dict, round_: Round | None = None, given: dict[str, str] | None = None
) -> DPNoiseSuggestion | None:
    """`suggest`'s DP request from checked options (keyed as OPTION_RULES): None without any; the least noise
    meeting max-reconstruction otherwise, at the given (or default) δ and prior, and at the q and T of `round_`
    (default: FedSGD) unless `given` names them (DPSettings field -> where given; round.dp_for_round). The noise
    itself is ignored: it is what is searched."""
    if not options:
        return None
    target_epsilon = options.get("target-epsilon")
    if "max-reconstruction" not in options and target_epsilon is None:
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
    if "max-reconstruction" in options:
        found = least_noise(
            value["max-reconstruction"],
            value["prior"],
            settings.sample_rate,
            settings.steps,
            value["delta"],
            value["level"],
        )
    else:  # only a target ε: no ceiling on B(κ) to search for
        found = DPNoiseSuggestion(
            None,
            value["prior"],
            settings.sample_rate,
            settings.steps,
            value["delta"],
            value["level"],
            PLDAccountant().name,
            None,
            None,
            None,
            False,
            "",
        )
    if target_epsilon is not None:
        sigma, at_floor = noise_for_epsilon(target_epsilon, settings.sample_rate, settings.steps, value["delta"])
        found = dataclasses.replace(
            found,
            target_epsilon=target_epsilon,
            epsilon_noise=sigma,
            epsilon_noise_bound=bound_at(sigma, settings.sample_rate, settings.steps, value["prior"])
            if sigma is not None
            else None,
            epsilon_at_floor=at_floor,
        )
    return dataclasses.replace(
        found,
        clip=value["clip"],
        sample_rate_source=settings.sample_rate_source,
        steps_source=settings.steps_source,
        notes=list(settings.notes),
    )


def mechanism_of(settings: DPSettings) -> SubsampledGaussian:
    """Both levels are the same mechanism; only the unit differs (a sample, or a client's whole update)."""
    return SubsampledGaussian(settings.noise_multiplier, settings.sample_rate, settings.steps)


def dp_bound(settings: DPSettings, accountant: Accountant | None = None, curve: bool = True) -> DPBound:
    """ε at the user's δ and B(κ) for the reported priors, the user's prior and (for the HTML card) a curve."""
    validate(settings)
    accountant = accountant or PLDAccountant()
    if isinstance(accountant, PLDAccountant):
        import_pld()  # its import (scipy's, mostly) takes a second or more: not part of the computation's time
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
    check_ceiling(target, prior)
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

    return answer(*_least_meeting(meets))


def _least_meeting(meets) -> tuple[float | None, bool]:
    """The least σ in [NOISE_FLOOR, NOISE_CEILING] for which `meets` holds, where it holds on an interval [σ*, ∞):
    bisection on log σ, the upper end of the final bracket rounded up to 0.001 (so it meets it); with whether the
    floor itself meets it (less noise may too). (None, False): no σ up to the ceiling does."""
    low, high = NOISE_FLOOR, 1.0
    if meets(high):
        if meets(low):
            return low, True
    else:
        while not meets(high * 2):
            high *= 2
            if high * 2 > NOISE_CEILING:
                return None, False
        low, high = high, high * 2
    while high / low > 1 + NOISE_RELATIVE_TOLERANCE:
        middle = math.sqrt(low * high)
        if meets(middle):
            high = middle
        else:
            low = middle
    return math.ceil(high * 1000) / 1000, False


def noise_for_epsilon(
    target_epsilon: float, sample_rate: float, steps: int, delta: float, accountant: Accountant | None = None
) -> tuple[float | None, bool]:
    """The least noise multiplier whose ε at δ is at most `target_epsilon` at this q and T (the accountant's ε falls
    as σ grows), as least_noise searches it; with whether the search's floor already meets it."""
    accountant = accountant or PLDAccountant()

    def meets(sigma: float) -> bool:
        return accountant.profile(SubsampledGaussian(sigma, sample_rate, steps)).epsilon(delta) <= target_epsilon

    return _least_meeting(meets)
