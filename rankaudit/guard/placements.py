"""The linear algebra behind what a hidden layer's features determine of a sample (docs/method.md, "The
client-side guard"): the part of a deviation in a set of rows' row space and the PSNR of the rest, and the bound
from a first convolution's filter placements, its Gram matrix factored a band at a time. Plain tensors in, plain
numbers out: nothing here runs the model (rankaudit.guard.features does).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from rankaudit.guard.pairs import IDENTICAL_PSNR

# An eigenvalue of J·Jᵀ counts in J's rank above this share of the largest (float32 rows are exact to about 1e-7,
# so their squares to 1e-14): erring towards a larger row space, which errs towards a higher figure.
RANK_SHARE = 1e-12

# The first Linear layer's bound is used only when W·Wᵀ's eigenvalues all lie within this share of the largest: its
# eigenvectors are then exact to float64's rounding, and no direction of W's row space is lost to the rank cut-off.
WELL_CONDITIONED = 1e-8

# The shift under the placements' unit-diagonal Gram matrix G: a Cholesky factor of G − SHIFT·I exists only when
# every eigenvalue of G is above SHIFT, and then bᵀ(G − SHIFT·I)⁻¹b is at least bᵀG⁻¹b, the projection it bounds
# (float64 rounding, about 1e-13 of G, is far under the shift). The quickstart CNN's placements have eigenvalues
# of 0.06 to 1.7 on photographs; a shift of 1e-3 loosens the bound by a few percent of the projection at most.
SHIFT = 1e-3


def plain_convolution(layer: nn.Module, shape: torch.Size) -> bool:
    """A 2-D convolution over the whole sample without padding, dilation or groups: each output is the dot product
    of a filter with one patch, so placements' overlaps are the filters' correlations."""
    return (
        isinstance(layer, nn.Conv2d)
        and len(shape) == 3
        and layer.in_channels == shape[0]
        and layer.groups == 1
        and tuple(layer.dilation) == (1, 1)
        and (layer.padding == "valid" or tuple(layer.padding) == (0, 0))
    )


def placement_bounds(
    conv: nn.Conv2d, reached: torch.Tensor, deviations: torch.Tensor, xs: torch.Tensor, shape: torch.Size
) -> list[float | None]:
    """For each sample: an upper bound on the PSNR of the mean plus the deviation's part in the span of the
    filter placements that reach the features (None when their Gram matrix is not safely positive definite, or
    they are as many as the sample's values)."""
    weight = conv.weight.detach().to(torch.float64)
    channels, (k1, k2), (s1, s2) = len(weight), weight.shape[2:], conv.stride
    norms = weight.flatten(1).norm(dim=1)
    # The placements' correlations, each placement scaled to unit norm, laid out over every offset two output
    # positions can have (zero where the filters do not overlap): entry [c, d, h1 + Δ1, h2 + Δ2] is placement
    # (c, o) · placement (d, o + Δ / stride), so that one gather with an index that sums a term of each
    # placement fills a sample's Gram matrix.
    h1, h2 = max((reached.shape[2] - 1) * s1, k1 - 1), max((reached.shape[3] - 1) * s2, k2 - 1)
    table = torch.zeros(channels, channels, 2 * h1 + 1, 2 * h2 + 1, dtype=torch.float64)
    scale = torch.where(norms > 0, norms, 1.0)
    correlation = (
        nn.functional.conv2d(weight, weight, padding=(k1 - 1, k2 - 1))
        / (scale[:, None] * scale[None, :])[:, :, None, None]
    )
    table[:, :, h1 - k1 + 1 : h1 + k1, h2 - k2 + 1 : h2 + k2] = correlation
    size1, size2 = table.shape[2:]
    table = table.flatten()
    responses = nn.functional.conv2d(deviations.reshape(len(deviations), *shape), weight, stride=conv.stride)
    if responses.shape != reached.shape:
        return [None] * len(deviations)  # the layer reads the sample's values laid out in another shape
    bounds: list[float | None] = [None] * len(deviations)
    # Every sample's placements at once, each sample's ordered by position, row first: placements that overlap
    # lie within a band of the order.
    sample, row, column, channel = torch.nonzero(
        (reached & (norms > 0)[None, :, None, None]).permute(0, 2, 3, 1), as_tuple=True
    )
    # int32 indices (the table has far fewer than 2³¹ entries) gather twice as fast as int64.
    first = (channel * (channels * size1 * size2) - row * (s1 * size2) - column * s2).int()
    second = (channel * (size1 * size2) + row * (s1 * size2) + column * s2 + h1 * size2 + h2).int()
    b = responses[sample, channel, row, column] / norms[channel]
    counts = torch.bincount(sample, minlength=len(deviations)).tolist()
    parts = zip(*(part.split(counts) for part in (first, second, b, row)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for number, (deviation, x, (first_, second_, b_, row_)) in enumerate(zip(deviations, xs, parts)):
            if len(row_) >= deviation.numel():
                continue
            seen = _seen_through_band(table, first_, second_, b_, row_, (k1 - 1) // s1)
            bounds[number] = None if seen is None else psnr_with_seen(deviation, x, seen)
    finally:
        torch.set_num_threads(threads)
    return bounds


# The smallest block of the banded factorisation: narrower blocks cost more in calls than they save in arithmetic.
MIN_BLOCK = 64


def _blocks(row: torch.Tensor, reach: int) -> list[tuple[int, int]]:
    """[(start, stop)]: consecutive blocks of the placements (``row`` ascending), each ``reach`` rows of placements
    or more (at least MIN_BLOCK placements where the rows allow), so that two blocks with one between them lie more
    than ``reach`` rows apart: the Gram matrix is block tridiagonal in them. A block as tall as the band is no
    wider than the band is in that part of the sample."""
    groups = torch.div(row, max(reach, 1), rounding_mode="floor")
    starts = [0] + (torch.nonzero(groups[1:] != groups[:-1]).flatten() + 1).tolist()
    blocks: list[tuple[int, int]] = []
    for start, stop in zip(starts, starts[1:] + [len(row)]):
        if blocks and blocks[-1][1] - blocks[-1][0] < MIN_BLOCK:
            blocks[-1] = (blocks[-1][0], stop)
        else:
            blocks.append((start, stop))
    return blocks


def _gram_block(table: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The placements' Gram matrix entries [i, j] = table[first[i] + second[j]], (len(first), len(second))."""
    return table.index_select(0, (first[:, None] + second[None, :]).flatten()).view(len(first), len(second))


def _seen_through_band(
    table: torch.Tensor, first: torch.Tensor, second: torch.Tensor, b: torch.Tensor, row: torch.Tensor, reach: int
) -> float | None:
    """bᵀ(G − SHIFT·I)⁻¹b for the placements' Gram matrix G (entries as _gram_block gives them), or None when
    G − SHIFT·I has no Cholesky factor. Placements whose rows (``row``, ascending) lie more than ``reach`` apart do
    not overlap, so their entry is exactly zero and G is block tridiagonal in blocks of at least ``reach`` rows
    (_blocks): its Cholesky factor is formed a block at a time (L_kk L_kkᵀ = G_kk − C Cᵀ with
    C = G_k,k-1 L_k-1⁻ᵀ), the same factor as the whole matrix's, with the arithmetic of a band instead of a cube.
    (One sample at a time: samples formed together would all take the widest band and the most blocks, twice the
    arithmetic on photographs.)"""
    count = len(first)
    if not count:
        return 0.0
    seen, previous = 0.0, None
    for start, stop in _blocks(row, reach):
        block = _gram_block(table, first[start:stop], second[start:stop])
        block.diagonal().sub_(SHIFT)
        rhs = b[start:stop, None]
        if previous is not None:
            factor, solved, (before, after) = previous
            coupling = _gram_block(table, first[start:stop], second[before:after])
            c = torch.linalg.solve_triangular(factor, coupling.T, upper=False).T
            block -= c @ c.T
            rhs = rhs - c @ solved
        factor, info = torch.linalg.cholesky_ex(block)
        if int(info) != 0:
            return None
        solved = torch.linalg.solve_triangular(factor, rhs, upper=False)
        seen += float((solved**2).sum())
        previous = (factor, solved, (start, stop))
    return seen


def psnr_of_determined(jacobian: torch.Tensor, deviation: torch.Tensor, x: torch.Tensor) -> float:
    """PSNR of μ + P_row(J)(x − μ) against x: the error is the part of the deviation outside J's row space,
    |P v|² = (Jv)ᵀ (J Jᵀ)⁺ (Jv)."""
    space = row_space(jacobian)
    if space is None:
        return IDENTICAL_PSNR  # a Jacobian that cannot be read: assume the features determine the sample
    return psnr_outside(jacobian, *space, deviation[None], x[None])[0]


def row_space(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(eigenvectors, eigenvalues) of rows·rowsᵀ that count in the rows' rank; None when a row is not finite."""
    gram = rows @ rows.T
    # A row with an infinity or a NaN has one on the diagonal (the squares of float32 values cannot overflow).
    if not bool(torch.isfinite(gram.diagonal()).all()):
        return None
    # A few hundred rows gain nothing from LAPACK's threads, and lose seconds to them on shared cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values, vectors = torch.linalg.eigh(gram)
    finally:
        torch.set_num_threads(threads)
    kept = values > RANK_SHARE * values.max() if len(values) and values.max() > 0 else values > math.inf
    return vectors[:, kept], values[kept]


def psnr_outside(
    rows: torch.Tensor, vectors: torch.Tensor, values: torch.Tensor, deviations: torch.Tensor, xs: torch.Tensor
) -> list[float]:
    """For each (deviation, sample) row pair: the PSNR of the mean plus the deviation's part in the rows' row
    space, against the sample."""
    seen = ((vectors.T @ (rows @ deviations.T)) ** 2 / values[:, None]).sum(0)
    return [psnr_with_seen(deviation, x, part) for deviation, x, part in zip(deviations, xs, seen.tolist())]


def psnr_with_seen(deviation: torch.Tensor, x: torch.Tensor, seen: float) -> float:
    """PSNR against x of the mean plus a part of the deviation whose squared norm is ``seen``."""
    unknown = max(float(deviation @ deviation) - seen, 0.0)
    spread = float(x.max() - x.min()) or 1.0
    mse = unknown / x.numel()
    return IDENTICAL_PSNR if mse <= 0 else min(IDENTICAL_PSNR, 10 * math.log10(spread**2 / mse))
