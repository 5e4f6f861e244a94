#!/usr/bin/env python3
"""Benchmark of the federated-round verifiers: the rank of a round's update and the FedAvg inversion.

Run from the repository root:

    python benchmarks/bench_round.py [--samples 2] [--batch-size 1] [--epochs 2] [--steps 200] [--restarts 2]
                                     [--device auto] [--out benchmarks/round_results.json]

The round is CNN6 (examples/cnn6.py, 125,456 parameters, 3x32x32, one logit) with N local samples in batches of B
for E epochs; the default is the 4-step round N = 2, B = 1, E = 2 (6,144 unknowns). Both parts run on the CPU and,
where CUDA is present, again on the GPU (rows say "no GPU" elsewhere); the same seeded photographs, labels and
weights on both. Reported: the measured rank, its gap and the static bound; the attack's per-image PSNR and time.
This is a benchmark, not a test: it exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.audit import audit  # noqa: E402
from rankaudit.bound import images as data
from rankaudit.settings.round import build_round  # noqa: E402
from rankaudit.verify.attacks import fedavg
from rankaudit.verify.client import draw_labels
from rankaudit.verify.model import build_real_model  # noqa: E402
from rankaudit.verify.rank import round_jacobian as round_rank

MODEL = str(REPO / "examples" / "cnn6.py")


def _round_inputs(round_, seed: int):
    images, source = data.load_images(None, (3, 32, 32), round_.clients * round_.samples, seed)
    images = images.to(torch.float64).reshape(round_.clients, round_.samples, 3, 32, 32)
    labels = draw_labels(round_.clients * round_.samples, "logistic", 1, seed).reshape(images.shape[:2])
    return images, labels, source


def rank_part(round_, device: str, seed: int) -> dict:
    result = audit(MODEL, round_=round_)
    model, _ = build_real_model(MODEL, (3, 32, 32), seed)
    images, labels, source = _round_inputs(round_, seed)
    started = time.perf_counter()
    measured = round_rank.measure_round(model, images, labels, round_, device=device, seed=seed, loss="logistic")
    return {
        "device": device,
        "unknowns": measured.unknowns,
        "rank": measured.rank,
        "gap": measured.gap,
        "rank_bound": result.identifiability.rank_bound,
        "verdict": result.verdict,
        "sketch_rows": measured.sketch_rows,
        "chunk_rows": measured.chunk_rows,
        "sketch_seconds": round(measured.sketch_seconds, 2),
        "spectrum_seconds": round(measured.spectrum_seconds, 2),
        "spectrum": measured.spectrum,
        "seconds": round(time.perf_counter() - started, 2),
        "images": source,
    }


def attack_part(round_, device: str, seed: int, steps: int, restarts: int) -> dict:
    model, _ = build_real_model(MODEL, (3, 32, 32), seed)
    images, labels, source = _round_inputs(round_, seed)
    # An untimed short run first: lazy imports, CUDA context and kernel selection.
    fedavg.invert_round(model, images, labels, round_, "logistic", steps=2, restarts=restarts, device=device, seed=seed)
    attack = fedavg.invert_round(
        model, images, labels, round_, "logistic", steps=steps, restarts=restarts, device=device, seed=seed
    )
    return {
        "device": device,
        "steps": steps,
        "restarts": restarts,
        "psnr": attack.psnr,
        "mse": attack.mse,
        "median_psnr": attack.median_psnr,
        "final_distance": attack.final_distance,
        "seconds": round(attack.seconds, 2),
        "images": source,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--clients", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200, help="the attack's optimisation steps")
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--parts", default="rank,attack")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    round_ = build_round(
        {
            "local_samples": args.samples,
            "batch_size": args.batch_size,
            "local_epochs": args.epochs,
            "clients": args.clients,
        }
    )
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    report = {
        "round": {
            "local_samples": round_.samples,
            "batch_size": round_.batch_size,
            "local_epochs": round_.local_epochs,
            "steps": round_.steps,
            "clients": round_.clients,
        },
        "machine": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "rank": [],
        "attack": [],
    }
    parts = args.parts.split(",")
    for device in devices:
        if "rank" in parts:
            row = rank_part(round_, device, args.seed)
            report["rank"].append(row)
            print(
                f"rank   {device}: {row['rank']} of {row['unknowns']} (bound {row['rank_bound']}, gap "
                f"{row['gap']:.3g}), sketch {row['sketch_seconds']} s + {row['spectrum']} "
                f"{row['spectrum_seconds']} s",
                flush=True,
            )
        if "attack" in parts:
            row = attack_part(round_, device, args.seed, args.steps, args.restarts)
            report["attack"].append(row)
            shown = ", ".join(f"{p:.1f}" for client in row["psnr"] for p in client)
            print(
                f"attack {device}: PSNR {shown} dB, {row['seconds']} s ({args.steps} steps x {args.restarts} "
                "restarts in one batch)",
                flush=True,
            )
    if not torch.cuda.is_available():
        print("gpu: not measured (no CUDA device)")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
