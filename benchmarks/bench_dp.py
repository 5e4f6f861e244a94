#!/usr/bin/env python3
"""Benchmark of the DP bound (method.md: DP): the accountant at T = 10,000 steps, and --verify dp's attack trials/second.

Run from the repository root (needs `pip install ".[dp,verify]"`):

    python benchmarks/bench_dp.py [--repeat 5] [--trials 2000] [--device auto] [--out FILE.json]

Target: B(κ) for T = 10,000 steps a fraction of a second on the CPU. Timed: the PLD's construction and
self-composition and B(κ) at κ = 0.1, 0.01, 0.001 (rankaudit.bound.dp.dp_bound without the HTML curve), median of
`--repeat` runs after one warm-up that pays the library's import. The attack: the informed attack on CNN6's real
clipped per-sample gradients (125,456 values each; M = 10 candidates, q = 1, T = 1, σ = 1), noise drawn in full
(trials x gradient size normal draws) and, separately, in the candidates' span; trials per second of the attack
itself (the gradients are computed once, outside the timing). The success rate and the bound are printed beside
the time, so a fast wrong answer cannot pass. This is a benchmark, not a test: it exits 0 and prints PASS/FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.bound import dp  # noqa: E402
from rankaudit.settings.round import DPSettings  # noqa: E402
from rankaudit.verify.model import resolve_device  # noqa: E402

ACCOUNTANT_TARGET_S = 1.0
STEPS = 10_000


def bench_accountant(repeat: int) -> dict:
    settings = DPSettings(noise_multiplier=1.0, sample_rate=0.01, steps=STEPS)
    dp.dp_bound(DPSettings(noise_multiplier=1.0, sample_rate=0.01, steps=10), curve=False)  # import + warm-up
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = dp.dp_bound(settings, curve=False)
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {
        "steps": STEPS,
        "sample_rate": 0.01,
        "noise_multiplier": 1.0,
        "median_s": round(median, 3),
        "times_s": [round(t, 3) for t in times],
        "epsilon": result.epsilon,
        "bounds": result.bounds,
        "accountant": result.accountant,
        "target_s": ACCOUNTANT_TARGET_S,
        "pass": median < ACCOUNTANT_TARGET_S,
    }


def bench_attack(trials: int, device: str) -> list[dict]:
    from rankaudit.audit import audit
    from rankaudit.verify.attacks.dp import clopper_pearson, informed_attack, unit_gradients
    from rankaudit.verify.client import draw_labels
    from rankaudit.verify.inputs import real_inputs
    from rankaudit.verify.model import build_real_model

    spec = str(REPO / "examples" / "cnn6.py")
    result = audit(spec)
    model, _ = build_real_model(spec, result.input_shape, 0)
    images, _ = real_inputs(result, None, 10, 0)
    labels = draw_labels(10, "logistic", 1, 0)
    gradients = unit_gradients(model, images[:, None], labels[:, None], "logistic", 1.0, device)
    # Clipping to the median norm puts every candidate at norm c, where the attack is strongest.
    clip = float(gradients.norm(dim=1).median())
    gradients = unit_gradients(model, images[:, None], labels[:, None], "logistic", clip, device)
    bound = dp.bound_at(1.0, 1.0, 1, 0.1)
    rows = []
    for draw, limit in (("full", 2**62), ("span", 0)):
        informed_attack(
            gradients, None, noise_multiplier=1.0, clip=1.0, sample_rate=1.0, steps=1, trials=16, full_draw_limit=limit
        )  # warm-up
        if device == "cuda":
            torch.cuda.synchronize()
        outcome = informed_attack(
            gradients,
            None,
            noise_multiplier=1.0,
            clip=1.0,
            sample_rate=1.0,
            steps=1,
            trials=trials,
            seed=1,
            full_draw_limit=limit,
        )
        if device == "cuda":
            torch.cuda.synchronize()
        low, high = clopper_pearson(outcome.successes, outcome.trials)
        rows.append(
            {
                "draw": draw,
                "device": outcome.device,
                "trials": trials,
                "seconds": round(outcome.seconds, 3),
                "trials_per_s": round(trials / outcome.seconds, 1),
                "gradient_size": gradients.shape[1],
                "success_rate": outcome.successes / trials,
                "interval": [low, high],
                "bound": bound,
                "below_bound": low <= bound,
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out")
    args = parser.parse_args()
    device = resolve_device(args.device)
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load": os.getloadavg()[0],
            "torch_threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        }
    }
    report["accountant"] = accountant = bench_accountant(args.repeat)
    print(
        f"accountant, T = {STEPS:,}, q 0.01, σ 1: median {accountant['median_s']:.3f} s "
        f"(runs {accountant['times_s']}); ε {accountant['epsilon']:.3f}, B {accountant['bounds']} "
        f"[{'PASS' if accountant['pass'] else 'FAIL'}: target < {ACCOUNTANT_TARGET_S:g} s]"
    )
    devices = ["cpu"] + (["cuda"] if device == "cuda" else [])
    report["attack"] = []
    for name in devices:
        for row in bench_attack(args.trials, name):
            report["attack"].append(row)
            print(
                f"attack on CNN6 ({row['gradient_size']:,} values), {row['draw']} draw, {row['device']}: "
                f"{row['trials_per_s']:,.0f} trials/s ({row['trials']} in {row['seconds']:.2f} s); success "
                f"{row['success_rate']:.3f} [{row['interval'][0]:.3f}, {row['interval'][1]:.3f}] vs bound "
                f"{row['bound']:.3f} [{'PASS' if row['below_bound'] else 'FAIL'}]"
            )
    if device != "cuda":
        print("attack on a GPU: not measured (no CUDA device here)")
    report["load_after"] = os.getloadavg()[0]
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
