#!/usr/bin/env python3
"""Benchmark of the verifier: R-GAP vs the optimisation attack, the rank check, and the GPU against the CPU.

Run from the repository root:

    python benchmarks/bench_verify.py [--images 2] [--attack-images 8] [--device auto]
                                      [--out benchmarks/verify_results.json]

Targets:
  1. one CNN6 R-GAP reconstruction in under 10 s (CPU);
  2. R-GAP at least 50x faster than the optimisation attack (inverting gradients) on the same images, counted only
     where the optimisation attack's MSE is the same or worse than R-GAP's;
  3. GDBR at batch 64 on the 6-layer MLP in under 2 s per batch;
  4. the rank check (--verify rank) of CNN6, n = 3072, in under 60 s on the CPU;
  5. on a GPU, the rank check of a ResNet-18 (11.2 M parameters, 3x32x32) in under 30 s;
  6. the optimisation attack on 8 CNN6 images (1000 steps x 2 restarts) at least 10x faster on the GPU than on the
     CPU of the same machine;
  7. depthwise-heavy nets: on a GPU the rank check of the MobileNetV2-style network
     (benchmarks/models/mobilenetv2_32.py, 3x32x32) in under 60 s with --rank-precision auto; on the CPU, the cost
     per sketch row in float64 and float32 rows, and the share of the convolutions in a profiled chunk.
Targets 1-3 run on --device; 4 and the CPU side of 6 on the CPU; 5 and the GPU side of 6 only where CUDA is present
(their rows say "no GPU" elsewhere). Both sides of each comparison run in one process, on the same images and
weights; every timed attack is preceded by a short untimed run on its device (CUDA context, kernel selection, lazy
imports). This is a benchmark, not a test: it exits 0 and prints PASS/FAIL per target.
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

from rankaudit.bound import images as data
from rankaudit.verify.attacks import gdbr, gdbr_victims, invert, rgap
from rankaudit.verify.model import resolve_device  # noqa: E402

try:
    from rankaudit.verify.client import draw_labels, loss_name_for
    from rankaudit.verify.rank import jacobian as rank
    from rankaudit.verify.rank import sketch
except ImportError:  # a tree from before --verify rank: its rows say so
    rank = None


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
        pairs.append(
            {
                "image": index,
                "rgap_seconds": closed_form.seconds[index],
                "rgap_mse": closed_form.mse[index],
                "inverting_seconds": optimised.seconds[index],
                "inverting_mse": optimised.mse[index],
                "inverting_same_or_worse": optimised.mse[index] >= closed_form.mse[index],
                "speedup": optimised.seconds[index] / closed_form.seconds[index],
            }
        )
    comparable = [p["speedup"] for p in pairs if p["inverting_same_or_worse"]]
    return {
        "model": "examples/cnn6.py",
        "images": source,
        "device": closed_form.device,
        "rgap_median_seconds": statistics.median(closed_form.seconds),
        "rgap_median_mse": closed_form.median_mse,
        "rgap_wall": rgap_wall,
        "inverting_steps": steps,
        "inverting_restarts": 2,
        "inverting_median_seconds": statistics.median(optimised.seconds),
        "inverting_median_mse": optimised.median_mse,
        "inverting_wall": inverting_wall,
        "per_image": pairs,
        "median_speedup_at_same_or_worse_mse": statistics.median(comparable) if comparable else None,
        "comparable_images": len(comparable),
    }


def bench_gdbr(device: str, trials: int, seed: int) -> dict:
    torch.manual_seed(seed)
    model = example("mlp6.py", "MLP6").eval()
    gdbr_victims.init_like_paper(model, ["fc2", "fc3", "fc4", "fc5", "fc6", "classifier"], seed=seed)
    aux = torch.rand((1000, 3, 32, 32), generator=torch.Generator().manual_seed(seed + 7919))
    outcome = gdbr.run_gdbr(model, "fc2", 64, trials=trials, aux=aux, device=device, seed=seed, input_shape=(3, 32, 32))
    per_trial = [t["seconds"] for t in outcome.per_trial]
    return {
        "model": "examples/mlp6.py",
        "shared_layer": "fc2",
        "batch_size": 64,
        "trials": trials,
        "median_seconds_per_batch": statistics.median(per_trial),
        "ins_acc": outcome.ins_acc,
        "cls_acc": outcome.cls_acc,
        "device": outcome.device,
    }


PARTS = ("rgap", "gdbr", "rank", "devices", "mobile")


def cuda_present() -> bool:
    return torch.cuda.is_available()


def bench_rank(model: torch.nn.Module, label: str, device: str, seed: int, precision: str = "float64") -> dict:
    """One rank check at batch size 1 on a real image, as `--verify rank` runs it."""
    if rank is None:
        return {"model": label, "skipped": "rankaudit.verify.rank.jacobian is not in this tree"}
    image, source = data.load_images(None, (3, 32, 32), 1, seed)
    with torch.no_grad():
        classes = model(image.to(next(model.parameters()).dtype)).numel()
    loss = loss_name_for(classes)
    labels = draw_labels(1, loss, classes, seed)
    if device == "cuda":
        rank.measure(model, image, labels, device=device, seed=seed, chunk_rows=4)  # warm-up, untimed
        torch.cuda.synchronize()
    started = time.perf_counter()
    measured = rank.measure(model, image, labels, device=device, seed=seed, precision=precision)
    wall = time.perf_counter() - started
    return {
        "model": label,
        "images": source,
        "device": measured.device,
        "parameters": measured.shared_gradient_size,
        "unknowns": measured.unknowns,
        "rank": measured.rank,
        "deficit": measured.deficit,
        "gap": measured.gap,
        "method": measured.method,
        "chunk_rows": measured.chunk_rows,
        "seconds": measured.seconds,
        "wall": wall,
        "precision": measured.precision,
    }


def bench_inverting_devices(images: int, steps: int, seed: int) -> dict:
    """The optimisation attack on the same CNN6 images and weights on the CPU and, where present, on the GPU."""
    torch.manual_seed(seed)
    model = example("cnn6.py", "CNN6").double().eval()
    batch, source = data.load_images(None, (3, 32, 32), images, seed)
    batch = batch.to(torch.float64)
    sides = {}
    for device in ("cpu", "cuda") if cuda_present() else ("cpu",):
        invert.run_inverting(model, batch[:1], loss="logistic", steps=3, restarts=1, device=device, seed=seed)
        started = time.perf_counter()
        result = invert.run_inverting(model, batch, loss="logistic", steps=steps, restarts=2, device=device, seed=seed)
        wall = time.perf_counter() - started
        sides[device] = {
            "wall": wall,
            "median_mse": result.median_mse,
            "mse": result.mse,
            "candidate_steps": sum(result.steps_run),
            "device": result.device,
            "per_sample_gradients": result.outcomes[0].per_sample_gradients,
            "threads": torch.get_num_threads(),
        }
    gpu = sides.get("cuda")
    return {
        "model": "examples/cnn6.py",
        "images": source,
        "count": images,
        "steps": steps,
        "restarts": 2,
        "cpu": sides["cpu"],
        "cuda": gpu,
        "speedup": sides["cpu"]["wall"] / gpu["wall"] if gpu else None,
        "gpu_name": torch.cuda.get_device_name(0) if gpu else None,
    }


def bench_mobile_rows(seed: int, rows: int = 16) -> dict:
    """Per-row cost of the rank sketch (forward-over-reverse, one chunk of `rows`) of the MobileNetV2-style network
    on the CPU, float64 against float32, and the share of convolution kernels in a profile of the float64 chunk."""
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(REPO / "benchmarks" / "models"))
    from mobilenetv2_32 import MobileNetV2Narrow

    from rankaudit.verify.substitute import differentiable_ops

    torch.manual_seed(seed)
    model = MobileNetV2Narrow().eval()
    image = torch.rand((1, 3, 32, 32), generator=torch.Generator().manual_seed(seed))
    out: dict = {
        "model": "benchmarks/models/mobilenetv2_32.py",
        "rows": rows,
        "parameters": sum(p.numel() for p in model.parameters()),
    }
    for dtype in (torch.float64, torch.float32):
        net = model.to(dtype)
        names = [name for name, _ in net.named_parameters()]
        sketch_rows = sketch._ForwardOverReverse(net, image.to(dtype), torch.tensor([0]), "cross-entropy", names)
        directions = [torch.randn((rows, *p.shape), dtype=dtype) for p in net.parameters()]
        with differentiable_ops():
            sketch_rows([d[:2] for d in directions])  # warm-up, untimed
            started = time.perf_counter()
            sketch_rows(directions)
            out[f"{dtype}".replace("torch.", "") + "_ms_per_row"] = 1000 * (time.perf_counter() - started) / rows
            if dtype == torch.float64:
                with profile(activities=[ProfilerActivity.CPU]) as profiled:
                    sketch_rows(directions)
                events = profiled.key_averages()
                total = sum(e.self_cpu_time_total for e in events)
                conv = sum(e.self_cpu_time_total for e in events if "conv" in e.key)
                out["conv_share_float64"] = conv / total if total else None
    return out


def rank_row(name: str, target_seconds: float, measured: dict | None) -> tuple[str, bool | None, str]:
    if measured is None:
        return name, None, "no GPU"
    if "skipped" in measured:
        return name, None, measured["skipped"]
    return (
        name,
        measured["seconds"] < target_seconds,
        f"{measured['seconds']:.1f} s on {measured['device']}: rank {measured['rank']} of {measured['unknowns']}"
        f" (deficit {measured['deficit']}, gap {measured['gap']:.1e}, {measured['parameters']:,} parameters, "
        f"{measured['method']}, {measured['chunk_rows']} rows per pass)",
    )


def attack_row(devices: dict) -> tuple[str, bool | None, str]:
    name = (
        f"optimisation attack, {devices['count']} CNN6 images x {devices['steps']} steps x 2 restarts: "
        "GPU >= 10x faster than CPU"
    )
    cpu = devices["cpu"]
    cpu_figure = f"CPU {cpu['wall']:.1f} s ({cpu['threads']} threads, median MSE {cpu['median_mse']:.1e})"
    if devices["cuda"] is None:
        return name, None, f"no GPU; {cpu_figure}"
    gpu = devices["cuda"]
    return (
        name,
        devices["speedup"] >= 10,
        f"{devices['speedup']:.1f}x: GPU {gpu['wall']:.1f} s (median MSE {gpu['median_mse']:.1e}) vs {cpu_figure}",
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1000, help="optimisation attack budget (its default)")
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--attack-images", type=int, default=8, help="images for the GPU-vs-CPU attack comparison")
    parser.add_argument("--attack-steps", type=int, default=1000, help="steps of the GPU-vs-CPU attack comparison")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="comma-separated subset of: rgap (targets 1-2), gdbr (3), rank (4-5), devices (6), mobile (7)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "verify_results.json"))
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    unknown = parts - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose from {','.join(PARTS)}")
    device = resolve_device(args.device)
    load = os.getloadavg()
    report: dict = {}
    targets: list[tuple[str, bool | None, str]] = []
    if "rgap" in parts:
        comparison = report["rgap_vs_inverting"] = bench_rgap_vs_inverting(args.images, device, args.steps, args.seed)
        speedup = comparison["median_speedup_at_same_or_worse_mse"]
        targets += [
            (
                "CNN6 R-GAP reconstruction < 10 s",
                comparison["rgap_median_seconds"] < 10,
                f"{comparison['rgap_median_seconds']:.2f} s (MSE {comparison['rgap_median_mse']:.2e})",
            ),
            (
                "R-GAP >= 50x faster than inverting gradients at same-or-worse MSE",
                speedup is not None and speedup >= 50,
                "n/a (the optimisation attack beat R-GAP's MSE)"
                if speedup is None
                else f"{speedup:.0f}x ({comparison['inverting_median_seconds']:.1f} s, MSE "
                f"{comparison['inverting_median_mse']:.2e} vs {comparison['rgap_median_seconds']:.2f} s, MSE "
                f"{comparison['rgap_median_mse']:.2e})",
            ),
        ]
    if "gdbr" in parts:
        labels = report["gdbr"] = bench_gdbr(device, args.trials, args.seed)
        targets.append(
            (
                "GDBR batch 64 on MLP6 < 2 s",
                labels["median_seconds_per_batch"] < 2,
                f"{labels['median_seconds_per_batch']:.2f} s (InsAcc {labels['ins_acc']:.1%}, "
                f"ClsAcc {labels['cls_acc']:.1%})",
            )
        )
    if "rank" in parts:
        rank_cnn6 = report["rank_cnn6_cpu"] = bench_rank(
            example("cnn6.py", "CNN6").double().eval(), "examples/cnn6.py", "cpu", args.seed
        )
        rank_resnet18 = None
        if cuda_present():
            sys.path.insert(0, str(REPO / "benchmarks" / "models"))
            from resnet18 import ResNet18

            torch.manual_seed(args.seed)
            rank_resnet18 = bench_rank(ResNet18().eval(), "benchmarks/models/resnet18.py", "cuda", args.seed)
        report["rank_resnet18_gpu"] = rank_resnet18
        targets += [
            rank_row("rank check of CNN6 (n = 3072) on the CPU < 60 s", 60, rank_cnn6),
            rank_row("rank check of ResNet-18 (3x32x32) on the GPU < 30 s", 30, rank_resnet18),
        ]
    if "mobile" in parts:
        mobile = report["mobile_rows_cpu"] = bench_mobile_rows(args.seed)
        targets.append(
            (
                "MobileNetV2-style sketch rows on the CPU (no target: the figures for the README)",
                None,
                f"{mobile['float64_ms_per_row']:.0f} ms/row in float64, {mobile['float32_ms_per_row']:.0f} "
                f"ms/row in float32 rows; convolution kernels {mobile['conv_share_float64']:.0%} of the "
                f"float64 chunk's CPU time ({mobile['parameters']:,} parameters, {mobile['rows']} rows)",
            )
        )
        mobile_gpu = None
        if cuda_present():
            sys.path.insert(0, str(REPO / "benchmarks" / "models"))
            from mobilenetv2_32 import MobileNetV2Narrow

            torch.manual_seed(args.seed)
            mobile_gpu = bench_rank(
                MobileNetV2Narrow().eval(), "benchmarks/models/mobilenetv2_32.py", "cuda", args.seed, precision="auto"
            )
        report["rank_mobilenetv2_gpu"] = mobile_gpu
        targets.append(rank_row("rank check of the MobileNetV2-style net (3x32x32) on the GPU < 60 s", 60, mobile_gpu))
    if "devices" in parts:
        devices = report["inverting_gpu_vs_cpu"] = bench_inverting_devices(
            args.attack_images, args.attack_steps, args.seed
        )
        targets.append(attack_row(devices))
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if cuda_present() else ", no GPU"
    print(
        f"device {device}{gpu}, torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} "
        f"threads, load {load[0]:.2f}"
    )
    for name, passed, figure in targets:
        print(f"{'n/a ' if passed is None else 'PASS' if passed else 'FAIL'}  {name}: {figure}")
    report = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if cuda_present() else None,
            "load_before": load,
            "load_after": os.getloadavg(),
        },
        **report,
        "targets": [{"target": n, "pass": p, "figure": f} for n, p, f in targets],
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
