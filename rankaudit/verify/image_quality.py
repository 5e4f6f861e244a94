"""Image quality: PSNR and SSIM of an estimate against its original, written here (no image library needed)."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

DATA_RANGE = 1.0  # the verifiers' images lie in [0, 1]
SSIM_WINDOW = 11
SSIM_SIGMA = 1.5
SSIM_K1, SSIM_K2 = 0.01, 0.03


def psnr(reference: np.ndarray, estimate: np.ndarray, data_range: float = DATA_RANGE) -> float | None:
    """Peak signal-to-noise ratio in dB; None when the two are identical (infinite)."""
    mse = float(np.mean((reference - estimate) ** 2))
    if mse == 0.0:
        return None
    value = 10.0 * math.log10(data_range**2 / mse)
    return value if math.isfinite(value) else None


def _gaussian_window(size: int, sigma: float) -> torch.Tensor:
    offsets = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    line = torch.exp(-(offsets**2) / (2 * sigma**2))
    line = line / line.sum()
    return torch.outer(line, line)


def ssim(reference: np.ndarray, estimate: np.ndarray, data_range: float = DATA_RANGE) -> float | None:
    """Mean SSIM over the valid positions of the window and over channels, for C x H x W images; None otherwise.

    Images smaller than the 11-pixel window use the largest odd window that fits (σ scaled with it)."""
    if reference.ndim != 3 or min(reference.shape[1:]) < 3:
        return None
    size = min(SSIM_WINDOW, min(reference.shape[1:]))
    size -= 1 - size % 2
    window = _gaussian_window(size, SSIM_SIGMA * size / SSIM_WINDOW)[None, None]
    x = torch.as_tensor(reference, dtype=torch.float64)[:, None]  # channels as a batch of 1-channel images
    y = torch.as_tensor(estimate, dtype=torch.float64)[:, None]
    mu_x, mu_y = F.conv2d(x, window), F.conv2d(y, window)
    var_x = F.conv2d(x * x, window) - mu_x**2
    var_y = F.conv2d(y * y, window) - mu_y**2
    cov = F.conv2d(x * y, window) - mu_x * mu_y
    c1, c2 = (SSIM_K1 * data_range) ** 2, (SSIM_K2 * data_range) ** 2
    index = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / ((mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2))
    value = float(index.mean())
    return value if math.isfinite(value) else None
