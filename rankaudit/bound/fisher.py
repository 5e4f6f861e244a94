"""The DP reading of a sample's clipped-gradient Jacobian: its Fisher information loss, MSE floor and PSNR ceiling.

One DP-SGD step releases Σ_j clip_C(g_j) + N(0, σ²C²I). For sample i, with J_i = ∂ clip_C(g_i)/∂x_i, the Fisher
information about x_i is J_iᵀJ_i / (σC)² and the diagonal Fisher information loss dFIL_i = ‖J_i‖_F² / ((σC)² d)
(Hannun, Guo & van der Maaten 2021; Guo, Karrer, Chaudhuri & van der Maaten 2022). Over the steps it adds up: a
step that takes the sample with probability q releases a mixture, whose Fisher information is at most q times the
step's (Fisher information is convex in the distribution), so T steps give at most q·T times one step's, at the
weights measured. Any unbiased reconstruction then has a per-coordinate MSE of at least 1/dFIL_i (Cramér–Rao and
Jensen), and a PSNR of at most 10·log10(peak² · dFIL_i). docs/method.md, "The Fisher floor under DP noise".

Where the rank check of the same Jacobian has read its rank r and the part of the sample J_i cannot see, the line
also reads the attacker who is unbiased on what J_i sees and fills the rest with the reference mean μ: its expected
squared error is at least r²/tr(I_i) + ‖P_null(J_i)(x_i − μ)‖² (Cramér–Rao on the visible directions, then AM–HM
on their r eigenvalues), and that is the figure designs are ranked and σ named by. docs/method.md, "What a prior
fills in".

Everything here takes the measurement in units of C (‖J/C‖_F², what rankaudit.verify.rank.fisher measures), so
that dFIL = participations · ‖J/C‖_F² / (σ² d) and dFIL ∝ 1/σ².
"""

from __future__ import annotations

import math
import statistics

from rankaudit.settings.levels import DEFAULT_PSNR_TARGET

# The inputs' value range: images and the seeded inputs lie in [0, 1].
PEAK = 1.0
THREAT = (
    "attackers whose estimate is unbiased, at the weights measured; an attacker with an image prior can beat it, "
    "and the reconstruction bound B(κ) holds for every attacker"
)


# What the reconstruction bound B(κ) covers, said beside the Fisher line wherever both are shown.
BOUND_COVERS = "every attacker, with any prior, at any weights: the gate's line"


def summary(line: dict) -> dict:
    """The Fisher line as the DP section shows it beside B(κ): what it covers, the medians, the worst sample and
    the least σ for the PSNR target."""
    worst = line["worst"]
    return {
        "covers": line["covers"],
        "weights": line.get("weights", ""),
        "noise_multiplier": line["noise_multiplier"],
        "median_mse_floor": line["median_mse_floor"],
        "median_psnr_ceiling": line["median_psnr_ceiling"],
        "worst_mse_floor": worst["mse_floor"],
        "worst_psnr_ceiling": worst["psnr_ceiling"],
        "psnr_target": line["psnr_target"],
        "least_noise": line["least_noise"],
        # The attacker who fills what the update cannot see with the reference mean (absent where not read).
        "median_prior_psnr_ceiling": line.get("median_prior_psnr_ceiling"),
        "worst_prior_psnr_ceiling": (line.get("worst_prior") or {}).get("prior_psnr_ceiling"),
        "least_noise_with_prior": line.get("least_noise_with_prior"),
    }


# Hutchinson's estimate of ‖J‖_F² has a standard error; a σ named from it is named at the estimate plus this many
# standard errors (a one-sided limit that a normal error exceeds with probability about 0.1 %), so that the ceiling
# at that σ stays under the target with the estimate's error taken in. An exact norm needs no margin.
UPPER_LIMIT_ERRORS = 3.0


def upper_limit(one: dict) -> float:
    """‖J/C‖_F² at its upper confidence limit: the exact norm, else the estimate plus UPPER_LIMIT_ERRORS standard
    errors."""
    if one.get("exact", False) or one.get("standard_error") is None:
        return one["frobenius_squared"]
    return one["frobenius_squared"] + UPPER_LIMIT_ERRORS * one["standard_error"]


def participations(sample_rate: float, steps: int) -> float:
    """q·T: the number of one-step Fisher informations a sample's total is bounded by."""
    return sample_rate * steps


def dfil(frobenius_squared: float, dimension: int, noise_multiplier: float, participation: float) -> float:
    """participation · ‖J/C‖_F² / (σ² d)."""
    return participation * frobenius_squared / (noise_multiplier**2 * dimension)


def mse_floor(information: float) -> float:
    """1/dFIL (infinite where the update carries no information about the sample)."""
    return math.inf if information <= 0 else 1.0 / information


def psnr_ceiling(information: float, peak: float = PEAK) -> float:
    """10·log10(peak² · dFIL) dB (minus infinity where dFIL is 0)."""
    return -math.inf if information <= 0 else 10.0 * math.log10(peak**2 * information)


def least_noise_for_psnr(
    frobenius_squared: float, dimension: int, participation: float, target: float, peak: float = PEAK
) -> float:
    """The least σ at which the PSNR ceiling is at or below `target` dB: dFIL(σ) = dFIL(1)/σ², so
    σ = peak · sqrt(dFIL(1)) · 10^(−target/20). Zero where the sample's gradient does not depend on it."""
    at_one = dfil(frobenius_squared, dimension, 1.0, participation)
    return peak * math.sqrt(at_one) * 10.0 ** (-target / 20.0) if at_one > 0 else 0.0


def prior_error(rank: int, frobenius_squared: float, hidden: float, noise_multiplier: float, participation: float):
    """r²/tr(I) + hidden: the least expected squared error (summed over the d values) of an attacker unbiased on the
    r directions J sees who fills the rest with the reference mean; `hidden` is ‖P_null(J)(x − μ)‖². With r = 0
    the update tells nothing and the mean alone is the estimate."""
    if rank == 0:
        return hidden
    information = participation * frobenius_squared / noise_multiplier**2
    return (rank**2 / information if information > 0 else math.inf) + hidden


def prior_psnr_ceiling(error: float, dimension: int, peak: float = PEAK) -> float:
    """10·log10(peak² · d / error) dB: plus infinity where the error can be zero (a sample equal to the mean that
    the update says nothing about)."""
    if math.isinf(error):
        return -math.inf
    return math.inf if error <= 0 else 10.0 * math.log10(peak**2 * dimension / error)


def least_noise_with_prior(
    rank: int,
    frobenius_squared: float,
    hidden: float,
    dimension: int,
    participation: float,
    target: float,
    peak: float = PEAK,
) -> float:
    """The least σ at which prior_psnr_ceiling is at or below `target` dB: r²σ²/(q·T·‖J/C‖_F²) + hidden must reach
    peak²·d·10^(−target/10). Zero where the hidden part alone keeps it there, or where the update tells nothing
    (r = 0: no noise changes what the mean alone gives)."""
    needed = peak**2 * dimension * 10.0 ** (-target / 10.0)
    if rank == 0 or hidden >= needed or frobenius_squared <= 0:
        return 0.0
    return math.sqrt((needed - hidden) * participation * frobenius_squared) / rank


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def read_samples(
    measured: list[dict],
    *,
    dimension: int,
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    psnr_target: float = DEFAULT_PSNR_TARGET,
    peak: float = PEAK,
) -> dict:
    """The Fisher line of measured samples at σ: each measured {label, frobenius_squared, ...} gets `dfil`,
    `mse_floor` and `psnr_ceiling`; then the medians, the worst sample (largest dFIL) and the least σ keeping every
    measured sample's PSNR ceiling at or below `psnr_target` (from each norm's upper confidence limit). An infinite
    floor (or a ceiling of minus infinity) is None in the record.

    A sample whose measurement carries `rank` and `hidden` (the rank check of its Jacobian) also gets
    `prior_mse_floor` and `prior_psnr_ceiling`, the attacker who fills what J cannot see with the reference mean;
    then the line carries their medians, `worst_prior` and `least_noise_with_prior`."""
    participation = participations(sample_rate, steps)
    samples = []
    for one in measured:
        information = dfil(one["frobenius_squared"], dimension, noise_multiplier, participation)
        read = {
            **one,
            "dfil": information,
            "mse_floor": finite_or_none(mse_floor(information)),
            "psnr_ceiling": finite_or_none(psnr_ceiling(information, peak)),
        }
        if one.get("rank") is not None:
            error = prior_error(one["rank"], one["frobenius_squared"], one["hidden"], noise_multiplier, participation)
            read["prior_mse_floor"] = finite_or_none(error / dimension)
            read["prior_psnr_ceiling"] = finite_or_none(prior_psnr_ceiling(error, dimension, peak))
        samples.append(read)
    informations = [one["dfil"] for one in samples]
    worst = max(range(len(samples)), key=lambda i: informations[i])
    median = statistics.median(informations)
    largest = max(upper_limit(one) for one in samples)
    line = {
        "samples": samples,
        "median_dfil": median,
        "median_mse_floor": finite_or_none(mse_floor(median)),
        "median_psnr_ceiling": finite_or_none(psnr_ceiling(median, peak)),
        "worst": {
            "index": worst,
            **{key: samples[worst][key] for key in ("label", "dfil", "mse_floor", "psnr_ceiling")},
        },
        "noise_multiplier": noise_multiplier,
        "sample_rate": sample_rate,
        "steps": steps,
        "participations": participation,
        "dimension": dimension,
        "peak": peak,
        "psnr_target": psnr_target,
        "least_noise": least_noise_for_psnr(largest, dimension, participation, psnr_target, peak),
        "covers": THREAT,
    }
    if all(one.get("rank") is not None for one in measured):
        line.update(_with_prior(measured, samples, dimension, noise_multiplier, participation, psnr_target, peak))
    return line


def _with_prior(measured, samples, dimension, noise_multiplier, participation, psnr_target, peak) -> dict:
    """The line's keys for the attacker who fills the invisible part with the reference mean."""
    errors = [
        prior_error(one["rank"], one["frobenius_squared"], one["hidden"], noise_multiplier, participation)
        for one in measured
    ]
    worst = min(range(len(errors)), key=lambda i: errors[i])
    median = statistics.median(errors)
    return {
        "median_prior_mse_floor": finite_or_none(median / dimension),
        "median_prior_psnr_ceiling": finite_or_none(prior_psnr_ceiling(median, dimension, peak)),
        "worst_prior": {
            "index": worst,
            **{key: samples[worst][key] for key in ("label", "prior_mse_floor", "prior_psnr_ceiling")},
        },
        "least_noise_with_prior": max(
            least_noise_with_prior(
                one["rank"], upper_limit(one), one["hidden"], dimension, participation, psnr_target, peak
            )
            for one in measured
        ),
    }


def at_noise(line: dict, noise_multiplier: float) -> dict:
    """The same Fisher line read at another σ (dFIL ∝ 1/σ²): what `compare` and the pictures show."""
    measured = [{key: value for key, value in one.items() if key not in _PER_SAMPLE_KEYS} for one in line["samples"]]
    return read_samples(
        measured,
        dimension=line["dimension"],
        noise_multiplier=noise_multiplier,
        sample_rate=line["sample_rate"],
        steps=line["steps"],
        psnr_target=line["psnr_target"],
        peak=line["peak"],
    ) | {key: value for key, value in line.items() if key not in _READ_KEYS}


# The keys read_samples writes in each sample and in the line; at_noise keeps every other key of the measurement (weights, inputs, estimator).
_PER_SAMPLE_KEYS = {"dfil", "mse_floor", "psnr_ceiling", "prior_mse_floor", "prior_psnr_ceiling"}
_READ_KEYS = {
    "median_prior_mse_floor",
    "median_prior_psnr_ceiling",
    "worst_prior",
    "least_noise_with_prior",
    "samples",
    "median_dfil",
    "median_mse_floor",
    "median_psnr_ceiling",
    "worst",
    "noise_multiplier",
    "sample_rate",
    "steps",
    "participations",
    "dimension",
    "peak",
    "psnr_target",
    "least_noise",
    "covers",
}
