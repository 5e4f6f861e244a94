"""The rank of a sketch from its singular values: LAPACK's tolerance, the gap at the cut, full rank shown by QR."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

# A rank whose last kept and first dropped singular values are less than three orders of magnitude apart
# depends on where the tolerance falls: flag it.
RELIABLE_GAP = 1e3
TOLERANCE_RULE = "sigma_max * max(rows, n) * eps(float64)"


def sample_ranks(sketch: torch.Tensor, samples: int, rank: int) -> list[int]:
    """rank(J_i) of each of ``samples`` equal column blocks of the sketch S = R·J (method.md: each sample): S's columns of sample
    i are R·J_i, whose rank is rank(J_i) since R has at least min(m, |x|) + 16 rows. Each block by the same rule
    as the whole (QR when it clearly has full rank, else its singular values above LAPACK's tolerance); at full
    rank of S (``rank`` = its column count) every block has full rank and nothing is factorised again."""
    width = sketch.shape[1] // samples
    if samples == 1 or rank >= sketch.shape[1]:
        return [min(rank, width)] * samples if rank >= sketch.shape[1] else [rank]
    return [_spectrum(sketch[:, i * width : (i + 1) * width], want_vectors=False).rank for i in range(samples)]


@dataclass
class _Spectrum:
    rank: int
    tolerance: float
    gap: float | None
    sigma_max: float
    sigma_min_kept: float | None
    values: np.ndarray | None  # every singular value, when a full SVD ran
    right_vectors: torch.Tensor | None  # rows of Vh, when asked for
    how: str  # svd | qr+inverse-iteration

    def reliable(self, shared_gradient_size: int) -> bool:
        """The rank does not hang on where the tolerance falls: a gap of RELIABLE_GAP at the cut, or an empty
        gradient (no shared value, or all zero), whose rank 0 is exact and no tolerance decides."""
        return (self.gap is not None and self.gap >= RELIABLE_GAP) or shared_gradient_size == 0 or not self.sigma_max


def _tolerance(sigma_max: float, sketch: torch.Tensor) -> float:
    return sigma_max * max(sketch.shape) * float(torch.finfo(sketch.dtype).eps)


def _spectrum(sketch: torch.Tensor, *, want_vectors: bool) -> _Spectrum:
    """Rank, tolerance and gap of the sketch.

    An SVD of an (n + 16) x n matrix costs about 8n³/3 flops, half of them memory-bound; a QR costs a
    third of that in matrix products and has the same singular values in its n x n factor R. So full rank is
    first tried cheaply: power iteration gives σ_max, inverse iteration with two triangular solves per step
    gives σ_min (its estimate only ever errs high, by a factor near 1 after INVERSE_STEPS steps); when σ_min
    clears the tolerance by RELIABLE_GAP, the sketch has full rank. Anything else gets the full SVD.
    """
    with _lapack_threads(sketch.device):
        quick = _full_rank_by_qr(sketch)
        if quick is not None:
            return quick  # full rank: no dropped values, no invisible directions to show
        if want_vectors:
            # With fewer rows than unknowns, the reduced Vh misses part of the null space: ask for all of it.
            _, values, vh = torch.linalg.svd(sketch, full_matrices=sketch.shape[0] < sketch.shape[1])
        else:
            values, vh = torch.linalg.svdvals(sketch), None
    values = values.cpu().numpy()
    sigma_max = float(values[0]) if values.size else 0.0
    tolerance = _tolerance(sigma_max, sketch)
    rank = int(np.count_nonzero(values > tolerance)) if sigma_max > 0 else 0
    if rank == 0:
        gap = None
    elif rank < values.size:
        gap = math.inf if values[rank] == 0 else float(values[rank - 1] / values[rank])
    else:
        gap = math.inf if tolerance == 0 else float(values[rank - 1]) / tolerance
    return _Spectrum(rank, tolerance, gap, sigma_max, float(values[rank - 1]) if rank else None, values, vh, "svd")


POWER_STEPS = 30
INVERSE_STEPS = 30


def _full_rank_by_qr(sketch: torch.Tensor) -> _Spectrum | None:
    """Full rank with a clear margin, shown from the triangular factor alone; None when that is not shown."""
    rows, n = sketch.shape
    if rows < n:
        return None
    _, triangular = torch.linalg.qr(sketch, mode="r")
    generator = torch.Generator(device=sketch.device).manual_seed(0)
    vector = torch.randn((n, 1), generator=generator, dtype=sketch.dtype, device=sketch.device)
    for _ in range(POWER_STEPS):
        vector = triangular.T @ (triangular @ vector)
        vector = vector / vector.norm()
    sigma_max = float((triangular @ vector).norm())
    if not math.isfinite(sigma_max) or sigma_max == 0:
        return None
    vector = torch.randn((n, 1), generator=generator, dtype=sketch.dtype, device=sketch.device)
    for _ in range(INVERSE_STEPS):
        vector = torch.linalg.solve_triangular(triangular.T, vector, upper=False)
        vector = torch.linalg.solve_triangular(triangular, vector, upper=True)
        norm = vector.norm()
        if not torch.isfinite(norm) or norm == 0:
            return None
        vector = vector / norm
    sigma_min = float((triangular @ vector).norm())
    tolerance = _tolerance(sigma_max, sketch)
    if not math.isfinite(sigma_min) or sigma_min < RELIABLE_GAP * tolerance:
        return None
    return _Spectrum(n, tolerance, sigma_min / tolerance, sigma_max, sigma_min, None, None, "qr+inverse-iteration")


class _lapack_threads:
    """One thread for the CPU factorisations when the cores are already busy: OpenMP's spin-waiting made an SVD
    16x slower with two threads than with one on a shared 2-core machine at load 10 (1,536², 32 s against 1.9 s)."""

    def __init__(self, device: torch.device):
        self.cpu = device.type == "cpu" and os.getloadavg()[0] > (os.cpu_count() or 1) - 0.5

    def __enter__(self):
        if self.cpu:
            self._threads = torch.get_num_threads()
            torch.set_num_threads(1)

    def __exit__(self, *exc):
        if self.cpu:
            torch.set_num_threads(self._threads)
