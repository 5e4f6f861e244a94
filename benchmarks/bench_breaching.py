#!/usr/bin/env python3
"""rankaudit's FedAvg round inversion beside breaching 0.1.2's (UserMultiStep, inverting gradients), same round.

Both attacks get the same model and weights (seeded, float64), the same photograph crops and labels, the same
round (N local samples, batch B, E epochs, SGD at lr 0.1, fixed batch order, labels and batch order known to the
server) and the same observed update θ_K − θ₀ (computed once, by rankaudit's simulation of the client). Both run
in float64 with the same step budget and restarts. Both reconstructions are matched to the originals by the same
label-respecting assignment of least total MSE (the update cannot tell same-label samples of one batch apart) and
scored the same way: per-image PSNR on [0, 1], the median over the round's images (an even count: the mean of the
two middle values), SSIM, and the flat-grey baseline that reads no update.

breaching is a benchmark-only dependency; install it in a separate environment, never in rankaudit's own:

    python -m venv --system-site-packages /work/venvs/breaching        # sees the installed CPU torch
    /work/venvs/breaching/bin/pip install --no-deps breaching==0.1.2 lpips hydra-core omegaconf \
        antlr4-python3-runtime==4.9.3
    /work/venvs/breaching/bin/pip install --no-deps torchvision==0.28.0   # the CPU torch's matching release
    # torchvision's compiled ops do not load against torch 2.13.0, and its meta registrations then fail at import
    # ("operator torchvision::nms does not exist"); make the two register_fake decorators conditional:
    sed -i -E 's/^@torch\\.library\\.register_fake\\("torchvision::(q?nms)"\\)$/@(torch.library.register_fake("torchvision::\\1") if hasattr(torch.ops.torchvision, "\\1") else (lambda fn: fn))/' \
        /work/venvs/breaching/lib/python3.11/site-packages/torchvision/_meta_registrations.py

(`--no-deps` keeps pip from replacing the CPU torch with a CUDA build through torchvision's pin.) Then, from the
repository root:

    /work/venvs/breaching/bin/python benchmarks/bench_breaching.py [--steps 1000] [--restarts 2] [--rounds 1,2,3,4,5]

One JSON line per round, then a summary line. A benchmark, not a test: it exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.bound import images as data  # noqa: E402
from rankaudit.settings.round import build_round  # noqa: E402
from rankaudit.verify import baselines
from rankaudit.verify.attacks import fedavg  # noqa: E402
from rankaudit.verify.attacks.invert_match import psnr_from_mse  # noqa: E402
from rankaudit.verify.client import LocalTraining  # noqa: E402
from rankaudit.verify.image_quality import ssim  # noqa: E402

SHAPE = (3, 32, 32)
CLASSES = 10
LR = 0.1


class LeNet32(nn.Module):
    """The LeNet of the gradient-inversion papers (DLG, R-GAP) at 3x32x32: three 5x5 convolutions with sigmoids."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 12, 5, stride=2, padding=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, stride=2, padding=2),
            nn.Sigmoid(),
            nn.Conv2d(12, 12, 5, stride=1, padding=2),
            nn.Sigmoid(),
            nn.Flatten(),
            nn.Linear(12 * 8 * 8, CLASSES),
        )

    def forward(self, x):
        return self.body(x)


class ConvNet32(nn.Module):
    """A small ConvNet at 3x32x32: two 3x3 convolutions (the second strided) with LeakyReLU, one linear layer."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.Linear(32 * 16 * 16, CLASSES),
        )

    def forward(self, x):
        return self.body(x)


# The five rounds: N 2-4, B 1-2, E 1-2, on both nets.
ROUNDS = {
    1: (LeNet32, 2, 1, 1),
    2: (LeNet32, 4, 2, 1),
    3: (LeNet32, 2, 1, 2),
    4: (ConvNet32, 2, 1, 2),
    5: (ConvNet32, 4, 2, 2),
}


def median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])


def breaching_attack(model, images, labels, round_, update, steps, restarts, seed):
    """breaching's inverting-gradients attack on a UserMultiStep update (its own config, our budget, float64)."""
    import breaching
    from omegaconf import OmegaConf

    logging.getLogger("breaching").setLevel(logging.WARNING)
    config = breaching.get_attack_config(
        "invertinggradients",
        overrides=[f"optim.max_iterations={steps}", f"restarts.num_trials={restarts}", "impl.dtype=double"],
    )
    setup = dict(device=torch.device("cpu"), dtype=torch.float64)
    attacker = breaching.attacks.prepare_attack(model, nn.CrossEntropyLoss(), config, setup)
    metadata = OmegaConf.create(dict(shape=list(SHAPE), modality="vision", mean=[0.0] * 3, std=[1.0] * 3))
    payload = [
        dict(parameters=[p.detach() for p in model.parameters()], buffers=list(model.buffers()), metadata=metadata)
    ]
    gradients, start = [], 0
    for parameter in model.parameters():
        gradients.append(update[start : start + parameter.numel()].reshape(parameter.shape).clone())
        start += parameter.numel()
    steps_labels = [labels[0, part] for part in LocalTraining(model, round_, "cross-entropy", []).batches()]
    shared = [
        dict(
            gradients=gradients,
            buffers=None,
            metadata=dict(
                num_data_points=round_.samples,
                labels=labels[0].clone(),
                local_hyperparams=dict(
                    lr=round_.lr, steps=round_.steps, data_per_step=round_.batch_size, labels=steps_labels
                ),
            ),
        )
    ]
    torch.manual_seed(seed)
    found, _ = attacker.reconstruct(payload, shared, server_secrets={}, dryrun=False)
    return found["data"].detach().to(torch.float64).reshape(images.shape)


def scored(images, found, labels) -> dict:
    matched = fedavg._match(found.cpu(), images, labels)
    mse = [float((a - b).pow(2).mean()) for a, b in zip(images[0], matched[0])]
    psnr = [psnr_from_mse(value) for value in mse]
    return {
        "median_psnr": round(median(psnr), 2),
        "psnr": [round(value, 2) for value in psnr],
        "median_ssim": round(median([ssim(a.numpy(), b.numpy()) for a, b in zip(images[0], matched[0])]), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--restarts", type=int, default=2)
    parser.add_argument("--rounds", default="1,2,3,4,5")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tv", type=float, default=fedavg.ROUND_TV_WEIGHT, help="rankaudit's relative TV weight")
    parser.add_argument("--skip-breaching", action="store_true", help="rankaudit only (a prior calibration)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for number in (int(v) for v in args.rounds.split(",")):
        net, samples, batch, epochs = ROUNDS[number]
        round_ = build_round({"local_samples": samples, "batch_size": batch, "local_epochs": epochs, "lr": LR})
        torch.manual_seed(args.seed)
        model = net().double().eval()
        flat, _ = data.load_images(None, SHAPE, samples, args.seed + number)
        images = flat.to(torch.float64).reshape(1, samples, *SHAPE)
        generator = torch.Generator().manual_seed(args.seed + number)
        labels = torch.randint(CLASSES, (1, samples), generator=generator)
        update = fedavg.observed_update(model, images, labels, round_, "cross-entropy")
        started = time.perf_counter()
        ours = fedavg.invert_round(
            model,
            images,
            labels,
            round_,
            "cross-entropy",
            steps=args.steps,
            restarts=args.restarts,
            seed=args.seed,
            dtype=torch.float64,
            tv_weight=args.tv,
        )
        ours_seconds = time.perf_counter() - started
        started = time.perf_counter()
        theirs = (
            ours.reconstructions
            if args.skip_breaching
            else breaching_attack(model, images, labels, round_, update, args.steps, args.restarts, args.seed)
        )
        theirs_seconds = time.perf_counter() - started
        grey = baselines.summary(baselines.score(images[0], ours.reconstructions[0]))["grey_psnr_median"]
        row = {
            "round": number,
            "model": net.__name__,
            "N": samples,
            "B": batch,
            "E": epochs,
            "steps": args.steps,
            "restarts": args.restarts,
            "tv_weight": args.tv,
            "rankaudit": {**scored(images, ours.reconstructions, labels), "seconds": round(ours_seconds, 1)},
            "breaching": {**scored(images, theirs, labels), "seconds": round(theirs_seconds, 1)},
            "grey_median_psnr": round(grey, 2),
        }
        row["ahead"] = row["rankaudit"]["median_psnr"] >= row["breaching"]["median_psnr"]
        row["above_grey"] = row["rankaudit"]["median_psnr"] > row["grey_median_psnr"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        json.dumps(
            {
                "rounds": len(rows),
                "rankaudit_at_or_ahead": sum(r["ahead"] for r in rows),
                "rankaudit_above_grey": sum(r["above_grey"] for r in rows),
                "gap_db": [round(r["rankaudit"]["median_psnr"] - r["breaching"]["median_psnr"], 2) for r in rows],
                "finite": all(math.isfinite(r["rankaudit"]["median_psnr"]) for r in rows),
            }
        )
    )


if __name__ == "__main__":
    main()
