#!/usr/bin/env python3
"""Calibration of the FedAvg inversion's prior and precision: PSNR beside the grey and mean-colour baselines.

Run from the repository root:

    python benchmarks/bench_round_prior.py [--model examples/lenet.py] [--samples 4] [--batch-size 1] [--epochs 1]
                                           [--steps 300] [--restarts 2] [--data PATH.npy] [--tv 0,0.002,0.02,0.2]
                                           [--tv-until 0.625,1] [--dtype float64,float32]

Builds the model as the verifier does (random weights, seed 0, float64), draws the verifier's labels, takes the
verifier's images (photograph crops, or --data), and runs rankaudit.verify.attacks.fedavg.invert_round once per
(dtype, relative TV weight, TV until) on the same round; prints one JSON line per run: median / best PSNR, the
baselines' medians, how many images beat both, the winning restart's best distance. A benchmark, not a test: it exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.bound import images as data
from rankaudit.settings.round import build_round  # noqa: E402
from rankaudit.verify import baselines
from rankaudit.verify.attacks import fedavg
from rankaudit.verify.client import draw_labels, logits_of, loss_name_for
from rankaudit.verify.model import build_real_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(REPO / "examples" / "lenet.py"))
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None)
    parser.add_argument("--tv", default="0,0.002,0.02,0.2")
    parser.add_argument("--tv-until", default="0.625")
    parser.add_argument("--dtype", default="float64")
    args = parser.parse_args()

    round_ = build_round({"local_samples": args.samples, "batch_size": args.batch_size, "local_epochs": args.epochs})
    from rankaudit.model.load import load_model

    shape = tuple(load_model(args.model, None, device="meta").input_shape)
    model, weights = build_real_model(args.model, shape, args.seed)
    flat, source = data.load_images(args.data, shape, round_.samples, args.seed)
    images = flat.to(torch.float64).reshape(1, round_.samples, *shape)
    with torch.no_grad():
        logits = logits_of(model(images[0, :1])).numel()
    labels = draw_labels(round_.samples, loss_name_for(logits), logits, args.seed).reshape(1, -1)
    loss = loss_name_for(logits)
    print(
        json.dumps(
            {
                "model": args.model,
                "round": f"N={round_.samples} B={round_.batch_size} E={args.epochs} K={round_.steps}",
                "images": source,
                "weights": weights,
                "loss": loss,
            }
        )
    )
    for dtype_name in args.dtype.split(","):
        for until in (float(v) for v in args.tv_until.split(",")):
            for weight in (float(v) for v in args.tv.split(",")):
                started = time.perf_counter()
                attack = fedavg.invert_round(
                    model,
                    images,
                    labels,
                    round_,
                    loss,
                    steps=args.steps,
                    restarts=args.restarts,
                    tv_weight=weight,
                    tv_until=until,
                    seed=args.seed,
                    dtype=getattr(torch, dtype_name),
                )
                scored = baselines.score(images[0], attack.reconstructions[0])
                info = baselines.summary(scored)
                print(
                    json.dumps(
                        {
                            "dtype": dtype_name,
                            "tv_weight": weight,
                            "tv_weight_applied": attack.tv_weight_applied,
                            "tv_until": until,
                            "steps": args.steps,
                            "restarts": args.restarts,
                            "median_psnr": round(attack.median_psnr, 2),
                            "psnr": [round(s.psnr, 2) for s in scored],
                            "best_psnr": info["best"]["psnr"] and round(info["best"]["psnr"], 2),
                            "grey_psnr_median": round(info["grey_psnr_median"], 2),
                            "mean_colour_psnr_median": round(info["mean_colour_psnr_median"], 2),
                            "recovered": info["recovered_samples"],
                            "outcome": info["outcome"],
                            "best_distance": attack.final_distance,
                            "last_iterate_distances": attack.last_iterate_distances,
                            "seconds": round(time.perf_counter() - started, 1),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
