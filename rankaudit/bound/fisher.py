"""The DP reading of a sample's clipped-gradient Jacobian: its Fisher information loss, MSE floor and PSNR ceiling.

One DP-SGD step releases Σ_j clip_C(g_j) + N(0, σ²C²I). For sample i, with J_i = ∂ clip_C(g_i)/∂x_i, the Fisher
information about x_i is J_iᵀJ_i / (σC)² and the diagonal Fisher information loss dFIL_i = ‖J_i‖_F² / ((σC)² d)
(Hannun, Guo & van der Maaten 2021; Guo, Karrer, Chaudhuri & van der Maaten 2022). Over the steps it adds up: a
step that takes the sample with probability q releases a mixture, whose Fisher information is at most q times the
step's (Fisher information is convex in the distribution), so T steps give at most q·T times one step's, at the
weights measured. Any unbiased reconstruction then has a per-coordinate MSE of at least 1/dFIL_i (Cramér–Rao and
Jensen), and a PSNR of at most 10·log10(peak² · dFIL_i). docs/method.md, "The Fisher floor under DP noise".

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
    }


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
    measured sample's PSNR ceiling at or below `psnr_target`. An infinite floor (or a ceiling of minus infinity)
    is None in the record."""
    participation = participations(sample_rate, steps)
    samples = []
    for one in measured:
        information = dfil(one["frobenius_squared"], dimension, noise_multiplier, participation)
        samples.append(
            {
                **one,
                "dfil": information,
                "mse_floor": finite_or_none(mse_floor(information)),
                "psnr_ceiling": finite_or_none(psnr_ceiling(information, peak)),
            }
        )
    informations = [one["dfil"] for one in samples]
    worst = max(range(len(samples)), key=lambda i: informations[i])
    median = statistics.median(informations)
    largest = max(one["frobenius_squared"] for one in samples)
    return {
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


def at_noise(line: dict, noise_multiplier: float) -> dict:
    """The same Fisher line read at another σ (dFIL ∝ 1/σ²): what `compare` and the pictures show."""
    measured = [
        {key: value for key, value in one.items() if key not in ("dfil", "mse_floor", "psnr_ceiling")}
        for one in line["samples"]
    ]
    return read_samples(
        measured,
        dimension=line["dimension"],
        noise_multiplier=noise_multiplier,
        sample_rate=line["sample_rate"],
        steps=line["steps"],
        psnr_target=line["psnr_target"],
        peak=line["peak"],
    ) | {key: value for key, value in line.items() if key not in _READ_KEYS}


# The keys read_samples writes; at_noise keeps every other key of the measurement (weights, inputs, estimator).
_READ_KEYS = {
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
