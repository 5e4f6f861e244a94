#!/usr/bin/env python3
"""Benchmark of the verifier: R-GAP vs the optimisation attack on CNN6, side by side; GDBR at batch 64.

Run from the repository root:

    python benchmarks/bench_verify.py [--images 2] [--device auto] [--out benchmarks/verify_results.json]

Targets (issues 3 and 4), on these 2-core CPUs:
  1. one CNN6 R-GAP reconstruction in under 10 s;
  2. R-GAP at least 50x faster than the optimisation attack (inverting gradients) on the same images, counted only
     where the optimisation attack's MSE is the same or worse than R-GAP's;
  3. GDBR at batch 64 on the 6-layer MLP in under 2 s per batch.
Both attacks run in one process, on the same images and weights, with the same thread count. This is a benchmark,
not a test: it exits 0 and prints PASS/FAIL per target.
"""
from __future__ import annotations

import argparse
import importlib.util
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

from rankaudit.verify import data, gdbr, invert, rgap  # noqa: E402
from rankaudit.verify.runner import resolve_device  # noqa: E402


def example(file_name: str, class_name: str) -> torch.nn.Module:
    spec = importlib.util.spec_from_file_location(file_name[:-3], REPO / "examples" / file_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name)()


def bench_rgap_vs_inverting(images: int, device: str, steps: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = example("cnn6.py", "CNN6").double().eval()
    batch, source = data.load_images(None, (3, 32, 32), images, seed)
    batch = batch.to(torch.float64)
    started = time.perf_counter()
    closed_form = rgap.run_rgap(model, batch, device=device, seed=seed, loss="logistic")
    rgap_wall = time.perf_counter() - started
    started = time.perf_counter()
    optimised = invert.run_inverting(model, batch, loss="logistic", steps=steps, restarts=2, device=device, seed=seed)
    inverting_wall = time.perf_counter() - started
    pairs = []
    for index in range(images):
        pairs.append({"image": index, "rgap_seconds": closed_form.seconds[index], "rgap_mse": closed_form.mse[index],
                      "inverting_seconds": optimised.seconds[index], "inverting_mse": optimised.mse[index],
                      "inverting_same_or_worse": optimised.mse[index] >= closed_form.mse[index],
                      "speedup": optimised.seconds[index] / closed_form.seconds[index]})
    comparable = [p["speedup"] for p in pairs if p["inverting_same_or_worse"]]
    return {"model": "examples/cnn6.py", "images": source, "device": closed_form.device,
            "rgap_median_seconds": statistics.median(closed_form.seconds), "rgap_median_mse": closed_form.median_mse,
            "rgap_wall": rgap_wall, "inverting_steps": steps, "inverting_restarts": 2,
            "inverting_median_seconds": statistics.median(optimised.seconds),
            "inverting_median_mse": optimised.median_mse, "inverting_wall": inverting_wall, "per_image": pairs,
            "median_speedup_at_same_or_worse_mse": statistics.median(comparable) if comparable else None,
            "comparable_images": len(comparable)}


def bench_gdbr(device: str, trials: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = example("mlp6.py", "MLP6").eval()
    gdbr.init_like_paper(model, ["fc2", "fc3", "fc4", "fc5", "fc6", "classifier"], seed=seed)
    aux = torch.rand((1000, 3, 32, 32), generator=torch.Generator().manual_seed(seed + 7919))
    outcome = gdbr.run_gdbr(model, "fc2", 64, trials=trials, aux=aux, device=device, seed=seed, input_shape=(3, 32, 32))
    per_trial = [t["seconds"] for t in outcome.per_trial]
    return {"model": "examples/mlp6.py", "shared_layer": "fc2", "batch_size": 64, "trials": trials,
            "median_seconds_per_batch": statistics.median(per_trial), "ins_acc": outcome.ins_acc,
            "cls_acc": outcome.cls_acc, "device": outcome.device}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000, help="optimisation attack budget (its default)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "verify_results.json"))
    args = parser.parse_args()
    device = resolve_device(args.device)
    load = os.getloadavg()
    comparison = bench_rgap_vs_inverting(args.images, device, args.steps, args.seed)
    labels = bench_gdbr(device, args.trials, args.seed)
    speedup = comparison["median_speedup_at_same_or_worse_mse"]
    targets = [
        ("CNN6 R-GAP reconstruction < 10 s", comparison["rgap_median_seconds"] < 10,
         f"{comparison['rgap_median_seconds']:.2f} s (MSE {comparison['rgap_median_mse']:.2e})"),
        ("R-GAP >= 50x faster than inverting gradients at same-or-worse MSE", speedup is not None and speedup >= 50,
         "n/a (the optimisation attack beat R-GAP's MSE)" if speedup is None else
         f"{speedup:.0f}x ({comparison['inverting_median_seconds']:.1f} s, MSE {comparison['inverting_median_mse']:.2e}"
         f" vs {comparison['rgap_median_seconds']:.2f} s, MSE {comparison['rgap_median_mse']:.2e})"),
        ("GDBR batch 64 on MLP6 < 2 s", labels["median_seconds_per_batch"] < 2,
         f"{labels['median_seconds_per_batch']:.2f} s (InsAcc {labels['ins_acc']:.1%}, ClsAcc {labels['cls_acc']:.1%})"),
    ]
    print(f"device {device}, torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, "
          f"load {load[0]:.2f}")
    for name, passed, figure in targets:
        print(f"{'PASS' if passed else 'FAIL'}  {name}: {figure}")
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
                          "torch": torch.__version__, "load_before": load, "load_after": os.getloadavg()},
              "rgap_vs_inverting": comparison, "gdbr": labels,
              "targets": [{"target": n, "pass": p, "figure": f} for n, p, f in targets]}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
