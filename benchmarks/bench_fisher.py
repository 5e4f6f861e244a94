#!/usr/bin/env python3
"""Benchmark of the Fisher floor (`--verify fisher`): the floor against two real attacks on the noised update, and the
floor per design as σ varies (the picture on docs/verify/fisher.md).

Run from the repository root (needs `pip install ".[dp,verify]"`; a few minutes on two CPU cores):

    python benchmarks/bench_fisher.py [--samples 4] [--trials 400] [--steps 200] [--out FILE.json] [--svg FILE.svg]

Part 1, the shape of Guo et al.'s result (ICML 2022, Figure 2): a small image model (a 3x3 conv of 8 channels,
tanh, a linear layer to 10 classes) on 1x8x8 crops of the shipped photographs, clipping active (C = 1e-4, below
every sample's gradient norm: the figure then no longer depends on C), q = 1, T = 1, at three σ chosen so that the
worst sample's PSNR ceiling is 30, 20 and 10 dB. At each σ: the MSE floor 1/dFIL of every sample, and the MSE of
- the informed attack of `--verify dp` (M = 10 candidates, one the target, the attacker knows the rest; it picks the
  likeliest candidate given the noised update): its prior is the candidate set, so it can beat the floor, but its
  MSE cannot fall below (1 − B(1/M)) × the distance to the nearest other candidate (it succeeds at most B(1/M) of
  the time, and every miss costs at least that distance);
- inverting gradients (rankaudit.verify.attacks.invert: cosine matching with a TV prior, in [0, 1]) on the noised
  clipped gradient: its prior is the box and TV; what the prior alone gives is measured by the same attack on an
  update of pure noise, and by the best constant image (the photographs' mean).
PASS when neither attack's MSE is below min(floor, what its prior alone explains).

Part 2: the worst sample's PSNR ceiling against σ for a few designs (examples/), every sample clipped (C = 1e-12,
the limit in which the update tells only the gradient's direction), 2 samples each: the straight lines (−20 dB per
decade of σ) of docs/img/fisher-floor.svg.

Part 3, what a prior fills in: a 2x2-average-pool-first CNN (pool, 3x3 conv of 16, ReLU, strided 3x3 conv of 16,
ReLU, linear to 10) on 3x16x16 crops, σ 0.003, C 1.4, q = 1, T = 1. Per sample: the unbiased ceiling, the ceiling
with the mean filling what J cannot see, the noise-free limit of the latter (each 2x2 block's mean plus the mean
image's detail inside it), the best linear unbiased attacker on the visible part reading a noised update (dense J,
the noise drawn), and inverting gradients with its TV prior on the noised clipped gradient. PASS when the linear
attacker stays at or under the ceiling with the mean (the inverting attack's prior is an image prior, outside both
lines: printed, not judged).

This is a benchmark, not a test: it exits 0 and prints PASS/FAIL.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.bound import dp as dp_bound  # noqa: E402
from rankaudit.bound import fisher as fisher_bound  # noqa: E402
from rankaudit.bound.images import load_images  # noqa: E402
from rankaudit.settings.round import DPSettings  # noqa: E402
from rankaudit.verify.attacks.dp import unit_gradients  # noqa: E402
from rankaudit.verify.attacks.invert import invert_gradients  # noqa: E402
from rankaudit.verify.jacobian_products import ClippedGradientProducts  # noqa: E402
from rankaudit.verify.rank.fisher import measure_samples  # noqa: E402

CLIP = 1e-4
SHAPE = (1, 8, 8)
CLASSES = 10
CANDIDATES = 10
CEILINGS_DB = (30.0, 20.0, 10.0)
DESIGNS = ("lenet", "cnn6", "cnn6_d", "resnet18_w16", "resnet18_w16_cut8")
# Part 2's clip norm: below every design's per-sample gradient norms at initialisation (LeNet's sigmoids give norms
# far below 1e-4), so every sample is clipped and the figure is C's limit: the update tells only the gradient's
# direction.
DESIGN_CLIP = 1e-12


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(8 * 8 * 8, CLASSES)).double()


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).pow(2).mean())


def informed_attack(model, pool, labels, noise: float, trials: int, seed: int) -> dict:
    """--verify dp's attack at q = 1, T = 1 on M candidates drawn from the pool: the MSE of its pick, and the MSE
    its prior alone forces (1 − B(1/M)) × the distance to the nearest other candidate."""
    generator = torch.Generator().manual_seed(seed)
    grads = unit_gradients(model, pool[:, None], labels[:, None], "cross-entropy", CLIP, "cpu").double()
    bound = dp_bound.dp_bound(DPSettings(noise_multiplier=noise, prior=1 / CANDIDATES), curve=False)
    success_bound = bound.reconstruction_bound
    errors, floors, hits = [], [], 0
    for _ in range(trials):
        chosen = torch.randperm(len(pool), generator=generator)[:CANDIDATES]
        target = int(chosen[torch.randint(CANDIDATES, (), generator=generator)])
        update = grads[target] + noise * torch.randn(grads.shape[1], generator=generator, dtype=torch.float64)
        candidates = grads[chosen]
        scores = candidates @ update - candidates.pow(2).sum(dim=1) / 2  # log-likelihood up to a constant
        pick = int(chosen[int(scores.argmax())])
        hits += pick == target
        errors.append(_mse(pool[pick], pool[target]))
        nearest = min(_mse(pool[int(j)], pool[target]) for j in chosen if int(j) != target)
        floors.append((1 - success_bound) * nearest)
    return {
        "mse": statistics.fmean(errors),
        "success": hits / trials,
        "bound": success_bound,
        "prior_explains": statistics.fmean(floors),
        "trials": trials,
    }


def inverting_attack(model, images, labels, noise: float, steps: int, seed: int, informative: bool = True) -> list:
    """Inverting gradients on each image's noised clipped gradient (informative=False: on pure noise)."""
    names = [name for name, _ in model.named_parameters()]
    generator = torch.Generator().manual_seed(seed)
    errors = []
    for number, (x, label) in enumerate(zip(images, labels)):
        products = ClippedGradientProducts(model, int(label), clip=CLIP, loss="cross-entropy")
        clean = products.gradient(x.double()) if informative else torch.zeros(products.size, dtype=torch.float64)
        noised = clean + noise * torch.randn(products.size, generator=generator, dtype=torch.float64)
        target, offset = {}, 0
        for name in names:
            size = products.params[name].numel()
            target[name] = noised[offset : offset + size].reshape(products.params[name].shape)
            offset += size
        outcome = invert_gradients(
            model, target, SHAPE, int(label), steps=steps, restarts=1, device="cpu", seed=seed + number
        )
        errors.append(_mse(outcome.x_hat.reshape(x.shape), x))
    return errors


def guo_shape(samples: int, trials: int, steps: int) -> dict:
    model = small_model()
    pool, _ = load_images(None, SHAPE, 40, seed=1)
    pool = pool.double()
    labels = torch.arange(len(pool)) % CLASSES
    images, image_labels = pool[:samples], labels[:samples]
    measured = measure_samples(model, images, image_labels, clip=CLIP, loss="cross-entropy")
    assert all(one["clipped"] for one in measured), "C must sit below every sample's gradient norm"
    largest = max(one["frobenius_squared"] for one in measured)
    d = images[0].numel()
    constant = _mse(pool.mean(dim=0).expand_as(images), images)
    prior_only = statistics.fmean(inverting_attack(model, images, image_labels, 1.0, steps, 99, informative=False))
    rows = []
    for ceiling in CEILINGS_DB:
        noise = fisher_bound.least_noise_for_psnr(largest, d, 1.0, ceiling)
        line = fisher_bound.read_samples(measured, dimension=d, noise_multiplier=noise, sample_rate=1.0, steps=1)
        floors = [one["mse_floor"] for one in line["samples"]]
        started = time.perf_counter()
        informed = informed_attack(model, pool, labels, noise, trials, seed=int(ceiling))
        inverted = inverting_attack(model, images, image_labels, noise, steps, seed=int(ceiling))
        floor = statistics.fmean(floors)
        prior = min(prior_only, constant)
        rows.append(
            {
                "noise_multiplier": noise,
                "worst_psnr_ceiling": ceiling,
                "mse_floor_mean": floor,
                "mse_floor_min": min(floors),
                "informed_mse": informed["mse"],
                "informed_success": informed["success"],
                "informed_success_bound": informed["bound"],
                "informed_prior_explains": informed["prior_explains"],
                "inverting_mse": statistics.fmean(inverted),
                "inverting_prior_explains": prior,
                "informed_ok": informed["mse"] >= min(min(floors), informed["prior_explains"]),
                "inverting_ok": statistics.fmean(inverted) >= min(min(floors), prior),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    return {
        "model": "conv 1->8 3x3, tanh, linear 512->10, seeded initialisation",
        "input": "1x8x8 crops of scikit-learn's sample photographs",
        "clip": CLIP,
        "samples": samples,
        "constant_image_mse": constant,
        "inverting_on_pure_noise_mse": prior_only,
        "rows": rows,
        "pass": all(row["informed_ok"] and row["inverting_ok"] for row in rows),
    }


def designs_by_noise() -> dict:
    """The worst sample's PSNR ceiling at σ = 1 per design (C = 1e-4): the line 10·log10(dFIL(1)) − 20·log10 σ."""
    from rankaudit.design.fisher_review import design_line
    from rankaudit.model.load import load_model

    out = {}
    for name in DESIGNS:
        spec = str(REPO / "examples" / f"{name}.py")
        shape = load_model(spec, None, device="meta").input_shape
        started = time.perf_counter()
        line = design_line(spec, shape, DPSettings(noise_multiplier=1.0, clip=DESIGN_CLIP), 20.0, None)
        out[name] = {
            "input_shape": list(shape),
            "worst_psnr_ceiling_at_1": line["worst"]["psnr_ceiling"],
            "median_psnr_ceiling_at_1": line["median_psnr_ceiling"],
            "least_noise_20db": line["least_noise"],
            "estimator": line["estimator"],
            "clipped": all(sample["clipped"] for sample in line["samples"]),
            "seconds": round(time.perf_counter() - started, 1),
        }
        print(
            f"  {name}: worst PSNR ceiling at σ 1 {line['worst']['psnr_ceiling']:.1f} dB, σ for 20 dB "
            f"{line['least_noise']:.3g} ({out[name]['seconds']} s)",
            flush=True,
        )
    return out


PRIOR_SHAPE = (3, 16, 16)
PRIOR_NOISE, PRIOR_CLIP = 0.003, 1.4


def pooling_first_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.AvgPool2d(2),
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, stride=2),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, CLASSES),
    ).double()


def _psnr(mse: float) -> float:
    return 10 * math.log10(1.0 / mse)


def with_prior(samples: int, steps: int, draws: int = 32) -> dict:
    """Part 3: the line with a prior on the pooling-first CNN against what attackers reach."""
    import torch.nn.functional as F

    from rankaudit.verify.rank.fisher_prior import reference_mean

    model = pooling_first_model()
    images = load_images(None, PRIOR_SHAPE, samples, seed=0)[0].double()
    mean, _ = reference_mean(PRIOR_SHAPE, None, 0)
    labels = torch.arange(samples) % CLASSES
    d = images[0].numel()
    started = time.perf_counter()
    measured = measure_samples(model, images, labels, clip=PRIOR_CLIP, loss="cross-entropy", mean=mean)
    line = fisher_bound.read_samples(measured, dimension=d, noise_multiplier=PRIOR_NOISE, sample_rate=1.0, steps=1)
    measured_seconds = time.perf_counter() - started
    generator = torch.Generator().manual_seed(7)
    rows = []

    def blocks(image):
        return F.interpolate(F.avg_pool2d(image[None], 2), scale_factor=2, mode="nearest")[0]

    for number, (x, label, one) in enumerate(zip(images, labels, line["samples"])):
        products = ClippedGradientProducts(model, int(label), clip=PRIOR_CLIP, loss="cross-entropy")
        jacobian = products.jacobian(x)
        pseudo_inverse = torch.linalg.pinv(jacobian, rtol=1e-10)
        fill = mean.reshape(-1) - pseudo_inverse @ (jacobian @ mean.reshape(-1))
        errors = []
        for _ in range(draws):
            noise = PRIOR_NOISE * torch.randn(jacobian.shape[0], generator=generator, dtype=torch.float64)
            guess = pseudo_inverse @ (jacobian @ x.reshape(-1) + noise) + fill
            errors.append(float((guess - x.reshape(-1)).square().mean()))
        limit = blocks(x) + mean - blocks(mean)
        names = [name for name, _ in model.named_parameters()]
        noised = products.gradient(x) + PRIOR_NOISE * torch.randn(
            products.size, generator=generator, dtype=torch.float64
        )
        target, offset = {}, 0
        for name in names:
            size = products.params[name].numel()
            target[name] = noised[offset : offset + size].reshape(products.params[name].shape)
            offset += size
        outcome = invert_gradients(
            model, target, PRIOR_SHAPE, int(label), steps=steps, restarts=1, device="cpu", seed=number
        )
        rows.append(
            {
                "rank": one["rank"],
                "hidden": one["hidden"],
                "psnr_ceiling": one["psnr_ceiling"],
                "prior_psnr_ceiling": one["prior_psnr_ceiling"],
                "noise_free_limit_psnr": _psnr(_mse(limit, x)),
                "block_mean_image_psnr": _psnr(_mse(blocks(x), x)),
                "linear_attack_psnr": _psnr(statistics.fmean(errors)),
                "inverting_psnr": _psnr(_mse(outcome.x_hat.reshape(x.shape), x)),
            }
        )
    return {
        "model": "avg-pool 2, conv 3->16 3x3, ReLU, conv 16->16 3x3 stride 2, ReLU, linear 256->10, seeded",
        "input": "3x16x16 crops of scikit-learn's sample photographs",
        "noise_multiplier": PRIOR_NOISE,
        "clip": PRIOR_CLIP,
        "median_psnr_ceiling": line["median_psnr_ceiling"],
        "median_prior_psnr_ceiling": line["median_prior_psnr_ceiling"],
        "measured_seconds": round(measured_seconds, 1),
        "rows": rows,
        "pass": all(row["linear_attack_psnr"] <= row["prior_psnr_ceiling"] + 0.1 for row in rows),
    }


def picture(designs: dict, guo: dict | None) -> str:
    """An SVG: PSNR ceiling (dB) against σ on a log axis, one line per design, the 20 dB target dashed."""
    width, height, left, right, top, bottom = 700, 380, 60, 210, 20, 45
    low, high = -5.0, 0.0  # log10 σ
    ymin, ymax = -80.0, 60.0

    def x(log_sigma):
        return left + (log_sigma - low) / (high - low) * (width - left - right)

    def y(db):
        return top + (ymax - min(max(db, ymin), ymax)) / (ymax - ymin) * (height - top - bottom)

    colours = ("#1b6ca8", "#d1495b", "#edae49", "#00798c", "#30638e", "#7a5195")
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" fill="none" '
        'stroke="#999"/>',
    ]
    for tick in range(int(low), int(high) + 1):
        parts.append(
            f'<line x1="{x(tick):.1f}" y1="{height - bottom}" x2="{x(tick):.1f}" y2="{height - bottom + 4}" '
            'stroke="#555"/>'
        )
        parts.append(f'<text x="{x(tick):.1f}" y="{height - bottom + 16}" text-anchor="middle">1e{tick}</text>')
    for db in range(int(ymin), int(ymax) + 1, 20):
        parts.append(f'<line x1="{left - 4}" y1="{y(db):.1f}" x2="{left}" y2="{y(db):.1f}" stroke="#555"/>')
        parts.append(f'<text x="{left - 7}" y="{y(db) + 4:.1f}" text-anchor="end">{db}</text>')
    parts.append(
        f'<text x="{(left + width - right) / 2}" y="{height - 8}" text-anchor="middle">noise multiplier σ '
        "(every sample clipped, q = 1, T = 1)</text>"
    )
    parts.append(
        f'<text x="14" y="{(top + height - bottom) / 2}" text-anchor="middle" '
        f'transform="rotate(-90 14 {(top + height - bottom) / 2})">PSNR ceiling of the worst sample (dB)</text>'
    )
    parts.append(
        f'<line x1="{left}" y1="{y(20):.1f}" x2="{width - right}" y2="{y(20):.1f}" stroke="#333" '
        'stroke-dasharray="5,4"/>'
    )
    parts.append(f'<text x="{width - right + 6}" y="{y(20) + 4:.1f}">20 dB target</text>')
    parts.append(f'<text x="{width - right + 6}" y="158">the least σ for 20 dB:</text>')
    for number, (name, one) in enumerate(designs.items()):
        at_one = one["worst_psnr_ceiling_at_1"]  # the line: PSNR(σ) = at_one − 20·log10 σ, cut to the box
        colour = colours[number % len(colours)]
        start = max(low, (at_one - ymax) / 20)
        end = min(high, (at_one - ymin) / 20)
        if start < end:
            parts.append(
                f'<line x1="{x(start):.1f}" y1="{y(at_one - 20 * start):.1f}" x2="{x(end):.1f}" '
                f'y2="{y(at_one - 20 * end):.1f}" stroke="{colour}" stroke-width="2"/>'
            )
        parts.append(
            f'<text x="{width - right + 6}" y="{176 + 16 * number}" fill="{colour}">{name}: σ '
            f"{one['least_noise_20db']:.2g}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--trials", type=int, default=400)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--svg", type=Path)
    parser.add_argument("--skip-designs", action="store_true", help="only part 1 (the attacks)")
    parser.add_argument("--skip-attacks", action="store_true", help="only part 2 (the designs and the picture)")
    parser.add_argument("--skip-prior", action="store_true", help="leave out part 3 (what a prior fills in)")
    args = parser.parse_args()
    guo = None
    if not args.skip_attacks:
        print("Part 1: the floor against the attacks", flush=True)
        guo = guo_shape(args.samples, args.trials, args.steps)
        for row in guo["rows"]:
            print(
                f"  σ {row['noise_multiplier']:.3g} (worst ceiling {row['worst_psnr_ceiling']:.0f} dB): floor "
                f"{row['mse_floor_mean']:.3g} (least {row['mse_floor_min']:.3g}); informed {row['informed_mse']:.3g} "
                f"(success {row['informed_success']:.2f} <= B {row['informed_success_bound']:.2f}, prior explains "
                f"{row['informed_prior_explains']:.3g}); inverting {row['inverting_mse']:.3g} (prior alone "
                f"{row['inverting_prior_explains']:.3g}); {row['seconds']} s",
                flush=True,
            )
        print(
            f"  constant image {guo['constant_image_mse']:.3g}, inverting on pure noise "
            f"{guo['inverting_on_pure_noise_mse']:.3g}"
        )
        print(f"Part 1: {'PASS' if guo['pass'] else 'FAIL'}")
    designs = {}
    if not args.skip_designs:
        print("Part 2: the floor per design", flush=True)
        designs = designs_by_noise()
    prior = None
    if not args.skip_prior:
        print("Part 3: what a prior fills in (average pool first, 3x16x16)", flush=True)
        prior = with_prior(max(args.samples, 2), args.steps)
        for row in prior["rows"]:
            print(
                f"  rank {row['rank']}: ceiling {row['psnr_ceiling']:.1f} dB unbiased, {row['prior_psnr_ceiling']:.1f} "
                f"dB with the mean (noise-free limit {row['noise_free_limit_psnr']:.1f} dB, block means alone "
                f"{row['block_mean_image_psnr']:.1f} dB); linear attack {row['linear_attack_psnr']:.1f} dB, "
                f"inverting gradients {row['inverting_psnr']:.1f} dB",
                flush=True,
            )
        print(
            f"  median ceiling {prior['median_psnr_ceiling']:.2f} dB unbiased, {prior['median_prior_psnr_ceiling']:.2f}"
            f" dB with the mean ({prior['measured_seconds']} s to measure)"
        )
        print(f"Part 3: {'PASS' if prior['pass'] else 'FAIL'}")
    report = {
        "guo_shape": guo,
        "designs": designs,
        "with_prior": prior,
        "device": "cpu",
        "threads": torch.get_num_threads(),
    }
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.svg and designs:
        args.svg.write_text(picture(designs, guo))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
