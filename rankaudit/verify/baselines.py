"""What an image attack must beat to count as a recovery: a flat grey image and each image's own mean colour.

A PSNR on its own does not say whether an attack recovered anything: on a dark digit a flat grey guess already
scores about 9 dB, and an optimisation attack that fails can land below it. Every PSNR the input attacks report
is therefore shown beside two reconstructions that read no gradient at all, scored on the same images:

- **grey**: every pixel at 0.5, the midpoint of the [0, 1] range the attacks project into;
- **mean colour**: each image's own per-channel mean, spread flat over the image. Of all flat images (one value
  per channel) it has the least MSE to that image, so it beats the grey one (or ties) on every image, and a
  batch-wide guess of the colour would do no better. It is an oracle (an attacker does not know it), which makes
  it the stricter bar.

An image counts as recovered only when its reconstruction's PSNR is strictly above both; the attack's outcome is
``recovered`` when every image is, ``failed`` when none is, and ``partly recovered`` in between.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rankaudit.verify.image_quality import ssim

GREY_LEVEL = 0.5
RECOVERED, PARTLY, FAILED = "recovered", "partly recovered", "failed"
DESCRIPTION = (
    f"baselines that read no gradient: a flat grey image ({GREY_LEVEL:g} everywhere) and each image's "
    "own per-channel mean colour (the best flat image for that image, an oracle); an image counts as "
    "recovered only when its PSNR is above both"
)


@dataclass(frozen=True)
class Scored:
    """One image's reconstruction beside its baselines (PSNR in dB on [0, 1]; None is infinite, an exact match)."""

    index: int
    psnr: float | None
    ssim: float | None
    grey_psnr: float | None
    mean_colour_psnr: float | None

    @property
    def recovered(self) -> bool:
        bar = max(_dB(self.grey_psnr), _dB(self.mean_colour_psnr))
        return _dB(self.psnr) > bar


def _dB(value: float | None) -> float:
    return math.inf if value is None else value


def _psnr(reference: torch.Tensor, estimate: torch.Tensor) -> float | None:
    mse = float((reference - estimate).pow(2).mean())
    if mse == 0.0:
        return None
    value = 10.0 * math.log10(1.0 / mse)
    return value if math.isfinite(value) else None


def grey_images(images: torch.Tensor) -> torch.Tensor:
    """The grey baseline for a batch (N, C, ...): every value at GREY_LEVEL."""
    return torch.full_like(images, GREY_LEVEL)


def mean_colour_images(images: torch.Tensor) -> torch.Tensor:
    """The mean-colour baseline for a batch (N, C, ...): each image's channel means, spread over the image."""
    flat = images.reshape(images.shape[0], images.shape[1], -1)
    return flat.mean(dim=2, keepdim=True).expand_as(flat).reshape(images.shape)


def score(originals: torch.Tensor, reconstructions: torch.Tensor) -> list[Scored]:
    """Each reconstruction's PSNR and SSIM, and the two baselines' PSNR, on the same images (N, C, ...)."""
    originals = originals.detach().to(device="cpu", dtype=torch.float64)
    reconstructions = reconstructions.detach().to(device="cpu", dtype=torch.float64)
    if originals.shape != reconstructions.shape:
        raise ValueError(
            f"originals {tuple(originals.shape)} and reconstructions {tuple(reconstructions.shape)} differ in shape"
        )
    grey, mean = grey_images(originals), mean_colour_images(originals)
    scored = []
    for index in range(originals.shape[0]):
        truth, found = originals[index], reconstructions[index]
        finite = bool(torch.isfinite(found).all())
        scored.append(
            Scored(
                index,
                _psnr(truth, found) if finite else -math.inf,
                ssim(truth.numpy(), found.numpy()) if finite else None,
                _psnr(truth, grey[index]),
                _psnr(truth, mean[index]),
            )
        )
    return scored


def _median(values: list[float | None]) -> float | None:
    """Median with None as +∞ (an exact match); None when the median itself is infinite."""
    ordered = sorted(_dB(v) for v in values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    value = ordered[middle] if len(ordered) % 2 else 0.5 * (ordered[middle - 1] + ordered[middle])
    return value if math.isfinite(value) else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def outcome(scored: list[Scored]) -> str:
    recovered = sum(s.recovered for s in scored)
    return RECOVERED if scored and recovered == len(scored) else FAILED if recovered == 0 else PARTLY


def sample_fields(entry: Scored) -> dict:
    """The keys each attacked image's JSON entry gains."""
    return {
        "ssim": entry.ssim,
        "grey_psnr": _finite(entry.grey_psnr),
        "mean_colour_psnr": _finite(entry.mean_colour_psnr),
        "recovered": entry.recovered,
    }


def summary(scored: list[Scored], labels: list[int] | None = None) -> dict:
    """The keys an input attack's verification gains: the baselines' medians, the best image, the outcome.

    The best image is the one of highest PSNR (ties: the lower index); ``index`` is its position in the attacked
    batch, as in ``samples``."""
    best = max(scored, key=lambda s: (_dB(s.psnr), -s.index)) if scored else None
    return {
        "median_ssim": _median_ssim(scored),
        "grey_psnr_median": _median([s.grey_psnr for s in scored]),
        "mean_colour_psnr_median": _median([s.mean_colour_psnr for s in scored]),
        "best": None
        if best is None
        else {
            "index": best.index,
            "psnr": _finite(best.psnr),
            "ssim": best.ssim,
            "grey_psnr": _finite(best.grey_psnr),
            "mean_colour_psnr": _finite(best.mean_colour_psnr),
            "recovered": best.recovered,
        },
        "recovered_samples": sum(s.recovered for s in scored),
        "outcome": outcome(scored),
        "baselines": DESCRIPTION,
    }


def _median_ssim(scored: list[Scored]) -> float | None:
    present = sorted(s.ssim for s in scored if s.ssim is not None)
    if not present:
        return None
    middle = len(present) // 2
    return present[middle] if len(present) % 2 else 0.5 * (present[middle - 1] + present[middle])
