#!/usr/bin/env python3
"""Benchmark: the client-side guard's cost beside the local training it checks.

Run from the repository root:

    python benchmarks/bench_guard.py [--repeat 7] [--samples 500] [--epochs 1] [--out guard.json]

The client: Flower's PyTorch quickstart CNN (conv 6 - pool - conv 16 - pool - fc 120 - fc 84 - fc 10 on 3x32x32,
seeded initial weights) trains, as the quickstart does, with torch.optim.SGD (lr 0.01, momentum 0.9) on batches of
32 of its local samples (random crops of scikit-learn's two sample photographs, Flower's normalisation) for the
given epochs. The guard decides on that update with its defaults (rankaudit.guard.decide.Guard), two ways:

- watched: the training runs inside ``guard.watch(net)``, which records each sample's vectors and signals as the
  steps run; the guard's cost is the watched training's extra time plus the decision;
- alone: the decision makes its own forward and backward pass over the samples (how the command and an adapter
  that does not watch run it).

Each repeat times plain training, watched training and both decisions, in turn, after one untimed warm-up; the
figures are medians of the ratios over the repeats.

Target: the watched guard adds at most 10 % to one local epoch (median ratio <= 0.10).
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


class QuickstartCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x.flatten(1))))))


def photo_crops(count: int, seed: int) -> torch.Tensor:
    from sklearn.datasets import load_sample_images

    images = [torch.tensor(image).permute(2, 0, 1).float() / 255 for image in load_sample_images().images]
    generator = torch.Generator().manual_seed(seed)
    crops = []
    for _ in range(count):
        image = images[int(torch.randint(len(images), (1,), generator=generator))]
        top = int(torch.randint(image.shape[1] - 32, (1,), generator=generator))
        left = int(torch.randint(image.shape[2] - 32, (1,), generator=generator))
        crops.append(image[:, top : top + 32, left : left + 32])
    return (torch.stack(crops) - 0.5) / 0.5


def local_training(model: nn.Module, x, y, epochs: int, batch: int, guard: Guard | None = None) -> dict:
    model = copy.deepcopy(model).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def run():
        for _ in range(epochs):
            for start in range(0, len(x), batch):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(x[start : start + batch]), y[start : start + batch]).backward()
                optimizer.step()

    if guard is None:
        run()
    else:
        with guard.watch(model):
            run()
    return model.state_dict()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--samples", type=int, default=500)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = QuickstartCNN()
    x = photo_crops(args.samples, seed=1)
    y = torch.randint(10, (args.samples,), generator=torch.Generator().manual_seed(1))
    received = {name: value.clone() for name, value in model.state_dict().items()}
    guard = Guard(model)

    sent = local_training(model, x, y, args.epochs, args.batch, guard)  # warm-up, untimed
    guard.decide(received, sent, x, y)
    guard.decide(received, sent, x, y)
    plain, watched_ratios, alone_ratios, actions, timings = [], [], [], [], []
    for _ in range(args.repeat):
        started = time.perf_counter()
        sent = local_training(model, x, y, args.epochs, args.batch)
        trained = time.perf_counter()
        watched_sent = local_training(model, x, y, args.epochs, args.batch, guard)
        watched = time.perf_counter()
        decision, _ = guard.decide(received, watched_sent, x, y)
        decided = time.perf_counter()
        alone, _ = guard.decide(received, sent, x, y)
        done = time.perf_counter()
        training = trained - started
        plain.append(training)
        watched_ratios.append(((watched - trained) - training + (decided - watched)) / training)
        alone_ratios.append((done - decided) / training)
        actions.append(decision.action)
        timings.append((watched - trained, decided - watched, done - decided))
    median = statistics.median(watched_ratios)
    result = {
        "model": "Flower's quickstart CNN (conv 6, conv 16, fc 120, fc 84, fc 10; 3x32x32)",
        "parameters": sum(p.numel() for p in model.parameters()),
        "samples": args.samples,
        "batch": args.batch,
        "epochs": args.epochs,
        "repeat": args.repeat,
        "training_seconds_median": round(statistics.median(plain), 4),
        "watched_training_seconds_median": round(statistics.median(t[0] for t in timings), 4),
        "watched_decision_seconds_median": round(statistics.median(t[1] for t in timings), 4),
        "alone_decision_seconds_median": round(statistics.median(t[2] for t in timings), 4),
        "ratio_median": round(median, 4),
        "ratios": [round(r, 4) for r in watched_ratios],
        "alone_ratio_median": round(statistics.median(alone_ratios), 4),
        "actions": sorted(set(actions)),
        "exact_samples": decision.exact_samples,
        "feature_samples": decision.feature_samples,
        "threads": torch.get_num_threads(),
        "load_average": os.getloadavg(),
        "target": TARGET,
        "passed": median <= TARGET,
    }
    print(json.dumps(result, indent=2))
    print(
        f"{'PASS' if result['passed'] else 'FAIL'}: the watched guard takes {median:.1%} of the local training "
        f"(alone: {result['alone_ratio_median']:.1%}; target <= {TARGET:.0%}); its decision: "
        f"{', '.join(result['actions'])} ({(decision.reasons + decision.notes or ['nothing read'])[0]})"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
