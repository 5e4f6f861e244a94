"""Full rank from a float32 sketch whose smallest singular values sit too close to its error: the trailing rows
recomputed in float64 (docs/method.md, "The numerical check").

The float32 sketch S32 = S + E (S = R·J the float64 sketch, never formed; ‖E‖₂ <= ε estimated from rows recomputed
in float64) shows full rank by Weyl's inequality only when σ_min(S32) clears ε by a margin. On a deep network the
few smallest singular values often do not, though all the others clear it by orders of magnitude. Rotate the rows
by an orthogonal W = [W_b, W_s] (W_s: S32's k trailing left singular vectors): T = WᵀS has S's singular values, and

- its last k rows W_sᵀS = (W_sᵀR)·J are the sketch rows of the k directions W_sᵀR, computed in float64 (exact, C);
- its first rows W_bᵀS = B̂ − W_bᵀE with B̂ = W_bᵀS32 known and ‖W_bᵀE‖₂ <= ε.

For a unit vector v, ‖Tv‖² >= (‖B̂v‖ − ε)₊² + ‖Cv‖², and (a − ε)₊² >= (1 − τ)a² − (1/τ − 1)ε² for any τ in (0, 1].
So, with B̂ᵀB̂ = S32ᵀS32 − (W_sᵀS32)ᵀ(W_sᵀS32),

    σ_min(S)² >= λ_min((1 − τ)·B̂ᵀB̂ + CᵀC) − (1/τ − 1)·ε²,

a lower bound in which ε only ever meets B̂, whose singular values are S32's larger ones. It is evaluated with ε
taken the margin times over (the margin guards the estimate of ε, as for the plain float32 sketch) and with the
eigenvalue solver's rounding subtracted. Cost: the rows of R drawn again (their seeds are fixed), k float64 rows,
and two d × d symmetric eigenproblems, in about three d × d matrices of memory beside the sketch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

# Trailing rows tried, smallest first: the first k whose next singular value of S32 clears the margin-scaled error
# CLEARANCE times over is used.
TRAILING = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
CLEARANCE = 4.0
# Rows of R drawn again per pass while the trailing directions W_sᵀR are accumulated.
DRAW_CHUNK = 128


@dataclass
class Refinement:
    """σ_min(S) from below, with the trailing rows recomputed in float64."""

    sigma_min_at_least: float
    trailing: int  # k: rows recomputed in float64
    next_singular_value: float  # S32's (d − k)-th singular value, the smallest that still meets the error
    seconds: float


def trailing_rows_bound(
    wide: torch.Tensor,
    error: float,
    *,
    draw_rows: Callable[[int, int], torch.Tensor],
    exact_rows: Callable[[torch.Tensor], torch.Tensor],
    margin: float,
    width: int,
    memory_bytes: int | None = None,
) -> Refinement | None:
    """A lower bound on σ_min(S) for the float64 sketch S that ``wide`` (S32 widened to float64, rows x d, rows >= d)
    approximates to ``error`` (an estimate of ‖S32 − S‖₂), or None when no k in TRAILING leaves the rest of S32
    clear of the error, or when what it needs would take more than ``memory_bytes``.

    ``width``: m, the shared gradient's values (R's columns); ``draw_rows(first, count)``: rows first .. first + count - 1 of R (count x m, any float dtype; valid until the
    next call); ``exact_rows(directions)``: the float64 sketch rows rᵀJ of the rows of ``directions`` (k x m,
    float64), k x d."""
    started = time.perf_counter()
    rows, d = wide.shape
    if memory_bytes is not None and needed_bytes(rows, d, width, TRAILING[0]) > memory_bytes:
        return None
    scaled = margin * error
    eps = float(torch.finfo(wide.dtype).eps)
    gram = wide.T @ wide
    traced = float(gram.diagonal().sum())  # ‖S32‖_F²
    values, vectors = torch.linalg.eigh(gram)  # ascending: S32's squared singular values
    trailing = next((k for k in TRAILING if k < d and float(values[k].clamp_min(0)) >= (CLEARANCE * scaled) ** 2), None)
    if trailing is None or (memory_bytes is not None and needed_bytes(rows, d, width, trailing) > memory_bytes):
        return None
    # W_s: the left singular vectors of the k smallest, S32 v / σ, orthonormalised (any orthonormal W_s keeps the
    # bound valid; these make it sharp).
    left, _ = torch.linalg.qr(wide @ vectors[:, :trailing])
    del vectors
    directions = _combined_rows(left, draw_rows, rows)
    exact = exact_rows(directions).reshape(trailing, d).to(wide.dtype)  # C = W_sᵀS, in float64
    del directions
    projected = left.T @ wide  # W_sᵀS32
    kept = gram.addmm_(projected.T, projected, alpha=-1.0)  # B̂ᵀB̂, in gram's memory
    covered_trace = float(exact.square().sum())
    smallest, next_value = float(values[0].clamp_min(0)), float(values[trailing])
    # Rounding, bounded the worst way: forming a Gram matrix in floating point errs entrywise by at most
    # rows·ε·|A|ᵀ|A|, whose norm is at most ‖A‖_F² (its trace); the subtraction and the eigensolver add as much
    # again at most, each.
    rounding = 3 * max(rows, d) * eps * (traced + covered_trace)
    best = -math.inf
    # (1 − τ) near σ_min²/σ_b² makes B̂ cover its directions about as well as C covers the trailing ones, at the
    # least cost in ε: that first, then a larger share and τ = 1/2 only while no bound is found.
    for factor in (4.0, 32.0, math.inf):
        share = min(0.5, factor * smallest / next_value)
        if share <= 0:
            continue
        penalty = share / (1.0 - share) * scaled**2  # (1/τ − 1)·ε²
        combined = (kept * share).addmm_(exact.T, exact)
        lowest = float(torch.linalg.eigvalsh(combined)[0])
        del combined
        best = max(best, lowest - penalty - rounding)
        if best <= 0 and lowest > penalty:
            # The Gram matrix's rounding hides what is there: the same matrix as a stack of rows,
            # [√(1 − τ)·W_bᵀS32; C] (W_bᵀS32 as (I − W_sW_sᵀ)S32, which has the same singular values and k
            # zeros), whose SVD resolves singular values down to ε·‖·‖ instead of √ε·‖·‖.
            stacked = torch.cat([math.sqrt(share) * (wide - left @ projected), exact])
            slack = 3 * max(stacked.shape) * eps * float(stacked.norm())
            lowest_root = max(0.0, float(torch.linalg.svdvals(stacked)[-1]) - slack)
            del stacked
            best = max(best, lowest_root**2 - penalty)
        if best > 0 or share == 0.5:
            break
    return Refinement(
        sigma_min_at_least=math.sqrt(best) if best > 0 else 0.0,
        trailing=trailing,
        next_singular_value=math.sqrt(max(next_value, 0.0)),
        seconds=time.perf_counter() - started,
    )


def needed_bytes(rows: int, d: int, width: int, trailing: int) -> int:
    """Memory beside the sketch: three d x d float64 matrices, the stacked rows of the last resort, the trailing
    directions (trailing x width) and the chunk of rows drawn again (float32, and its float64 copy)."""
    return 8 * (3 * d * d + (rows + trailing) * d + trailing * width) + 12 * DRAW_CHUNK * width


def _combined_rows(left: torch.Tensor, draw_rows: Callable[[int, int], torch.Tensor], rows: int) -> torch.Tensor:
    """W_sᵀR (k x m, float64): the trailing directions, from R drawn again in chunks."""
    combined = None
    wide = None
    for first in range(0, rows, DRAW_CHUNK):
        count = min(DRAW_CHUNK, rows - first)
        drawn = draw_rows(first, count)
        if combined is None:
            combined = torch.zeros((left.shape[1], drawn.shape[1]), dtype=left.dtype, device=drawn.device)
            wide = torch.empty((DRAW_CHUNK, drawn.shape[1]), dtype=left.dtype, device=drawn.device)
        block = wide[:count].copy_(drawn)  # one buffer for every chunk: fresh memory costs a page fault per page
        combined.addmm_(left[first : first + count].T.to(drawn.device), block)
    assert combined is not None
    return combined
