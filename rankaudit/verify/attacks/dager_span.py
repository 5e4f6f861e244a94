"""DAGER's span test: a gradient's row space and each candidate token's distance to it, over the vocabulary."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from rankaudit.verify.attacks.dager_call import LanguageModelCall, layer_input

# A candidate is in the gradient's row space when its distance to it is below this fraction of its own norm. In
# float64 the batch's own vectors sit near 1e-8 (the floor of ||x||² - ||Qᵀx||²), the others at sqrt(1 - r/d).
DISTANCE_THRESHOLD = 1e-5
# Candidate vectors per chunk: the layer inputs of (chunk x n) sequences are held at once.
CHUNK_ELEMENTS = 1 << 24


@dataclass
class SpanBasis:
    """An orthonormal basis of a gradient's row space in the layer's input space, and how its rank was set."""

    basis: torch.Tensor  # d_in x rank
    rank: int
    tolerance: float  # singular values above it count
    largest: float  # σ_1
    last_kept: float | None  # σ_rank
    first_dropped: float | None  # σ_rank+1


def span_basis(gradient: torch.Tensor) -> SpanBasis:
    """`gradient`: d_in x d_out (each column a combination of the batch's input vectors). Numerical rank: singular
    values above σ_1 · max(d_in, d_out) · ε of the dtype (NumPy's matrix_rank rule)."""
    threads = torch.get_num_threads()
    # A d_in x d_out SVD is small: one thread does it in milliseconds, while LAPACK's threads on a loaded CPU
    # can spin for seconds (7 s instead of 0.02 s for 128 x 384 on a busy two-core machine).
    torch.set_num_threads(1)
    try:
        left, singular, _ = torch.linalg.svd(gradient.cpu(), full_matrices=False)
    finally:
        torch.set_num_threads(threads)
    largest = float(singular[0]) if singular.numel() else 0.0
    tolerance = largest * max(gradient.shape) * torch.finfo(gradient.dtype).eps
    rank = int((singular > tolerance).sum()) if largest > 0 else 0
    return SpanBasis(
        left[:, :rank].contiguous().to(gradient.device),
        rank,
        tolerance,
        largest,
        float(singular[rank - 1]) if rank else None,
        float(singular[rank]) if rank < singular.numel() else None,
    )


def span_distances(basis: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """Distance of each row of `vectors` (N x d_in) to span(basis), relative to the row's norm: one matrix product
    per batch of candidates (||x||² - ||Qᵀx||², Q orthonormal)."""
    squared = vectors.pow(2).sum(dim=1)
    projected = (vectors @ basis).pow(2).sum(dim=1)
    return (squared - projected).clamp_min(0).sqrt() / squared.sqrt().clamp_min(torch.finfo(vectors.dtype).tiny)


def _candidate_layout(vocab_size: int, positions: int, position_dependent: bool):
    """Sequences that put every candidate at the input of the attacked layer, and which (token, position) each
    entry is. Position-dependent vectors: sequence j holds token (j + p) mod V at position p, so V sequences cover
    every (token, position) pair. Otherwise each token once, n to a sequence."""
    if position_dependent:
        rows = vocab_size

        def tokens(start: int, stop: int) -> torch.Tensor:
            offsets = torch.arange(start, stop).unsqueeze(1) + torch.arange(positions).unsqueeze(0)
            return offsets % vocab_size
    else:
        rows = -(-vocab_size // positions)

        def tokens(start: int, stop: int) -> torch.Tensor:
            return (torch.arange(start * positions, stop * positions) % vocab_size).reshape(stop - start, positions)

    return rows, tokens


@dataclass
class SpanTest:
    """The span test over the vocabulary: what passed, how many vectors were tested, and how."""

    accepted: list[tuple[int, int, float]]  # (token, position, relative distance) below the threshold
    tested: int
    nearest_rejected: float | None  # the smallest distance among the rejected: the margin left
    method: str  # how the candidates' vectors were obtained


def span_test_vocabulary(
    call: LanguageModelCall,
    module: nn.Module,
    basis: torch.Tensor,
    *,
    vocab_size: int,
    positions: int,
    position_dependent: bool,
    device,
    threshold: float = DISTANCE_THRESHOLD,
    norm: nn.Module | None = None,
    progress=None,
) -> SpanTest:
    """Test every candidate's input vector to `module` against the span.

    With `norm` (the LayerNorm the layer reads) and position-dependent vectors, first try the exact shortcut of
    `layer_norm_shortcut`; otherwise, or when its checks fail, run every candidate through the model."""
    if norm is not None and position_dependent and isinstance(norm, nn.LayerNorm):
        shortcut = layer_norm_shortcut(
            call,
            module,
            norm,
            basis,
            vocab_size=vocab_size,
            positions=positions,
            device=device,
            threshold=threshold,
            progress=progress,
        )
        if shortcut is not None:
            return shortcut
    return _span_test_through_model(
        call,
        module,
        basis,
        vocab_size=vocab_size,
        positions=positions,
        position_dependent=position_dependent,
        device=device,
        threshold=threshold,
        progress=progress,
    )


def _span_test_through_model(
    call, module, basis, *, vocab_size, positions, position_dependent, device, threshold, progress
) -> SpanTest:
    rows, tokens = _candidate_layout(vocab_size, positions, position_dependent)
    d_in = basis.shape[0]
    chunk = max(1, CHUNK_ELEMENTS // max(1, positions * d_in))
    accepted: list[tuple[int, int, float]] = []
    tested, nearest_rejected = 0, math.inf
    seen = torch.zeros((vocab_size, positions if position_dependent else 1), dtype=torch.bool)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        ids = tokens(start, stop)
        vectors = layer_input(call, module, ids.to(device)).reshape(stop - start, positions, -1)
        distances = (
            span_distances(basis, vectors.reshape(-1, vectors.shape[-1]).to(basis.dtype))
            .reshape(stop - start, positions)
            .cpu()
        )
        flat_ids = ids.reshape(-1)
        flat_positions = torch.arange(positions).repeat(stop - start)
        flat_distances = distances.reshape(-1)
        column = flat_positions if position_dependent else torch.zeros_like(flat_positions)
        fresh = ~seen[flat_ids, column]
        seen[flat_ids, column] = True
        flat_ids, column, flat_distances = flat_ids[fresh], column[fresh], flat_distances[fresh]
        tested += int(fresh.sum())
        hits = flat_distances < threshold
        for token, position, distance in zip(
            flat_ids[hits].tolist(), column[hits].tolist(), flat_distances[hits].tolist()
        ):
            accepted.append((token, position, distance))
        if (~hits).any():
            nearest_rejected = min(nearest_rejected, float(flat_distances[~hits].min()))
        if progress is not None:
            progress(stop, rows)
    what = "every (token, position) pair" if position_dependent else "every token once"
    return SpanTest(
        accepted,
        tested,
        None if nearest_rejected == math.inf else nearest_rejected,
        f"{what} run through the model up to the layer",
    )


# The shortcut's checks: pairs drawn at random, and the largest relative difference allowed from the model's own
# layer input (float64 arithmetic in a different order differs by about 1e-15).
SHORTCUT_CHECKS = 256
SHORTCUT_AGREEMENT = 1e-9


def layer_norm_shortcut(
    call: LanguageModelCall,
    module: nn.Module,
    norm: nn.LayerNorm,
    basis: torch.Tensor,
    *,
    vocab_size: int,
    positions: int,
    device,
    threshold: float = DISTANCE_THRESHOLD,
    progress=None,
) -> SpanTest | None:
    """The span test for x = LayerNorm(a_v + c_p) without forming the V·n vectors: the distance of x to the span
    expands into inner products of the centred, scaled a_v and c_p (V x n matrix products), as GPT-2 and BERT add
    a position embedding to the token's before the norm.

    a_v and c_p are read off the model (the norm's input for each token at position 0, and for one token at every
    position); the shortcut is used only if, on SHORTCUT_CHECKS random (token, position) pairs, a_v + c_p is the
    norm's input and LayerNorm(a_v + c_p) the layer's input to within SHORTCUT_AGREEMENT. None otherwise."""
    if tuple(norm.normalized_shape) != (basis.shape[0],):
        return None
    dtype = basis.dtype
    first = [
        layer_input(call, norm, torch.arange(start, min(vocab_size, start + 4096)).unsqueeze(1).to(device))
        for start in range(0, vocab_size, 4096)
    ]
    token_part = torch.cat([x.reshape(-1, x.shape[-1]) for x in first]).to(dtype)  # a_v + c_0
    along = layer_input(call, norm, torch.zeros((1, positions), dtype=torch.long, device=device))
    offsets = along.reshape(positions, -1).to(dtype) - along.reshape(positions, -1)[0].to(dtype)  # c_p - c_0
    if not _shortcut_agrees(call, module, norm, token_part, offsets, vocab_size, positions, device):
        return None
    d = basis.shape[0]
    gamma = norm.weight.detach().to(dtype) if norm.weight is not None else torch.ones(d, dtype=dtype, device=device)
    beta = (
        norm.bias.detach().to(dtype)
        if getattr(norm, "bias", None) is not None
        else torch.zeros(d, dtype=dtype, device=device)
    )

    def complement(v):  # v minus its projection on the span
        return v - (v @ basis) @ basis.T

    w = offsets - offsets.mean(dim=1, keepdim=True)  # centred c_p
    scaled_w, beta_out = gamma * w, complement(beta)
    w_out = complement(scaled_w)
    w_sq, scaled_w_sq, w_out_sq = (w * w).sum(1), (scaled_w * scaled_w).sum(1), (w_out * w_out).sum(1)
    accepted: list[tuple[int, int, float]] = []
    nearest_rejected = math.inf
    chunk = max(1, CHUNK_ELEMENTS // max(1, d + positions))
    for start in range(0, vocab_size, chunk):
        u = token_part[start : start + chunk]
        u = u - u.mean(dim=1, keepdim=True)  # centred a_v
        scaled_u = gamma * u
        u_out = complement(scaled_u)
        variance = ((u * u).sum(1, keepdim=True) + 2 * u @ w.T + w_sq) / d + norm.eps
        sigma = variance.sqrt()
        full = (
            ((scaled_u * scaled_u).sum(1, keepdim=True) + 2 * scaled_u @ scaled_w.T + scaled_w_sq) / variance
            + 2 * ((scaled_u @ beta).unsqueeze(1) + scaled_w @ beta) / sigma
            + beta @ beta
        )
        outside = (
            ((u_out * u_out).sum(1, keepdim=True) + 2 * u_out @ w_out.T + w_out_sq) / variance
            + 2 * ((u_out @ beta_out).unsqueeze(1) + w_out @ beta_out) / sigma
            + beta_out @ beta_out
        )
        distance = (outside.clamp_min(0) / full.clamp_min(torch.finfo(dtype).tiny)).sqrt().cpu()
        hits = distance < threshold
        for token, position in hits.nonzero().tolist():
            accepted.append((start + token, position, float(distance[token, position])))
        if (~hits).any():
            nearest_rejected = min(nearest_rejected, float(distance[~hits].min()))
        if progress is not None:
            progress(min(vocab_size, start + chunk), vocab_size)
    return SpanTest(
        accepted,
        vocab_size * positions,
        None if nearest_rejected == math.inf else nearest_rejected,
        f"every (token, position) pair, through LayerNorm(token part + position part) in closed form "
        f"(checked against the model's own layer input on {SHORTCUT_CHECKS} random pairs)",
    )


def _shortcut_agrees(call, module, norm, token_part, offsets, vocab_size, positions, device) -> bool:
    generator = torch.Generator().manual_seed(2024)
    ids = torch.randint(vocab_size, (-(-SHORTCUT_CHECKS // positions), positions), generator=generator).to(device)
    inside = layer_input(call, norm, ids).reshape(-1, token_part.shape[1]).to(token_part.dtype)
    predicted = token_part[ids.reshape(-1)] + offsets.repeat(ids.shape[0], 1)
    if not _close(inside, predicted):
        return False
    with torch.no_grad():
        normed = norm(predicted.to(norm.weight.dtype if norm.weight is not None else predicted.dtype))
    reached = layer_input(call, module, ids).reshape(-1, token_part.shape[1])
    return _close(reached.to(token_part.dtype), normed.to(token_part.dtype))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).norm(dim=1) <= SHORTCUT_AGREEMENT * b.norm(dim=1).clamp_min(1e-30)).all())
