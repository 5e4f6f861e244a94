#!/usr/bin/env python3
"""Benchmark: the client-side guard's cost beside the local training it checks.

Run from the repository root:

    python benchmarks/bench_guard.py [--repeat 7] [--samples 512] [--epochs 1] [--out guard.json]

The client: a small CIFAR-size CNN (two 3x3 convolutions of 32 and 64 channels with 2x2 max-pooling, a ReLU head of
128 units, 10 classes; 0.55 M parameters) trains, as Flower's PyTorch quickstart does, with torch.optim.SGD
(lr 0.01, momentum 0.9) on batches of 32 of its local samples for the given epochs; the guard then decides on that
update with its defaults (rankaudit.guard.decide.Guard: the architecture check and every bias readout against all
the local samples; no visible-energy check). The decision is reported beside the time: at these weights one fc1 unit
fires for one sample alone and the guard blocks (that sample's features are in the update exactly), which costs
the same check as a send. Each repeat times the training and the guard alone, in turn, after
one untimed warm-up of both; the figure is the median of guard / training over the repeats.

Target: the guard adds under 10 % to the local training (median ratio < 0.10) at one local epoch.
This is a benchmark, not a test: it exits 0 either way and prints PASS or FAIL.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rankaudit.guard.decide import Guard  # noqa: E402

TARGET = 0.10


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def local_training(model: nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int, batch: int) -> dict:
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    for _ in range(epochs):
        for start in range(0, len(x), batch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[start : start + batch]), y[start : start + batch]).backward()
            optimizer.step()
    return model.state_dict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = SmallCNN()
    generator = torch.Generator().manual_seed(1)
    x = torch.rand(args.samples, 3, 32, 32, generator=generator)
    y = torch.randint(10, (args.samples,), generator=generator)
    received = {name: value.clone() for name, value in model.state_dict().items()}
    guard = Guard(model)

    sent = local_training(model, x, y, args.epochs, args.batch)  # warm-up, untimed
    guard.decide(received, sent, x, y)
    training, checking, ratios, actions = [], [], [], []
    for _ in range(args.repeat):
        started = time.perf_counter()
        sent = local_training(model, x, y, args.epochs, args.batch)
        trained = time.perf_counter()
        decision, _ = guard.decide(received, sent, x, y)
        done = time.perf_counter()
        training.append(trained - started)
        checking.append(done - trained)
        ratios.append((done - trained) / (trained - started))
        actions.append(decision.action)
    median = statistics.median(ratios)
    result = {
        "model": "SmallCNN (conv 32, conv 64, fc 128, fc 10; 3x32x32)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "samples": args.samples,
        "batch": args.batch,
        "epochs": args.epochs,
        "repeat": args.repeat,
        "training_seconds_median": round(statistics.median(training), 4),
        "guard_seconds_median": round(statistics.median(checking), 4),
        "ratio_median": round(median, 4),
        "ratios": [round(r, 4) for r in ratios],
        "actions": sorted(set(actions)),
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "target": TARGET,
        "passed": median < TARGET,
    }
    print(json.dumps(result, indent=2))
    print(
        f"{'PASS' if result['passed'] else 'FAIL'}: the guard takes {median:.1%} of the local training "
        f"({result['guard_seconds_median']} s vs {result['training_seconds_median']} s; target < {TARGET:.0%}); "
        f"its decision: {', '.join(result['actions'])} ({decision.reasons[0] if decision.reasons else 'nothing read'})"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
