"""The rank check without a dense sketch: block Lanczos on JᵀJ, from products with J and Jᵀ only.

docs/method.md, "The numerical check". The dense check sketches S = R·J with one row per input value; here the
Gram matrix A = JᵀJ (d × d, d the sample's values) is only ever applied to a block of vectors (A V = Jᵀ(J V): a
forward-over-reverse product, then a reverse-over-reverse one), and an orthonormal Krylov basis Q of
span{c, A c, A² c, …} (c the sample's deviation from its mean, plus random vectors) is grown block by block with
full reorthogonalisation. What that buys:

- **The rank, from below.** The Ritz values θ_1 ≥ θ_2 ≥ … of Qᵀ A Q interlace A's eigenvalues (θ_j ≤ λ_j), so
  every θ_j above the tolerance is an eigenvalue of A above it: their count is a lower bound on rank(J) at every
  step, and the exact rank once the basis is invariant or spans all d values. Invariance is never taken from
  A V alone (A shrinks the directions of small eigenvalues below rounding, so they can look absent): a random
  block from the basis's complement must also go to zero under A, else it joins the basis and the growth goes on.
- **The sample's hidden energy, from above.** A V lies in A's range, the directions J sees; so the part of c
  outside span(A Q) bounds the part of c that J cannot see: ‖(I − P_range) c‖² ≤ ‖(I − P_{span(AQ)}) c‖². Since c
  starts the basis, that bound falls fastest along what the sample is made of.
- **Memory** d × (basis size) instead of (d + 16) × d, and products that run on the device in chunks.

Tolerance: the Gram matrix squares the singular values, so a value of A is taken as zero at or below
σ_max(J)² · d · ε (ε the working precision's), i.e. singular values of J below σ_max · sqrt(d·ε) count as hidden:
coarser than the dense check's LAPACK rule, stated with every result.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

# Rows of a block: one batched pair of products. Larger blocks use the device better; the basis grows by this much
# per step, so the last step can overshoot what is needed by at most one block.
BLOCK = 32
# Two passes of classical Gram-Schmidt against the basis keep it orthonormal to working precision ("twice is
# enough"); a new row whose norm falls below this share of its norm before projection carries no new direction.
NEW_DIRECTION = 1e-8


@dataclass
class KrylovReading:
    """What the Krylov basis shows after its last step."""

    unknowns: int  # d
    basis: int  # orthonormal vectors in the basis
    exact: bool  # the basis is invariant under A, or spans all d values: the rank is exact
    rank_at_least: int  # Ritz values above the tolerance (the rank itself when exact)
    singular_values: np.ndarray  # sqrt of the Ritz values, descending: estimates of J's largest singular values
    tolerance: float  # on J's singular values (see the module's docstring)
    hidden_share_at_most: float | None  # ‖(I − P_{span(AQ)}) c‖² / ‖c‖²; None for c = 0
    products: int  # products with A (each one J and one Jᵀ product)
    seconds: float
    stopped: str  # why it stopped: invariant | complete | decided | budget | memory
    # When exact: an orthonormal basis (rows) of what J sees, the eigenvectors of A above the tolerance.
    visible: torch.Tensor | None = None


def krylov_rank(
    apply_gram: Callable[[torch.Tensor], torch.Tensor],
    deviation: torch.Tensor,
    *,
    seed: int = 0,
    block: int = BLOCK,
    budget_seconds: float | None = None,
    hidden_below: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    memory_bytes: int | None = None,
) -> KrylovReading:
    """Grow a Krylov basis of A = JᵀJ from the sample's ``deviation`` (d values) until it is exact, the time budget
    is spent, (with ``hidden_below``) the sample's hidden share is shown to be below that share, or (with
    ``memory_bytes``) one more block would take the basis and what is kept beside it past that many bytes.

    ``apply_gram(V)`` returns A V for a block V (k × d) in the dtype and device of ``deviation``."""
    started = time.perf_counter()
    c = deviation.reshape(-1)
    d = c.numel()
    eps = torch.finfo(c.dtype).eps
    generator = torch.Generator(device="cpu").manual_seed(seed)
    c_norm = float(c.norm())
    first = [c / c_norm] if c_norm > 0 else []
    extra = max(0, min(block, d) - len(first))
    random_rows = torch.randn(extra, d, generator=generator, dtype=c.dtype).to(c.device)
    candidates = torch.cat([torch.stack(first), random_rows]) if first else random_rows
    basis = torch.empty(0, d, dtype=c.dtype, device=c.device)
    images = torch.empty(0, d, dtype=c.dtype, device=c.device)  # A applied to each basis row
    seen = torch.empty(0, d, dtype=c.dtype, device=c.device)  # an orthonormal basis of span(images): in A's range
    inside = 0.0  # ‖P_seen c‖²
    stopped = "complete"
    hidden = None
    products = 0
    largest = 0.0  # the largest ‖A v‖ seen for a unit v: a lower estimate of A's largest eigenvalue
    while True:
        if memory_bytes is not None and basis_bytes(basis.shape[0] + block, d, c.element_size()) > memory_bytes:
            stopped = "memory"  # stop with both bounds rather than run out of memory half-way through a block
            break
        fresh = _orthonormal_rows(candidates, basis)
        if fresh.shape[0] == 0:
            # A V added nothing the basis lacks, to working precision. That can mean the basis holds everything
            # A sees, or only that A shrank the directions it still lacks below rounding (small eigenvalues).
            # A random block from the basis's complement decides: A takes it to zero (invariant), or it joins.
            probe = _orthonormal_rows(
                torch.randn(min(block, d - basis.shape[0]), d, generator=generator, dtype=c.dtype).to(c.device),
                basis,
            )
            if probe.shape[0] == 0:
                stopped = "complete"
                break
            probed = apply_gram(probe)
            products += probe.shape[0]
            if float(probed.norm(dim=1).max()) <= largest * d * eps:
                stopped = "invariant"
                break
            fresh, applied = probe, probed
        else:
            fresh = fresh[: d - basis.shape[0]]
            applied = apply_gram(fresh)
            products += fresh.shape[0]
        largest = max(largest, float(applied.norm(dim=1).max()))
        basis = torch.cat([basis, fresh])
        images = torch.cat([images, applied])
        if progress is not None:
            progress(basis.shape[0], d)
        new_seen = _orthonormal_rows(applied, seen)
        seen = torch.cat([seen, new_seen])
        if c_norm > 0:
            inside += float((new_seen @ c).square().sum())
            hidden = max(0.0, 1.0 - inside / (c_norm * c_norm))
        if basis.shape[0] >= d:
            stopped = "complete"
            break
        if hidden_below is not None and hidden is not None and hidden < hidden_below:
            stopped = "decided"
            break
        if budget_seconds is not None and time.perf_counter() - started > budget_seconds:
            stopped = "budget"
            break
        candidates = applied
    gram = basis @ images.T
    exact = stopped in ("invariant", "complete")
    ritz, vectors = torch.linalg.eigh((gram + gram.T) / 2)
    ritz, vectors = ritz.flip(0).clamp_min(0), vectors.flip(1)
    top = float(ritz[0]) if ritz.numel() else 0.0
    cut = top * d * eps
    above = ritz > cut if top > 0 else torch.zeros_like(ritz, dtype=torch.bool)
    visible = vectors[:, above].T @ basis if exact else None
    values = ritz.sqrt().cpu().numpy()
    return KrylovReading(
        unknowns=d,
        basis=int(basis.shape[0]),
        exact=exact,
        rank_at_least=int(above.sum()),
        singular_values=values,
        tolerance=math.sqrt(cut),
        hidden_share_at_most=hidden,
        products=products,
        seconds=time.perf_counter() - started,
        stopped=stopped,
        visible=visible,
    )


def basis_bytes(rows: int, d: int, itemsize: int) -> int:
    """Memory of a basis of ``rows`` directions: the basis, A applied to it, an orthonormal basis of that and the
    visible directions at the end (each rows x d), and the Ritz problem's two rows x rows matrices."""
    return itemsize * (4 * rows * d + 2 * rows * rows)


def _orthonormal_rows(candidates: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The candidates' new directions: projected off the basis twice, then an orthonormal basis of what is left
    (rows whose remaining norm is below NEW_DIRECTION of the largest candidate norm carry nothing new)."""
    scale = float(candidates.norm(dim=1).max()) if candidates.numel() else 0.0
    if scale == 0.0:
        return candidates[:0]
    rows = candidates
    for _ in range(2):
        if basis.shape[0]:
            rows = rows - (rows @ basis.T) @ basis
    # An SVD of the block (k × d, k small) keeps only directions well above rounding: a QR would normalise noise.
    u, s, vh = torch.linalg.svd(rows, full_matrices=False)
    keep = s > NEW_DIRECTION * scale
    fresh = vh[keep]
    if basis.shape[0] and fresh.shape[0]:
        fresh = fresh - (fresh @ basis.T) @ basis
        fresh = fresh / fresh.norm(dim=1, keepdim=True)
    return fresh
