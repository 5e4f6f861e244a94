"""The readouts a server can form from one layer's update, each judged by its PSNR against the samples' vectors
(docs/method.md, "The client-side guard").

Plain tensors in, plain numbers out: nothing here runs the model. For a layer whose weight and bias updates are both
sent, unit i's update is ΔW_i = Σ_n c_(n,i) v_n and Δb_i = Σ_n c_(n,i), with v_n what the layer reads from sample n
and c_(n,i) proportional to that sample's signal δ_(n,i) (the loss gradient at the unit's pre-activation, for the
step it ran). So:

- unit i's ratio ΔW_i / Δb_i is v_s when only sample s has a signal at i (Qian et al.; a ReLU that fires for one
  sample, or a softmax whose logit gaps saturate it, as in class fishing);
- (ΔW_i − c·ΔW_j) / (Δb_i − c·Δb_j) is v_s when the signals of units i and j agree up to the scale c on every sample
  but s (the imprint readout of Fowl et al., whatever the units' order, scale or sign).

The signals only choose which pairs to form; each readout is formed from the update as sent, and judged by the PSNR
of the readout against the sample's vector, with the vector's own dynamic range as the peak.
"""

from __future__ import annotations

import math

import torch

# Signals that agree up to scale on all samples but one: the squared sine between the two units' signals, with that
# sample left out, at most this. A filter only (each pair it passes is formed and judged by its PSNR), so it errs
# wide: float32 signals of an imprint agree to about 1e-7.
PARALLEL = 1e-4
# Signals that agree but for a few percent of the other samples' weight (an imprint beside class fishing, a sample
# at a bin's edge): such a pair still reads its sample at 40-48 dB at the signals' own scale, and is formed at that
# scale only (a scale fitted to the sample would make a mixture look like it).
NEARLY_PARALLEL = 1e-2
# (units x units x samples) values compared at a time in the pair search: bounds its memory (4 MB in float32).
# Blocks that stay in a CPU's cache: 1 << 20 took half the time of 1 << 22 on Flower's quickstart CNN.
PAIR_BLOCK = 1 << 20
# The most samples one pair of units is searched for isolating together (isolating_groups): their readout is a
# mixture of those samples, which shows one of them only when the others are copies or near copies of it, and a
# few such samples in one bin is what a batch with repeated or nearly repeated samples gives.
GROUP_MOST = 4
# every_pair's search (units² / 2 × samples values, a few operations each) runs only up to this size: about 33
# million, 256 units over 1,000 samples or 64 over 16,000, a second or two on one CPU core at the largest.
EVERY_PAIR_MOST = 1 << 25
# Two units' signals agree on a sample at a scale c when they differ by at most this share of the larger.
SIGNAL_AGREEMENT = 1e-2
# Vectors of at most this many values are few enough for a readout at a scale fitted to the sample (a pair's, or one
# the bias update's rounding leaves open) to pass within 30 dB of it by chance: iris's four features are "read" as
# often for flowers the client never had as for its own. With 13 (wine) and more, no held-out sample came near; at 30
# and 32 values (digits cut to their first pixels) a boosted imprint was read at 40-55 dB. Such short samples'
# pairs from the search over every pair need the signals' support, and their readouts are read as formed.
CHANCE_DIMENSIONS = 8
# A PSNR reported for a readout identical to its sample, in dB (JSON has no infinity).
IDENTICAL_PSNR = 300.0


def peaks(vectors: torch.Tensor) -> torch.Tensor:
    """Each vector's dynamic range (max − min), the peak of its PSNR; 1 where the vector is constant."""
    spread = vectors.amax(dim=1) - vectors.amin(dim=1)
    return torch.where(spread > 0, spread, torch.ones_like(spread))


def psnr_of(readouts: torch.Tensor, vectors: torch.Tensor, peak: torch.Tensor) -> torch.Tensor:
    """PSNR, in dB, of each readout row against the vector row beside it: 10·log10(peak² / mean squared error)."""
    mse = ((readouts - vectors) ** 2).mean(dim=1)
    ratio = peak**2 / mse.clamp_min(1e-300)
    return (10 * torch.log10(ratio)).clamp(max=IDENTICAL_PSNR).nan_to_num(nan=-math.inf)


def best_matches(
    readouts: torch.Tensor, vectors: torch.Tensor, peak: torch.Tensor, scales: tuple | None = None
) -> tuple[list[int], list[float]]:
    """For each readout row, the sample it reads best and that PSNR: searched by expanded squares, recomputed
    directly (the expanded form cancels near an exact readout; the direct difference does not). ``scales``: each
    row's (low, high) bounds on the factor a server may put on it (scale_bounds); the row is read at the factor
    within them nearest each sample."""
    if not len(readouts):
        return [], []
    squares, factor = fitted_squares(readouts, vectors, scales)
    best = (squares.clamp_min(0) / (peak**2)[None, :]).argmin(dim=1)
    chosen = factor[torch.arange(len(readouts)), best]
    scores = psnr_of(readouts * chosen[:, None], vectors[best], peak[best])
    return best.tolist(), scores.tolist()


def bias_slack(
    sent_bias: torch.Tensor, received_bias: torch.Tensor, roundings: int, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """(units,) float64: how far each unit's bias update as the server computes it (sent − received) can lie from
    the update the training made: the spacing of ``dtype`` (the one the training rounded to, rounding_dtype; the
    sent dtype by default) at twice the bias's size, once per rounding (each optimiser step rounds the bias it
    writes). A bias near a thousand in float32 is rounded to about 6e-5 each step, which can be a large share of a
    one-sample update: the readout's scale is then that uncertain, and a server that knows the sample's mean or
    range fixes it."""
    if dtype is None:
        dtype = sent_bias.dtype if sent_bias.is_floating_point() else torch.float64
    size = torch.maximum(
        sent_bias.detach().cpu().to(torch.float64).abs(), received_bias.detach().cpu().to(torch.float64).abs()
    )
    at = (2 * size).to(dtype)
    spacing = torch.nextafter(at, torch.full_like(at, math.inf)).to(torch.float64) - at.to(torch.float64)
    return torch.where(torch.isfinite(spacing), spacing * max(roundings, 1), math.inf)


def rounding_dtype(*sent: torch.Tensor) -> torch.dtype:
    """The dtype a layer was trained in, as far as its sent values show it: bfloat16 or float16 when every value
    sent is one of that dtype's (a training in half precision whose weights go out as float32: each step rounded
    to the half-precision spacing, thousands of times the float32 one), else the dtype sent."""
    values = [tensor.detach().cpu() for tensor in sent if tensor.is_floating_point() and tensor.numel()]
    if not values:
        return sent[0].dtype if sent and sent[0].is_floating_point() else torch.float64
    for half in (torch.bfloat16, torch.float16):
        if all(value.dtype != half and bool(torch.equal(value.to(half).to(value.dtype), value)) for value in values):
            return half
    return values[0].dtype


def fitted_squares(
    readouts: torch.Tensor, vectors: torch.Tensor, scales: tuple | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(squares, factors), each (readouts, samples): each readout's squared distance to each vector at the factor
    within its bounds nearest that vector (nearest_factors), in expanded form (it cancels near an exact match:
    recompute the matches that count directly), and those factors."""
    energy = (readouts * readouts).sum(1)
    cross = readouts @ vectors.T
    factor = nearest_factors(cross, energy, scales)
    return (vectors * vectors).sum(1)[None, :] - 2 * factor * cross + factor * factor * energy[:, None], factor


def scale_open(denominator: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """Where a readout's scale is unknown: its denominator (a bias update) is within its rounding ``slack`` of zero,
    or not a number."""
    return ~torch.isfinite(denominator) | (denominator.abs() <= slack)


def scale_bounds(denominator: torch.Tensor, slack: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(low, high): the factors a server may put on a readout divided by ``denominator``, a bias update known to
    within ``slack`` (the true one is any d' with |d' − d| ≤ slack, the readout then d/d' times the one formed).
    Unbounded, either sign, when the slack reaches the denominator itself: the readout's scale is then unknown, and
    read at whatever scale shows a sample best. None without a slack: the readout as formed."""
    if slack is None:
        return None
    size = denominator.abs()
    known = ~scale_open(denominator, slack)
    low = torch.where(known, size / (size + slack), -math.inf)
    high = torch.where(known, size / (size - slack).clamp_min(1e-300), math.inf)
    return low, high


def nearest_factors(cross: torch.Tensor, energy: torch.Tensor, scales: tuple | None) -> torch.Tensor:
    """(readouts, samples): the factor within each readout's bounds that brings it nearest each sample (the
    unbounded best is cross / energy); 1 without bounds."""
    if scales is None:
        return torch.ones_like(cross)
    low, high = scales
    best = cross / energy.clamp_min(1e-300)[:, None]
    return torch.minimum(torch.maximum(best, low[:, None]), high[:, None])


def live_units(bias_update: torch.Tensor) -> torch.Tensor:
    """The units whose bias update is not zero: a ratio over them reads something. Each unit on its own (a share
    of the layer's largest would let one unit with a huge update silence every other), and each ratio is judged
    by its PSNR, so one that divides by rounding reads nothing and costs only its check."""
    return (bias_update != 0) & torch.isfinite(bias_update)


def ratio_readouts(
    rows: torch.Tensor, bias: torch.Tensor, vectors: torch.Tensor, peak: torch.Tensor, slack: torch.Tensor | None = None
):
    """[(unit, sample, psnr)] for every live unit's ratio, each against the sample it reads best. With the bias
    updates' ``slack`` (bias_slack), each ratio is read at the scale within that rounding nearest the sample, and a
    unit whose row moved while its bias update is within rounding of zero is read as its row at any scale."""
    live = live_units(bias)
    if slack is not None:
        # A bias update within rounding of zero, or not a number at all (an infinity sent for one bias): the row
        # is the sample's direction, at a scale the server fixes.
        moved = torch.isfinite(rows).all(dim=1) & (rows != 0).any(dim=1)
        live = live | (moved & scale_open(bias, slack))
        bias = torch.where(torch.isfinite(bias), bias, 0.0)  # the row alone, its scale open
    live = torch.nonzero(live).flatten()
    if not len(live):
        return []
    denominator = torch.where(bias[live] != 0, bias[live], 1.0)
    scales = scale_bounds(bias[live], None if slack is None else slack[live])
    best, scores = best_matches(rows[live] / denominator[:, None], vectors, peak, scales)
    return list(zip(live.tolist(), best, scores))


def decay_share(rows: torch.Tensor, received_rows: torch.Tensor, vectors: torch.Tensor) -> float | None:
    """The multiple c of the received weights W₀ that weight decay took out of the update, or None. SGD's update of
    a layer lies in the span of the vectors it read from the samples; weight decay adds −lr·λ·W₀ (with momentum,
    over the steps, about a multiple of it), and a server that knows lr and λ adds that multiple c back (lr·λ for
    one step). Outside the span the update is −c times W₀'s part there, so c is a least-squares fit of the two. None when the samples'
    vectors span every input (as many samples as inputs: nothing lies outside), when W₀ has no part outside, or
    when the fit is not a positive share that explains at least three quarters of the part outside (no decay)."""
    if len(vectors) >= vectors.shape[1] or not len(rows):
        return None
    if not (bool(torch.isfinite(rows).all()) and bool(torch.isfinite(received_rows).all())):
        return None
    basis, _ = torch.linalg.qr(vectors.T)  # (inputs, samples): the span of the samples' vectors
    outside = rows - (rows @ basis) @ basis.T
    received_outside = received_rows - (received_rows @ basis) @ basis.T
    energy = float((received_outside * received_outside).sum())
    if energy <= 0:
        return None
    share = -float((outside * received_outside).sum()) / energy
    if not math.isfinite(share) or share <= 0:
        return None
    # Decay, not rounding: the share explains most of the update's part outside the span (float32 rounding leaves
    # a part there that no multiple of W₀ explains).
    left = outside + share * received_outside
    return share if float((left * left).sum()) <= 0.25 * float((outside * outside).sum()) else None


def bias_rate(
    rows: torch.Tensor, bias: torch.Tensor, vectors: torch.Tensor, signals: list[torch.Tensor], candidates: list
) -> float | None:
    """The ratio k of the weights' learning rate to the biases' that the update shows, when it is not 1 (biases on
    their own learning rate, as some training recipes set them), or None. A readout that isolates sample s is then
    k·v_s, not v_s, and a server that knows the client's learning rates divides by k. Estimated from the readouts
    that isolate one sample: each unit that only one sample reaches (r = ΔW_i / Δb_i = k·v_s, so k = |r|² / r·v_s)
    or, without such units, each pair that isolates one; kept when at least half of them agree on it within 1 %."""
    estimates = []

    def estimate(readout: torch.Tensor, vector: torch.Tensor) -> None:
        dot = float(readout @ vector)
        if dot > 0 and math.isfinite(dot):
            estimates.append(float(readout @ readout) / dot)

    for table in signals:
        if len(table) != len(vectors):
            continue
        single = ((table != 0).sum(0) == 1) & live_units(bias)
        for unit in torch.nonzero(single).flatten().tolist():
            sample = int(torch.nonzero(table[:, unit]).flatten()[0])
            estimate(rows[unit] / bias[unit], vectors[sample])
    # Units that one sample alone reaches give k exactly; pairs only where there are none (a pair that isolates its
    # sample up to the search's tolerance holds a little of the others).
    for i, j, sample, scale in candidates if not estimates else []:
        denominator = float(bias[i] - scale * bias[j])
        if denominator != 0 and math.isfinite(denominator):
            estimate((rows[i] - scale * rows[j]) / denominator, vectors[sample])
    if not estimates:
        return None
    rate = float(torch.tensor(estimates, dtype=torch.float64).median())
    agree = sum(abs(value - rate) <= 1e-2 * rate for value in estimates)
    # Rates a percent or less from 1 are the same rate read through rounding and momentum (recipes that give
    # biases their own rate set it 2 or 10 times the weights', or a tenth).
    if rate <= 0 or abs(rate - 1) <= 1e-2 or 2 * agree < len(estimates):
        return None
    return rate


def adam_undone(
    rows: torch.Tensor, bias: torch.Tensor, signals: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, float, float] | None:
    """(the weight rows' gradients, the biases', lr, eps) behind an update that one Adam step made, or None. Adam's
    first step is u = −lr·g / (|g| + eps) value by value: a known map of the gradient, which a server that chose
    the weights (gradients near eps) and knows lr and eps inverts, |g| = eps·r / (1 − r) with r = |u| / lr, and then
    reads the ratios and pairs of g as of SGD's update. lr and eps are fitted from the biases' updates against the
    samples' summed signals at each unit (1/|u| = 1/lr + (eps/lr)·1/|g|, a line); kept when the line explains
    every bias update within 0.1 % with the sign Adam gives. SGD's update (no offset in that line) and several
    Adam steps (moments of several gradients) do not fit it."""
    table = next((table for table in signals if table.dim() == 2), None)
    if table is None or len(bias) != table.shape[1]:
        return None
    gradient = table.to(torch.float64).sum(0)
    update = bias.to(torch.float64)
    used = (update != 0) & (gradient != 0) & torch.isfinite(update) & torch.isfinite(gradient)
    if int(used.sum()) < 3:
        return None
    x, y = 1 / gradient[used].abs(), 1 / update[used].abs()
    design = torch.stack([torch.ones_like(x), x], dim=1)
    solution = torch.linalg.lstsq(design, y[:, None]).solution[:, 0]
    offset, slope = float(solution[0]), float(solution[1])
    if not (offset > 0 and slope > 0 and math.isfinite(offset) and math.isfinite(slope)):
        return None
    lr, eps = 1 / offset, slope / offset
    # Far above the gradients, eps makes the step lr/eps times the gradient (SGD's update, read as it is); far
    # under them, the step is lr times the gradient's sign, and nothing is left to invert.
    typical = float(gradient[used].abs().median())
    if not 1e-4 * typical <= eps <= 1e2 * typical:
        return None
    expected = lr * gradient[used].abs() / (gradient[used].abs() + eps)
    if float(((expected - update[used].abs()).abs() / update[used].abs()).max()) > 1e-3:
        return None
    if bool((torch.sign(update[used]) == torch.sign(gradient[used])).any()):
        return None  # Adam steps against the gradient: every update has the opposite sign

    def undone(values: torch.Tensor) -> torch.Tensor:
        share = (values.abs() / lr).clamp(max=1 - 1e-12)
        return -torch.sign(values) * eps * share / (1 - share)

    return undone(rows.to(torch.float64)), undone(update), lr, eps


def duplicates(vectors: torch.Tensor) -> list[list[int]]:
    """Groups of two or more samples whose vectors are the same (a sample and its copy in the batch): a readout that
    mixes them shows each of them exactly. Found by one random projection, each group checked value by value."""
    if len(vectors) < 2:
        return []
    direction = torch.randn(vectors.shape[1], generator=torch.Generator().manual_seed(0), dtype=vectors.dtype)
    keys = vectors @ direction
    order = torch.argsort(keys)
    same = torch.nonzero(keys[order][1:] == keys[order][:-1]).flatten().tolist()
    if not same:
        return []
    parent = {int(order[k + 1]): int(order[k]) for k in same if torch.equal(vectors[order[k]], vectors[order[k + 1]])}
    groups: dict[int, list[int]] = {}
    for sample in sorted(set(parent) | set(parent.values())):
        first = sample
        while first in parent:
            first = parent[first]
        groups.setdefault(first, []).append(sample)
    return [sorted(group) for group in groups.values() if len(group) > 1]


def merged(signals: torch.Tensor, groups: list[list[int]]) -> torch.Tensor:
    """The signals (samples, units) with each group of copies summed into its first member (the others
    zero): a pair that isolates the group reads every member of it."""
    table = signals.clone()
    for group in groups:
        table[group[0]] = signals[group].sum(0)
        table[group[1:]] = 0
    return table


def candidate_pairs(signals: torch.Tensor, parallel: float = PARALLEL) -> list[tuple[int, int, int, float]]:
    """[(i, j, s, c)]: units i < j whose signals (columns of the (samples, units) ``signals``) agree up to the
    scale c on every sample but s (a squared sine of at most ``parallel`` with s left out), and differ at s. Blind
    to the units' order, scale and sign."""
    return [pair[:4] for pair in _pairs_within(signals, parallel)]


def every_pair(
    rows: torch.Tensor, bias: torch.Tensor, vectors: torch.Tensor, peak: torch.Tensor, min_psnr: float
) -> list[tuple[int, int, int, float]] | None:
    """[(i, j, s, c)]: every pair of units i < j whose best readout (z₁·ΔW_i + z₂·ΔW_j) / (z₁·Δb_i + z₂·Δb_j) shows
    sample s at ``min_psnr`` or above, with c = −z₂/z₁; searched over every pair and every sample, without the
    signals (for an update whose steps were not watched: each step isolates its own samples, and no one set of
    signals says which pairs do). The readout's least squared error to v_s is det(M) / (mᵀ adj(M) m), M the Gram
    of p = ΔW_i − v_s·Δb_i and q = ΔW_j − v_s·Δb_j and m = (Δb_i, Δb_j), all from ΔW·ΔWᵀ, ΔW·vᵀ and |v|²: a filter
    in expanded sums (each pair it passes is formed and judged by pair_readouts). None when units² × samples is
    over EVERY_PAIR_MOST."""
    units, count = len(rows), len(vectors)
    if units < 2 or not count:
        return []
    if units * (units - 1) // 2 * count > EVERY_PAIR_MOST:
        return None
    finite = torch.isfinite(rows).all(dim=1) & torch.isfinite(bias)
    rows, bias = torch.where(finite[:, None], rows, 0.0), torch.where(finite, bias, 0.0)
    gram = rows @ rows.T
    cross = rows @ vectors.T  # (units, samples)
    energy = (vectors * vectors).sum(1)
    # A few dB of margin under the threshold: the expanded sums cancel near an exact readout.
    allowed = (peak**2) * vectors.shape[1] * 10 ** (-(min_psnr - 3) / 10)
    single = (peak**2) * vectors.shape[1] * 10 ** (-(min_psnr + 3) / 10)
    found = []
    for i in range(units - 1):
        j = torch.arange(i + 1, units)
        b_i, b_j = bias[i], bias[j][:, None]
        m11 = (gram[i, i] - 2 * b_i * cross[i] + b_i * b_i * energy)[None, :]
        m22 = gram[j, j][:, None] - 2 * b_j * cross[j] + b_j * b_j * energy[None, :]
        m12 = gram[i, j][:, None] - b_j * cross[i][None, :] - b_i * cross[j] + b_i * b_j * energy[None, :]
        shown = b_i * b_i * m22 - 2 * b_i * b_j * m12 + b_j * b_j * m11
        left = (m11 * m22 - m12 * m12).clamp_min(0)
        hit = (shown > 0) & (left <= allowed[None, :] * shown)
        # A pair one of whose units reads the sample on its own, a few dB above the threshold (its ratio's error is
        # m / b²), adds nothing to the ratios, which are read already: left out.
        hit &= (m11 > single[None, :] * b_i * b_i) & (m22 > single[None, :] * b_j * b_j)
        pair, sample = torch.nonzero(hit, as_tuple=True)
        if not len(pair):
            continue
        z1 = b_i * m22[pair, sample] - b_j[pair, 0] * m12[pair, sample]
        z2 = b_j[pair, 0] * m11[0, sample] - b_i * m12[pair, sample]
        scale = -z2 / torch.where(z1 != 0, z1, torch.full_like(z1, 1e-300))
        found += [
            (i, int(other), int(n), float(c))
            for other, n, c in zip(j[pair].tolist(), sample.tolist(), scale.tolist())
            if math.isfinite(c)
        ]
    return found


def few_values(vectors: torch.Tensor) -> bool:
    """The samples' vectors are short enough (CHANCE_DIMENSIONS values or fewer) for a readout at a scale fitted to
    a sample to pass near it by chance."""
    return vectors.shape[1] <= CHANCE_DIMENSIONS


def signal_supported(pairs: list[tuple], tables: list[torch.Tensor]) -> list[tuple]:
    """The pairs (i, j, s, c) whose two units' signals, in one of the (samples, units) ``tables``, agree at the
    scale c on every sample but at most an eighth of them (each within a percent of the larger, or both zero). A
    pair fitted to one sample alone has a scale for that sample only; in a few dimensions (four features, say) the
    readouts at every scale of some pair pass within 30 dB of samples the client never had as often as of its own,
    and the server, which does not know the sample, cannot choose that scale. Units of an imprint agree at their
    own scale on every sample outside their bin, in whichever step the bin was filled."""
    if not pairs or not tables:
        return []
    i = torch.tensor([pair[0] for pair in pairs])
    j = torch.tensor([pair[1] for pair in pairs])
    scale = torch.tensor([pair[3] for pair in pairs], dtype=torch.float64)
    kept = torch.zeros(len(pairs), dtype=torch.bool)
    for table in tables:
        table = table.to(torch.float64)
        first, second = table[:, i], scale[None, :] * table[:, j]  # (samples, pairs)
        differ = (first - second).abs() > SIGNAL_AGREEMENT * torch.maximum(first.abs(), second.abs())
        kept |= differ.sum(0) <= len(table) // 8
    return [pair for pair, keep in zip(pairs, kept.tolist()) if keep]


def isolating_and_nearly(signals: torch.Tensor) -> tuple[list, list]:
    """(candidate_pairs at PARALLEL, the further pairs within NEARLY_PARALLEL), from one search."""
    isolating, nearly = [], []
    for i, j, s, c, sine in _pairs_within(signals, NEARLY_PARALLEL):
        (isolating if sine <= PARALLEL else nearly).append((i, j, s, c))
    return isolating, nearly


def _pairs_within(signals: torch.Tensor, parallel: float) -> list[tuple[int, int, int, float, float]]:
    """candidate_pairs' search, each pair with its squared sine: [(i, j, s, c, sine²)]."""
    count, units = signals.shape
    if units < 2 or count < 2:
        return []
    signals = signals.to(torch.float64)
    scale = signals.abs().amax(dim=0).clamp_min(1e-300)
    exact = signals / scale
    # The search itself in float32, each unit's signal scaled to its largest entry (the test is blind to scale):
    # its error, about 1e-7 of each sum, is far under PARALLEL.
    signals = exact.to(torch.float32)
    gram = signals.T @ signals
    energy = gram.diagonal()
    pairs = _possible_pairs(exact, parallel)
    found = []
    # Each unit's energy with sample s left out, (units, samples); infinite where nothing is left (such a unit is
    # a ratio readout, formed already), so that no bound it enters is met.
    # Rows per unit, contiguous, gathered by index_select (advanced indexing and a transposed layout cost several
    # times as much for the same values).
    by_unit = signals.T.contiguous()
    left = energy[:, None] - by_unit**2
    left = torch.where(left > 0, left, math.inf)
    step = max(1, PAIR_BLOCK // count)
    for start in range(0, len(pairs), step):
        first, second = pairs[start : start + step, 0], pairs[start : start + step, 1]
        # With sample s left out: G_ij − δ_si·δ_sj, and each unit's energy without it.
        cross = by_unit.index_select(0, first).mul_(by_unit.index_select(0, second))
        torch.sub(gram[first, second][:, None], cross, out=cross)
        # sine² ≤ parallel, i.e. cross² ≥ (1 − parallel)·left_i·left_j, computed in place (the block is the
        # search's whole memory and most of its time).
        bound = left.index_select(0, first).mul_(left.index_select(0, second))
        bound.clamp_min_(1e-30).mul_(1 - parallel)
        hit = torch.ge(cross.square_(), bound)
        del bound, cross
        # Every hit of the block at once, each value in the same float32 steps as the block's (then float64).
        k, s = torch.nonzero(hit).unbind(1)
        if not len(k):
            continue
        i, j = first[k], second[k]
        cross = gram[i, j] - signals[s, i] * signals[s, j]
        ratio = cross / left[j, s]
        isolated = signals[s, i] - ratio * signals[s, j]
        kept = isolated.double().abs() > 1e-6 * energy[i].double().sqrt()
        sine = 1 - (cross**2 / (left[i, s] * left[j, s])).double()
        scaled = ratio.double() * (scale[i] / scale[j])
        found += zip(*(part[kept].tolist() for part in (i, j, s, scaled, sine)))
    return found


def isolating_groups(
    signals: torch.Tensor, most: int = GROUP_MOST, parallel: float = PARALLEL
) -> list[tuple[int, int, list[int], float]]:
    """[(i, j, samples, c)]: units i < j whose signals agree up to the scale c on every sample but two to ``most``
    of them, and differ at each of those. The pair's readout is then a mixture of those samples' vectors, which
    shows each of them when they are copies or near copies of one another (a sample and its slightly noisy copy in
    one bin of an imprint). The scale is fitted to all samples, then again without the ``most`` that fit it worst;
    the pairs no such set can make parallel are left out first, from sums over the samples (_possible_pairs)."""
    count, units = signals.shape
    if units < 2 or count < 3:
        return []
    scale_of = signals.to(torch.float64).abs().amax(dim=0).clamp_min(1e-300)  # each unit's largest signal
    exact = signals.to(torch.float64) / scale_of
    most = min(most, count - 1)
    pairs = _possible_pairs(exact, parallel, most)
    found = []
    step = max(1, PAIR_BLOCK // count)
    for start in range(0, len(pairs), step):
        first, second = pairs[start : start + step, 0], pairs[start : start + step, 1]
        x, y = exact[:, first].T, exact[:, second].T  # (pairs, samples)
        kept = torch.ones_like(x, dtype=torch.bool)
        for _ in range(2):
            scale = (x * y * kept).sum(1) / (y * y * kept).sum(1).clamp_min(1e-300)
            worst = (x - scale[:, None] * y).abs().topk(most, dim=1).indices
            kept = torch.ones_like(x, dtype=torch.bool).scatter_(1, worst, False)
        cross, energy_x, energy_y = (x * y * kept).sum(1), (x * x * kept).sum(1), (y * y * kept).sum(1)
        scale = cross / energy_y.clamp_min(1e-300)
        agree = cross**2 >= (1 - parallel) * energy_x * energy_y
        differ = ~kept & ((x - scale[:, None] * y).abs() > 1e-6 * (x * x).sum(1).sqrt()[:, None])
        sizes = differ.sum(1)
        for k in torch.nonzero(agree & (sizes >= 2) & (energy_x > 0) & (energy_y > 0)).flatten().tolist():
            members = torch.nonzero(differ[k]).flatten().tolist()
            i, j = int(first[k]), int(second[k])
            found.append((i, j, members, float(scale[k] * scale_of[i] / scale_of[j])))
    return found


def _possible_pairs(signals: torch.Tensor, parallel: float = PARALLEL, most: int = 1) -> torch.Tensor:
    """(pairs, 2): the units i < j for which some sample s can meet the pair test, from sums over the samples alone.
    With a = δ_si, b = δ_sj, G = Σ δ_i·δ_j and E the units' energies, the test at s is f(s) ≥ 0 with
        f(s) = (G − ab)² − (1 − p)(E_i − a²)(E_j − b²)
             = G² − (1 − p)·E_i·E_j − 2G·ab + (1 − p)(E_i·b² + E_j·a²) + p·a²b²,
    and with M the largest a² (b²) over the samples, f(s) ≤ G² − (1 − p)·E_i·E_j + 2|G|·√(M_i·M_j)
    + (1 − p)(E_i·M_j + E_j·M_i) + p·M_i·M_j for every s. A pair whose bound is negative cannot pass at any sample;
    p is ten times the pair test's tolerance (at most 0.5), so that the float32 search's rounding never meets a pair
    this leaves out. Units whose signals are spread over many samples (most units of an honest model) leave almost
    every pair out. With ``most`` > 1, the test with a set S of up to that many samples left out (a² becomes Σ_S a²,
    ab becomes Σ_S ab, and (Σ_S ab)² ≤ Σ_S a²·Σ_S b²) has the same bound with M the sum of the ``most`` largest
    squares."""
    squares = signals * signals
    energy = squares.sum(0)
    largest = squares.amax(dim=0) if most <= 1 else squares.topk(min(most, len(squares)), dim=0).values.sum(0)
    gram = signals.T @ signals
    p = min(10 * parallel, 0.5)
    bound = (
        gram**2
        - (1 - p) * energy[:, None] * energy[None, :]
        + 2 * gram.abs() * (largest[:, None] * largest[None, :]).sqrt()
        + (1 - p) * (energy[:, None] * largest[None, :] + energy[None, :] * largest[:, None])
        + p * largest[:, None] * largest[None, :]
    )
    live = energy > 0
    possible = (bound >= 0) & live[:, None] & live[None, :]
    return torch.nonzero(torch.triu(possible, diagonal=1))


def pair_readouts(
    rows: torch.Tensor,
    bias: torch.Tensor,
    vectors: torch.Tensor,
    peak: torch.Tensor,
    candidates: list,
    nearest_scale: bool = True,
    slack: torch.Tensor | None = None,
) -> list[tuple[int, int, int, float, float]]:
    """[(i, j, s, c, psnr)]: each candidate pair's readout (ΔW_i − c·ΔW_j) / (Δb_i − c·Δb_j) of sample s, at the
    better of two scales: the signals' c, and (``nearest_scale``) the c that brings the readout nearest to s (a
    server that chose the weights knows its own scales; the nearest is the most it can read). With the bias
    updates' ``slack`` (bias_slack), the readout is read at the factor within the denominator's rounding nearest
    s, and a pair whose denominator is within rounding of zero as its numerator at any scale."""
    if not candidates:
        return []
    i = torch.tensor([c[0] for c in candidates])
    j = torch.tensor([c[1] for c in candidates])
    s = torch.tensor([c[2] for c in candidates])
    from_signals = torch.tensor([c[3] for c in candidates], dtype=torch.float64)
    target = vectors[s]
    # Readout (z1·ΔW_i + z2·ΔW_j) / (z1·Δb_i + z2·Δb_j): its squared error to v_s is z'Mz / (z'm)², M the Gram of
    # p = ΔW_i − v_s·Δb_i and q = ΔW_j − v_s·Δb_j, m = (Δb_i, Δb_j); least at z = M⁻¹m.
    p = rows[i] - target * bias[i, None]
    q = rows[j] - target * bias[j, None]
    gram = torch.stack(
        [torch.stack([(p * p).sum(1), (p * q).sum(1)], 1), torch.stack([(p * q).sum(1), (q * q).sum(1)], 1)], 1
    )
    m = torch.stack([bias[i], bias[j]], 1)
    # Solved only where every value is finite (LAPACK's least squares fails on a NaN); elsewhere no nearest scale.
    finite = torch.isfinite(gram).all(dim=(1, 2)) & torch.isfinite(m).all(dim=1)
    z = torch.full_like(m, math.nan)
    if bool(finite.any()):
        z[finite] = torch.linalg.lstsq(gram[finite], m[finite][:, :, None]).solution[:, :, 0]
    nearest = -z[:, 1] / torch.where(z[:, 0] != 0, z[:, 0], torch.full_like(z[:, 0], 1e-300))
    results = []
    best_scale, best_score = from_signals.clone(), torch.full((len(candidates),), -math.inf, dtype=torch.float64)
    for scale in (from_signals, nearest) if nearest_scale else (from_signals,):
        denominator = bias[i] - scale * bias[j]
        rounding = None if slack is None else slack[i] + scale.abs() * slack[j]
        usable = (denominator != 0) & torch.isfinite(denominator)
        if rounding is not None:
            usable = usable | (torch.isfinite(denominator) & torch.isfinite(scale) & (denominator.abs() <= rounding))
        readout = (rows[i] - scale[:, None] * rows[j]) / torch.where(denominator != 0, denominator, 1.0)[:, None]
        bounds = scale_bounds(denominator, rounding)
        if bounds is not None:
            readout = readout * nearest_factors(
                (readout * target).sum(1, keepdim=True), (readout * readout).sum(1), bounds
            )
        score = torch.where(usable, psnr_of(readout, target, peak[s]), -math.inf)
        better = score > best_score
        best_score = torch.where(better, score, best_score)
        best_scale = torch.where(better, scale, best_scale)
    for (a, b, sample, _), scale, score in zip(candidates, best_scale.tolist(), best_score.tolist()):
        results.append((a, b, sample, scale, score))
    return results


def round_coefficients(weight_update: torch.Tensor, vectors: torch.Tensor) -> list[torch.Tensor]:
    """[(N, units)]: how much of each sample's vector each unit's row update holds over the whole round, solved from
    the update itself (u_W[i] = Σ_n c_(n,i) v_n under SGD, momentum or not), when the samples' vectors are
    independent (no more samples than inputs); [] otherwise. Every step's signals summed, as the server's readout
    sees them."""
    rows = weight_update.reshape(len(weight_update), -1).to(torch.float64)
    if len(vectors) > vectors.shape[1] or not len(vectors):
        return []
    if not (bool(torch.isfinite(rows).all()) and bool(torch.isfinite(vectors).all())):
        return []  # a least-squares solve over NaN or infinite values fails inside LAPACK
    solution = torch.linalg.lstsq(vectors.T, rows.T).solution  # (N, units)
    return [solution] if bool(torch.isfinite(solution).all()) else []
