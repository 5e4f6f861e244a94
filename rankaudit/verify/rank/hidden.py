"""method.md: verdicts, measured: how much of each input the gradient cannot see, and the visible part an attacker gets.

With c the batch's deviation from the reference's mean sample (the certificate's quantity; each sample's own mean
where no reference mean is given) and P the orthogonal projection onto the measured invisible
subspace (right singular vectors of the dropped singular values of the sketch, over all B·|x| unknowns), sample
i's hidden energy is h_i = ‖(P c)_i‖² / ‖c_i‖², and its visible part x_i − (P c)_i is what any attacker recovers
from the gradient to first order without an image prior. The visible part is scored against x_i by PSNR and by
SSIM (Wang, Bovik, Sheikh & Simoncelli 2004: 11x11 Gaussian window, σ = 1.5, K1 = 0.01, K2 = 0.03), both
from rankaudit.verify.image_quality, on the images' range [0, 1].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rankaudit.verify.image_quality import psnr, ssim


@dataclass
class InputShare:
    """One input of a checked batch: its share of the invisible subspace and its visible part's quality."""

    hidden_energy: float | None  # ‖(P c)_i‖² / ‖c_i‖²; None for a constant input (c_i = 0)
    visible_psnr: float | None  # dB; None when the visible part is the input itself (PSNR infinite)
    visible_ssim: float | None  # None for inputs that are not images (C x H x W)


def centred(batch: torch.Tensor, centre=None) -> torch.Tensor:
    """Each sample's deviation from `centre` (the reference's mean sample, flat |x| values: what the certificate
    measures a sample's detail from); without one, from the sample's own mean over all its values."""
    flat = batch.reshape(batch.shape[0], -1)
    if centre is None:
        return (flat - flat.mean(dim=1, keepdim=True)).reshape(batch.shape)
    centre = torch.as_tensor(np.asarray(centre), dtype=flat.dtype, device=flat.device).reshape(1, -1)
    return (flat - centre).reshape(batch.shape)


def invisible_component(batch: torch.Tensor, right_vectors: torch.Tensor, rank: int, centre=None) -> np.ndarray:
    """P c for the whole batch, shaped like it: `right_vectors` are the sketch's n right singular vectors (rows,
    by descending singular value), of which the first `rank` span what the gradient sees.

    Projects with whichever basis is smaller: the dropped rows directly, or c minus its part in the kept rows."""
    n = batch.numel()
    c = centred(batch, centre).reshape(-1).to(device=right_vectors.device, dtype=right_vectors.dtype)
    if rank >= n:
        return np.zeros(tuple(batch.shape))
    if n - rank <= rank:
        dropped = right_vectors[rank:n]
        part = dropped.T @ (dropped @ c)
    else:
        kept = right_vectors[:rank]
        part = c - kept.T @ (kept @ c)
    return part.reshape(batch.shape).cpu().numpy()


def measured_invisible(
    batch: torch.Tensor, right_vectors: torch.Tensor | None, rank: int, centre=None
) -> np.ndarray | None:
    """P c from a rank measurement: zeros at full rank (nothing hidden, no vectors needed), None when a deficit
    came without the SVD's vectors (they did not fit the device, or an unchecked float32 sketch): unmeasured."""
    if rank >= batch.numel():
        return np.zeros(tuple(batch.shape))
    return None if right_vectors is None else invisible_component(batch, right_vectors, rank, centre)


def visible_parts(batch: np.ndarray, invisible: np.ndarray) -> np.ndarray:
    """x_i − (P c)_i: the input with its invisible component taken out."""
    return batch - invisible


def shares(batch: np.ndarray, invisible: np.ndarray, centre=None) -> list[InputShare]:
    """Per input of the batch: hidden energy (of its deviation from `centre`, as centred), and the visible part's
    PSNR and SSIM against the input."""
    centred_batch = centred(torch.as_tensor(batch, dtype=torch.float64), centre).numpy()
    visible = visible_parts(batch, invisible)
    found = []
    for original, centre, hidden, seen in zip(batch, centred_batch, invisible, visible):
        energy = float(np.sum(centre**2))
        share = float(np.sum(hidden**2)) / energy if energy > 0 else None
        found.append(
            InputShare(
                share if share is None or math.isfinite(share) else None, psnr(original, seen), ssim(original, seen)
            )
        )
    return found


def median(values: list[float | None], *, none_is_infinite: bool = False) -> float | None:
    """The median of measured values. For PSNR, None means infinite and takes part as +∞ (the result is None when
    the median itself is infinite); elsewhere None means unmeasured and is left out."""
    if none_is_infinite:
        ordered = sorted(values, key=lambda v: math.inf if v is None else v)
        if not ordered:
            return None
        middle = len(ordered) // 2
        picks = ordered[middle - 1 : middle + 1] if len(ordered) % 2 == 0 else [ordered[middle]]
        return None if any(v is None for v in picks) else float(np.mean(picks))
    present = [v for v in values if v is not None]
    return float(np.median(present)) if present else None


# How the reports read the visible part's median PSNR. Gradient-inversion papers count reconstructions from about
# 20-25 dB as successful; Figure 2(e)'s visible parts at 28-34 dB have SSIM 0.99. From 25 dB the picture is the
# image; from 15 dB a degraded but recognisable one; below, a poor one.
SHOWS_THE_IMAGE_DB = 25.0
POOR_PICTURE_DB = 15.0


def reading(psnrs: list[float | None], psnr_median: float | None) -> str:
    """One phrase for the visible part's median PSNR (None: infinite, nothing hidden)."""
    if not psnrs:
        return "no inputs measured"
    if psnr_median is None or psnr_median >= SHOWS_THE_IMAGE_DB:
        return "the gradient shows the image"
    if psnr_median >= POOR_PICTURE_DB:
        return "the gradient shows a degraded image"
    return "the visible part is a poor picture of the image"
