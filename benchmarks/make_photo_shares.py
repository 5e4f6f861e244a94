"""Fit the photographs' per-sample reference that ships with rankaudit (rankaudit/bound/data/photo_shares.json).

Without --data, the per-sample certificate of an image input reads this table: for 1 and 3 channels at 8, 16, 32 and
64 px and a grid of ranks R, a share h such that at least 90 % of photograph crops keep at least h of their difference
from the photographs' shipped mean colour outside any R directions (and the matching hidden energy per pixel, for the
PSNR ceiling).

How each entry is measured: crops of the fitting photographs are cut by two rules (WIDE: a side between a quarter and
all of the photograph's shorter side, the verifiers' default; CLOSE: between an eighth and a half) and resized to the
size with antialiased bilinear resampling, as rankaudit/bound/images.py does. Per photograph collection and rule, each
crop's hidden share is read under the worst of the candidate subspaces the certificate uses with --data (the crops' own
top principal directions, raw and scaled per crop: rankaudit/bound/quantile.py), and the 95 % lower confidence order
statistic of the 10 % quantile is kept. The entry is the least over collections and rules, times a margin per size and
rank: the smallest ratio, over the rules, between one collection's figure and the other's least (leave one collection
out), so that a collection as unlike these two as they are unlike each other still sits above it. Real photographs differ this much: a scene with a plain sky or
a black background has a heavy tail of smooth crops whose detail is almost all in a few coarse directions.

Fitting collections: scikit-learn's two sample photographs, and scikit-image's `coffee` and `chelsea`. The test
(tests/test_energy.py) holds out scikit-image's `astronaut` and `rocket`.

    pip install scikit-learn scikit-image
    python benchmarks/make_photo_shares.py       # writes rankaudit/bound/data/photo_shares.json

Takes a few minutes on two CPU cores.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from rankaudit.bound.energy import reference_mean
from rankaudit.bound.quantile import SAMPLE_CONFIDENCE, SampleShares, order_statistic

OUT = Path(__file__).resolve().parents[1] / "rankaudit" / "bound" / "data" / "photo_shares.json"
SIZES = {8: 2000, 16: 2000, 32: 1000, 64: 500}  # px -> crops per collection and rule
RULES = {"wide": (4, 1), "close": (8, 2)}  # the side: between short/a and short/b
QUANTILE = 0.9
SEED = 11
LUMA = np.array([0.299, 0.587, 0.114])


def collections() -> dict[str, list[np.ndarray]]:
    from skimage import data
    from sklearn.datasets import load_sample_images

    return {
        "scikit-learn": [np.asarray(image, dtype=np.float64) / 255.0 for image in load_sample_images().images],
        "scikit-image": [np.asarray(getattr(data, name)(), dtype=np.float64) / 255.0 for name in ("coffee", "chelsea")],
    }


def crops(photos: list[np.ndarray], size: int, count: int, rule: str, seed: int) -> np.ndarray:
    generator = np.random.default_rng(seed)
    low, high = RULES[rule]
    out = []
    for _ in range(count):
        photo = photos[generator.integers(len(photos))]
        height, width = photo.shape[:2]
        short = min(height, width)
        side = int(generator.integers(max(size, short // low), short // high + 1))
        top, left = generator.integers(0, height - side + 1), generator.integers(0, width - side + 1)
        crop = torch.from_numpy(np.ascontiguousarray(photo[top : top + side, left : left + side])).permute(2, 0, 1)
        resized = F.interpolate(crop[None], size=(size, size), mode="bilinear", align_corners=False, antialias=True)
        out.append(resized[0].clamp(0, 1).numpy())
    return np.stack(out)


def ranks(unknowns: int, count: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, ... below both the unknowns and the crop count (beyond, the crops' own principal
    directions show everything of them: 0)."""
    grid, value = [], 1
    while value < min(unknowns, count - 1):
        grid.append(value)
        power_of_two = value & (value - 1) == 0
        value = value + 1 if value < 4 else (value * 3 // 2 if power_of_two else value * 4 // 3)
    return grid


def quantiles(samples: np.ndarray, grid: list[int]) -> tuple[list[float], list[float]]:
    """Per rank: the order statistic of the hidden shares and of the hidden energies per pixel (worst candidate),
    each crop's detail measured from the reference's mean sample (the photographs' shipped mean colour), as the
    certificate speaks of it."""
    shares = SampleShares.of(samples, reference_mean(samples.shape[1:]))
    k = order_statistic(shares.count, 1 - QUANTILE, SAMPLE_CONFIDENCE)
    unknowns = samples[0].size
    found_shares, found_energies = [], []
    for rank in grid:
        found_shares.append(min(float(np.partition(s, k - 1)[k - 1]) for s in shares.hidden_shares(rank)))
        found_energies.append(
            min(float(np.partition(e, k - 1)[k - 1]) / unknowns for e in shares.hidden_energies(rank))
        )
    return found_shares, found_energies


def main() -> None:
    photos = collections()
    measured = {}  # (channels, size) -> {collection: {rule: (shares, energies)}}
    grids = {}
    for size, count in SIZES.items():
        for channels in (3, 1):
            grid = ranks(channels * size * size, count)
            grids[channels, size] = grid
            for name, group in photos.items():
                for rule in RULES:
                    x = crops(group, size, count, rule, SEED)
                    if channels == 1:
                        x = np.tensordot(LUMA, x, axes=([0], [1]))[:, None]
                    measured.setdefault((channels, size), {}).setdefault(name, {})[rule] = quantiles(x, grid)
            print(f"{channels}x{size}x{size}: measured", flush=True)
    entries = []
    for (channels, size), table in measured.items():
        grid = grids[channels, size]
        names = list(table)
        margins = []
        for position in range(len(grid)):
            # Leave one collection out: how far under the others' least figure at this rank can it fall?
            ratios = [1.0]
            for held in names:
                others = min(table[n][r][0][position] for n in names if n != held for r in RULES)
                ratios += [table[held][r][0][position] / others for r in RULES if others > 0]
            margins.append(min(ratios))
        least = [min(table[n][r][0][i] for n in names for r in RULES) for i in range(len(grid))]
        energy = [min(table[n][r][1][i] for n in names for r in RULES) for i in range(len(grid))]
        # A larger subspace never shows less: the shares stay non-increasing in the rank.
        shares = np.minimum.accumulate([m * v for m, v in zip(margins, least)])
        energies = np.minimum.accumulate([m * v for m, v in zip(margins, energy)])
        entries.append(
            {
                "channels": channels,
                "size": size,
                "ranks": grid,
                "margin": [round(m, 4) for m in margins],
                "hidden_share": [round(float(v), 6) for v in shares],
                "hidden_energy_per_pixel": [float(f"{v:.4g}") for v in energies],
            }
        )
    payload = {
        "name": "photographs' per-sample reference (crops of scikit-learn's and scikit-image's sample photographs)",
        "quantile": QUANTILE,
        "confidence": SAMPLE_CONFIDENCE,
        "fit": {
            "collections": {"scikit-learn": ["china", "flower"], "scikit-image": ["coffee", "chelsea"]},
            "rules": {rule: f"side between short/{a} and short/{b}" for rule, (a, b) in RULES.items()},
            "crops": {str(k): v for k, v in SIZES.items()},
            "seed": SEED,
        },
        "tables": entries,
    }
    OUT.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"-> {OUT}")


if __name__ == "__main__":
    main()
