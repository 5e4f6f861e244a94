#!/usr/bin/env python3
"""Accuracy of the DP bound (method.md: DP): rankaudit's default PLD grid against the same library at a 10x finer grid.

Run from the repository root (needs `pip install ".[dp]"`):

    python benchmarks/bench_dp_accuracy.py [--quick] [--old] [--out FILE.json]

For q in {1, 0.01, 0.001}, T in {1, 100, 10^4, 10^5}, σ in {0.5, 1, 2, 4}: ε at δ = 1e-5 and B(κ) at κ = 0.1, 0.01,
0.001 from rankaudit.bound.dp.dp_bound (the grid rankaudit picks, rankaudit.settings.accountant.grid_for), beside the same numbers from
dp-accounting's pessimistic PLD at a grid ten times finer (built directly, not through grid_for; B(κ) by the same
search). Both are upper bounds (pessimistic), though not ordered point by point; the column `excess` is the largest
relative excess of the default over the finer grid (ε and the three B(κ)), the target is within 1 % either way. At q = 1 both sides use the exact identity that T
Gaussian steps are one Gaussian step of noise σ/√T (a direct T-fold composition at a 10x finer grid does not fit in
memory at T = 10^5). `--old` adds the excess of the former fixed grid (1e-3) for comparison; `--quick` runs
T <= 100 only. The time column is dp_bound's own time at the default grid (no HTML curve). Prints a table and
PASS/FAIL; a benchmark, not a test: it exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.bound import dp  # noqa: E402
from rankaudit.settings import accountant
from rankaudit.settings.round import DPSettings  # noqa: E402

RATES = (1.0, 0.01, 0.001)
STEPS = (1, 100, 10_000, 100_000)
NOISES = (0.5, 1.0, 2.0, 4.0)
PRIORS = (0.1, 0.01, 0.001)
DELTA = 1e-5
TARGET = 0.01
REFINEMENT = 10


def library_figures(mechanism: accountant.SubsampledGaussian, discretization: float) -> tuple[float, list[float]]:
    """ε at DELTA and B(κ) from dp-accounting's PLD at exactly `discretization` (no grid rule, no widening)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    sigma, steps = mechanism.noise_multiplier, mechanism.steps
    if mechanism.sample_rate >= 1.0:
        sigma, steps = sigma / math.sqrt(steps), 1
    distribution = pld.from_gaussian_mechanism(
        standard_deviation=sigma,
        sensitivity=1.0,
        sampling_prob=mechanism.sample_rate,
        value_discretization_interval=discretization,
        pessimistic_estimate=True,
    )
    if steps > 1:
        distribution = distribution.self_compose(steps)
    profile = accountant._PLDProfile(distribution, accountant.used_at_all(mechanism), "reference")
    return profile.epsilon(DELTA), dp.reconstruction_bounds(profile, PRIORS)


def excess(value: float | None, reference: float | None) -> float:
    """Relative excess of `value` over `reference` (0 when both are infinite or both are the trivial bound 1)."""
    value = math.inf if value is None else value
    reference = math.inf if reference is None else reference
    if value == reference:
        return 0.0
    if not math.isfinite(reference):
        return -math.inf if math.isfinite(value) else 0.0
    return (value - reference) / reference if reference > 0 else math.inf


def row(q: float, steps: int, sigma: float, old: bool) -> dict:
    mechanism = accountant.SubsampledGaussian(sigma, q, steps)
    start = time.perf_counter()
    result = dp.dp_bound(DPSettings(noise_multiplier=sigma, sample_rate=q, steps=steps, delta=DELTA), curve=False)
    seconds = time.perf_counter() - start
    ours = [result.bounds[str(kappa)] for kappa in PRIORS]
    grid = accountant.grid_for(mechanism if q < 1 else accountant.SubsampledGaussian(sigma / math.sqrt(steps), 1.0, 1))
    if not grid.fits or grid.coarsened:
        # No PLD at rankaudit's grid (the noise is too small for one: σ/√T at q = 1), so none ten times finer.
        return {
            "q": q,
            "steps": steps,
            "sigma": sigma,
            "discretization": None,
            "epsilon": result.epsilon,
            "epsilon_fine": None,
            "bounds": ours,
            "bounds_fine": None,
            "excess": None,
            "below_fine": None,
            "seconds": round(seconds, 3),
            "accountant": result.accountant,
            "excess_old": None,
        }
    fine_epsilon, fine = library_figures(mechanism, grid.discretization / REFINEMENT)
    excesses = [excess(result.epsilon, fine_epsilon)] + [excess(a, b) for a, b in zip(ours, fine)]
    entry = {
        "q": q,
        "steps": steps,
        "sigma": sigma,
        "discretization": grid.discretization,
        "epsilon": result.epsilon,
        "epsilon_fine": fine_epsilon,
        "bounds": ours,
        "bounds_fine": fine,
        "excess": max(excesses),
        "below_fine": min(excesses),
        "seconds": round(seconds, 3),
    }
    if old:
        old_epsilon, old_bounds = library_figures(mechanism, 1e-3)
        entry["excess_old"] = max(
            [excess(old_epsilon, fine_epsilon)] + [excess(a, b) for a, b in zip(old_bounds, fine)]
        )
    return entry


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T <= 100 only")
    parser.add_argument("--old", action="store_true", help="also the former fixed grid 1e-3")
    parser.add_argument("--out")
    args = parser.parse_args()
    dp.dp_bound(DPSettings(noise_multiplier=1.0, sample_rate=0.01, steps=10), curve=False)  # import + warm-up
    rows = []
    print(
        f"{'q':>6} {'T':>7} {'σ':>4} {'Δ':>9} {'ε':>9} {'ε fine':>9} {'B(0.001)':>9} {'fine':>9} "
        f"{'excess':>8}{'  old' if args.old else ''} {'time s':>7}"
    )
    for q in RATES:
        for steps in STEPS:
            if args.quick and steps > 100:
                continue
            for sigma in NOISES:
                entry = row(q, steps, sigma, args.old)
                rows.append(entry)
                if entry["excess"] is None:
                    print(
                        f"{q:>6g} {steps:>7,} {sigma:>4g}  no PLD: {entry['accountant']}; B(0.001) "
                        f"{entry['bounds'][2]:.4g} (not compared)",
                        flush=True,
                    )
                    continue
                epsilon = "inf" if entry["epsilon"] is None else f"{entry['epsilon']:.4g}"
                fine_epsilon = f"{entry['epsilon_fine']:.4g}"
                old = f" {entry['excess_old']:7.2%}" if args.old else ""
                print(
                    f"{q:>6g} {steps:>7,} {sigma:>4g} {entry['discretization']:>9.3g} {epsilon:>9} "
                    f"{fine_epsilon:>9} {entry['bounds'][2]:>9.4g} {entry['bounds_fine'][2]:>9.4g} "
                    f"{entry['excess']:>8.3%}{old} {entry['seconds']:>7.3f}",
                    flush=True,
                )
    compared = [entry for entry in rows if entry["excess"] is not None]
    worst = max(compared, key=lambda entry: entry["excess"])
    sound = min(entry["below_fine"] for entry in compared)
    # Pessimistic PLDs at two grids are both upper bounds but not ordered point by point, so the default may sit a
    # little below the finer one (measured: at most 0.25 %); within 1 % either way is the target.
    passed = worst["excess"] < TARGET and sound > -TARGET
    print(
        f"worst excess over the 10x finer grid: {worst['excess']:.3%} at q {worst['q']:g}, T {worst['steps']:,}, "
        f"σ {worst['sigma']:g}; most below it: {sound:.3%} (both are upper bounds) "
        f"[{'PASS' if passed else 'FAIL'}: target < {TARGET:.0%}]"
    )
    if args.old:
        old = max(compared, key=lambda entry: entry["excess_old"])
        print(
            f"former fixed grid 1e-3: worst excess {old['excess_old']:.1%} at q {old['q']:g}, T {old['steps']:,}, "
            f"σ {old['sigma']:g}"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps({"rows": rows, "cpus": os.cpu_count(), "load": os.getloadavg()[0]}, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
