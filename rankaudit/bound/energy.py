"""The energy certificate: the share of each sample's detail no weights can make visible (a per-sample quantile), and
the PSNR ceiling of what they can show (docs/method.md, "The certificate, per sample")."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from rankaudit.bound.quantile import (
    PHOTO_REFERENCE,
    SAMPLE_CONFIDENCE,
    PhotoShares,
    SampleShares,
    certificate_words,
    order_statistic,
    photo_shares_for,
)
from rankaudit.settings.files import not_a_file
from rankaudit.settings.levels import (
    DEFAULT_CERTIFICATE_QUANTILE,
    DEFAULT_EXPOSED_BELOW,
    DEFAULT_MAX_RECOVERABLE,
    energy_level,
    verdict_level,
)

SPECTRUM_FILE = Path(__file__).with_name("data") / "photo_spectrum.json"
PHOTO_SPECTRUM = "natural-photograph spectrum shipped with rankaudit"
NO_REFERENCE = (
    "no reference for an input that is not an image: nothing is certified; give --data (a few hundred samples like "
    "yours) for a figure"
)
# Above this many unknowns a shrunk sample covariance would need an eigendecomposition too large for an analysis
# that runs in seconds; the shipped spectrum is used instead (images), and the report says so.
LARGEST_EIGENDECOMPOSITION = 4096


class ReferenceDataError(Exception):
    """--data cannot serve as the reference distribution; the message names the problem and the fix."""


@dataclass
class Reference:
    """A reference distribution of one sample, as the eigenvalues of its covariance (largest first)."""

    eigenvalues: np.ndarray
    name: str
    peak: float = 1.0  # the input's range: the PSNR's peak
    certifies: bool = True  # False: no distribution is known (a non-image input without --data), nothing certified
    note: str | None = None  # one line for the report where --data could not serve as the reference
    # The user's samples themselves (--data): the per-sample certificate is an order statistic of their hidden shares
    samples: SampleShares | None = None
    mean: np.ndarray | None = None  # the reference's mean sample (flat): what each sample's detail is measured from
    # Images without --data: the shipped table of photograph crops' hidden shares, which the certificate reads
    photo_shares: PhotoShares | None = None


@lru_cache(maxsize=1)
def _photo_model() -> dict:
    return json.loads(SPECTRUM_FILE.read_text())


def _colour_axes(channels: int) -> tuple[np.ndarray, np.ndarray]:
    """The colour covariance's eigenvalues and axes (columns). One channel is the photographs' luma; other channel
    counts put the whole colour variance on one axis (fully correlated channels): the most concentrated, hence
    conservative, choice."""
    colour = np.asarray(_photo_model()["colour_covariance"], dtype=np.float64)
    if channels == 3:
        values, axes = np.linalg.eigh(colour)
        return np.clip(values, 0.0, None), axes
    luma = np.array([0.299, 0.587, 0.114])
    variance = float(luma @ colour @ luma) if channels == 1 else float(np.trace(colour)) / 3.0
    values = np.zeros(channels)
    values[0] = variance * channels
    axes = np.linalg.qr(np.column_stack([np.ones(channels), np.eye(channels)[:, 1:]]))[0]
    return values, axes


def _photo_modes(channels: int, height: int, width: int) -> np.ndarray:
    """The shipped model's eigenvalues in the order of _photo_basis's columns (colour axis, DCT row, DCT column)."""
    model = _photo_model()
    ky = np.arange(height)[:, None] / 2.0
    kx = np.arange(width)[None, :] / 2.0
    r2 = ky**2 * (width / height) + kx**2 * (height / width)
    spatial = (r2 + model["r0"] ** 2) ** (-model["alpha"] / 2) * np.exp(-model["beta"] * r2 / (height * width))
    spatial *= height * width / spatial.sum()  # per-pixel variance = the colour covariance's, at every size
    return (_colour_axes(channels)[0][:, None, None] * spatial[None]).ravel()


def photo_eigenvalues(channels: int, height: int, width: int) -> np.ndarray:
    """The shipped photograph spectrum's eigenvalues at C×H×W, largest first.

    The model is diagonal in (colour principal axes) x (2-D DCT frequencies), so its eigenvalues are the products of
    the colour covariance's eigenvalues and a radial power spectrum evaluated at the H·W frequencies: no n×n
    eigendecomposition, a sort of n numbers (a 3×224×224 input is 150,528 of them).
    """
    return np.sort(_photo_modes(channels, height, width))[::-1]


def data_reference(source: str, shape: tuple[int, ...]) -> Reference:
    """The user's own samples (--data: an image folder or a .npy, read by the verifiers' rules) as the reference.

    Images: with N samples and n unknowns, N < n leaves the sample covariance rank-deficient (it would certify
    nothing beyond its N directions as visible), so it is shrunk toward the shipped photograph spectrum with weight
    (n − N)/n on it, both at the data's total variance. Other inputs have no shipped spectrum to shrink toward (equal
    energy in every direction is the least concentrated spectrum there is, not a conservative one): their sample
    covariance is used as it is, and the directions the samples do not span count as visible. One sample is no
    distribution: it still serves as the image to attack, and the reference falls back to the shipped one (images)
    or to none (other inputs), said in `note`.
    """
    unknowns = int(np.prod(shape))
    samples = _read_samples(source, shape)
    count = samples.shape[0]
    image = len(shape) == 3
    if count < 2:
        fallback = reference_for(shape, unknowns)
        shipped = "the shipped photographs' reference" if image else "no reference"
        fallback.note = (
            f"--data {Path(source).name} holds {count} sample: it is what the verifiers attack, and the certificate "
            f"uses {shipped} (give a few hundred samples for one of your own)"
        )
        return fallback
    reference = _data_spectrum(samples, shape, Path(source).name)
    # The certificate itself is read off the samples (docs/method.md, "The certificate, read from samples"); the
    # spectrum above gives the expected share beside it.
    reference.samples = SampleShares.of(samples)
    reference.mean = samples.reshape(count, -1).mean(0)
    return reference


def _data_spectrum(samples: np.ndarray, shape: tuple[int, ...], name: str) -> Reference:
    """The samples' covariance eigenvalues: as they are when they are enough (or the input is not an image), else
    shrunk toward the shipped photograph spectrum."""
    count, unknowns, image = samples.shape[0], int(np.prod(shape)), len(shape) == 3
    centred = samples.reshape(count, -1) - samples.reshape(count, -1).mean(0)
    if count >= unknowns or not image:
        # Only the eigenvalues are needed: the singular values of the centred samples, not an n×n covariance.
        eigenvalues = np.linalg.svd(centred, compute_uv=False) ** 2 / (count - 1)
        eigenvalues = np.concatenate([eigenvalues, np.zeros(unknowns - eigenvalues.size)])
        name = f"--data: {count:,} samples from {name}"
        if count < unknowns:
            name += f", fewer than the {unknowns:,} unknowns: the directions they do not span count as visible"
        return Reference(np.sort(eigenvalues)[::-1], name)
    fallback = photo_eigenvalues(*shape)
    if unknowns > LARGEST_EIGENDECOMPOSITION:
        # Shrinking would need an n×n eigendecomposition: the expected share uses the shipped spectrum, and says so.
        return Reference(
            fallback,
            f"--data: {count:,} samples from {name} (the expected share from the {PHOTO_SPECTRUM}: they are too "
            f"few for a spectrum of {unknowns:,} unknowns)",
        )
    weight = (unknowns - count) / unknowns
    total = float((centred**2).sum() / (count - 1))
    covariance = (1 - weight) * (centred.T @ centred) / (count - 1)
    basis = _photo_basis(*shape)
    covariance += weight * total / fallback.sum() * (basis * _photo_modes(*shape)) @ basis.T
    eigenvalues = np.clip(np.linalg.eigvalsh(covariance), 0.0, None)[::-1]
    return Reference(
        eigenvalues,
        f"--data: {count:,} samples from {name} (the expected share from their spectrum, fewer samples than the "
        f"{unknowns:,} unknowns: shrunk toward the shipped photograph spectrum, weight {weight:.2f})",
    )


def _dct(size: int) -> np.ndarray:
    """The orthonormal DCT-II matrix (rows: frequencies)."""
    k = np.arange(size)[:, None]
    matrix = np.cos(np.pi * (np.arange(size)[None, :] + 0.5) * k / size) * math.sqrt(2 / size)
    matrix[0] /= math.sqrt(2)
    return matrix


def _photo_basis(channels: int, height: int, width: int) -> np.ndarray:
    """n×n: the columns are the shipped model's eigenvectors (colour axis ⊗ DCT row ⊗ DCT column) in pixel order."""
    colour = _colour_axes(channels)[1]
    # pixel (c, y, x), mode (a, i, j): colour[c, a] · D_H[i, y] · D_W[j, x]
    return np.kron(colour, np.kron(_dct(height).T, _dct(width).T))


def _read_samples(source: str, shape: tuple[int, ...]) -> np.ndarray:
    path = Path(source)
    if len(shape) == 3 and shape[0] in (1, 3):
        from rankaudit.bound.images import DataError, held_images, load_images

        try:
            return load_images(source, tuple(shape), max(held_images(source) or 1, 1))[0].double().numpy()
        except DataError as exc:
            raise ReferenceDataError(f"--data: {exc}") from exc
    kind = not_a_file(path)  # a FIFO would block the read
    if kind is not None:
        raise ReferenceDataError(f"--data {source} is {kind}, not a regular file: save the samples with numpy.save")
    if path.suffix.lower() != ".npy" or not path.exists():
        raise ReferenceDataError(
            f"--data {source}: an input of shape {tuple(shape)} reads its samples from a .npy file of N x "
            f"{' x '.join(str(s) for s in shape)}: save one with numpy.save"
        )
    try:
        array = np.load(path, allow_pickle=False).astype(np.float64)
    except Exception as exc:
        raise ReferenceDataError(f"--data {source} cannot be read as a .npy array ({type(exc).__name__})") from exc
    if array.ndim < 2 or int(np.prod(array.shape[1:])) != int(np.prod(shape)):
        raise ReferenceDataError(
            f"--data {source} has shape {array.shape}: expected N x {' x '.join(str(s) for s in shape)}"
        )
    if not np.isfinite(array).all():
        raise ReferenceDataError(f"--data {source} holds non-finite values: remove them")
    return array


def reference_for(shape: tuple[int, ...] | None, unknowns: int, data: str | None = None) -> Reference:
    """In this order: the user's samples; the shipped photograph spectrum for C×H×W; else no reference, which
    certifies nothing (docs/method.md, "The reference distribution")."""
    if data is not None and shape is not None:
        return data_reference(data, shape)
    if shape is not None and len(shape) == 3 and min(shape) >= 1:
        return photo_reference(tuple(int(s) for s in shape))
    return no_reference(unknowns)


def photo_reference(shape: tuple[int, int, int]) -> Reference:
    """An image without --data: the certificate reads the shipped photographs' per-sample table, the expected share
    the shipped spectrum; where no table fits the shape (other channel counts, or under the smallest fitted size),
    no reference is trustworthy and nothing is certified."""
    eigenvalues = photo_eigenvalues(*shape)
    table = photo_shares_for(shape)
    if table is None:
        return Reference(
            eigenvalues,
            f"no photographs' reference fits a {'x'.join(str(s) for s in shape)} input (fitted for 1 or 3 channels "
            "from 8x8 px): nothing is certified; give --data (a few hundred samples like yours) for a figure",
            certifies=False,
        )
    return Reference(eigenvalues, PHOTO_REFERENCE, photo_shares=table)


def reference_mean(shape: tuple[int, ...] | None, data: str | None = None) -> np.ndarray | None:
    """The reference's mean sample (flat): what the certificate measures each sample's detail from, and so what
    `--verify rank` measures it from. --data: its samples' mean; an image without --data: the photographs' mean
    colour at every pixel (the shipped model is the same at every position); None for other inputs without --data
    (no reference: nothing is certified)."""
    if shape is None:
        return None
    if data is not None:
        return _read_samples(data, shape).reshape(-1, int(np.prod(shape))).mean(0)
    if len(shape) != 3 or shape[0] not in (1, 3):
        return None
    colour = np.asarray(_photo_model()["mean_colour"], dtype=np.float64)
    if shape[0] == 1:
        colour = np.array([float(np.dot([0.299, 0.587, 0.114], colour))])
    return np.repeat(colour, int(shape[1]) * int(shape[2]))


def no_reference(unknowns: int) -> Reference:
    return Reference(np.ones(unknowns), NO_REFERENCE, certifies=False)


def hidden_share(eigenvalues: np.ndarray, rank: int, copies: int = 1) -> float | None:
    """Σ_{k>R} λ_k / Σ λ_k over the sorted eigenvalues, each repeated `copies` times (independent samples): the
    least share of a sample's energy, on average, outside every subspace of dimension R (Ky Fan). None when not finite."""
    total = float(eigenvalues.sum()) * copies
    hidden = _tail(eigenvalues, rank, copies)
    if not (math.isfinite(total) and math.isfinite(hidden)) or total <= 0:
        return None
    return min(max(hidden / total, 0.0), 1.0)


def psnr_ceiling(eigenvalues: np.ndarray, rank: int, peak: float = 1.0, copies: int = 1) -> float | None:
    """10·log10(peak² · n / Σ_{k>R} λ_k): the visible part's PSNR for a typical sample; None when nothing is
    hidden (an exact reconstruction has no finite PSNR) or the figure is not finite."""
    hidden = _tail(eigenvalues, rank, copies)
    unknowns = eigenvalues.size * copies
    if not math.isfinite(hidden) or hidden <= 0:
        return None
    value = 10 * math.log10(peak**2 * unknowns / hidden)
    return value if math.isfinite(value) else None


def _tail(eigenvalues: np.ndarray, rank: int, copies: int) -> float:
    """Σ of the smallest n·copies − R of the eigenvalues repeated `copies` times, without building the repeat: the
    top R of the repeated list are the first ⌊R/copies⌋ values (each `copies` times) and R mod copies of the next."""
    rank = max(int(rank), 0)
    whole, rest = divmod(rank, copies)
    if whole >= eigenvalues.size:
        return 0.0
    return float(eigenvalues[whole:].sum() * copies - eigenvalues[whole] * rest)


# The per-sample certificate (docs/method.md, "The certificate, per sample") is read off Monte Carlo draws of the
# reference: this many draws, a fixed seed (the same figure on every run), and the order statistic that sits at or
# below the true quantile with this confidence. Neighbouring eigenvalues within MERGE_RATIO of each other are drawn
# together (one chi-square of their joint degrees of freedom), each group at the value that makes it conservative.
QUANTILE_DRAWS = 10_000
QUANTILE_CONFIDENCE = 0.999
MERGE_RATIO = 1.05
_per_sample_cache: dict = {}


def _order_statistic(draws: int, below: float) -> int:
    """The order statistic of the Monte Carlo draws that sits at or below the true quantile with probability
    QUANTILE_CONFIDENCE (quantile.order_statistic)."""
    return order_statistic(draws, below, QUANTILE_CONFIDENCE)


def _grouped(values: np.ndarray, counts: np.ndarray, keep: str) -> tuple[np.ndarray, np.ndarray]:
    """Runs of sorted (largest first) values within MERGE_RATIO merged into one: value the run's largest
    (keep="largest") or smallest, count the run's total."""
    merged_values, merged_counts = [], []
    start = 0
    while start < values.size:
        end = start
        while end + 1 < values.size and values[end + 1] * MERGE_RATIO >= values[start]:
            end += 1
        merged_values.append(values[start] if keep == "largest" else values[end])
        merged_counts.append(counts[start : end + 1].sum())
        start = end + 1
    return np.asarray(merged_values, dtype=np.float64), np.asarray(merged_counts, dtype=np.float64)


def per_sample_certificate(
    eigenvalues: np.ndarray, rank: int, copies: int = 1, quantile: float = DEFAULT_CERTIFICATE_QUANTILE
) -> tuple[float, float] | None:
    """(h, e): at least `quantile` of the samples drawn from a Gaussian reference with these covariance eigenvalues
    (largest first; each repeated `copies` times for independent samples taken together) keep at least the share h
    of their deviation from the mean, and at least the energy e of it, hidden from any one subspace of dimension
    `rank` fixed before the sample is drawn. None when the eigenvalues are not finite.

    For every such subspace V and share h, ‖(I − P_V)y‖² < h‖y‖² is a quadratic form in y whose eigenvalues are,
    in order, at least those it has for V = the top `rank` principal components (Weyl's inequalities), and the hidden
    energy is at least that of the principal tail in the same coupling (Cauchy interlacing): the principal subspace
    is the worst for every quantile of both, so drawing the tail T = Σ_{k>R} λ_k z_k² and head H = Σ_{k<=R} λ_k z_k²
    and reading the (1 − quantile)-order statistics of T/(T + H) and T is the certificate (docs/method.md)."""
    eigenvalues = np.asarray(eigenvalues, dtype=np.float64)
    total = float(eigenvalues.sum())
    if not (math.isfinite(total) and np.isfinite(eigenvalues).all()) or total <= 0:
        return None
    rank, copies = max(int(rank), 0), max(int(copies), 1)
    key = (hash(eigenvalues.tobytes()), eigenvalues.size, rank, copies, float(quantile))
    if key in _per_sample_cache:
        return _per_sample_cache[key]
    whole, rest = divmod(rank, copies)
    if whole >= eigenvalues.size:
        answer = (0.0, 0.0)
    elif rank == 0:
        answer = (1.0, _tail_quantile(eigenvalues, copies, quantile))
    else:
        values = np.sort(eigenvalues)[::-1]
        counts = np.full(values.size, float(copies))
        head_values, head_counts = values[: whole + (1 if rest else 0)], counts[: whole + (1 if rest else 0)].copy()
        if rest:
            head_counts[-1] = rest
        tail_values, tail_counts = values[whole:].copy(), counts[whole:].copy()
        tail_counts[0] = copies - rest
        visible = tail_values > total * 1e-12  # dropping a negligible tail only lowers what is certified
        answer = _draw(head_values, head_counts, tail_values[visible], tail_counts[visible], quantile)
    _per_sample_cache[key] = answer
    return answer


def _tail_quantile(eigenvalues: np.ndarray, copies: int, quantile: float) -> float:
    values = np.sort(eigenvalues)[::-1]
    keep = values > values.sum() * 1e-12
    return _draw(np.zeros(0), np.zeros(0), values[keep], np.full(int(keep.sum()), float(copies)), quantile)[1]


def _draw(head_values, head_counts, tail_values, tail_counts, quantile: float) -> tuple[float, float]:
    if tail_values.size == 0:
        return 0.0, 0.0
    generator = np.random.default_rng(0)
    tail_values, tail_counts = _grouped(tail_values, tail_counts, "smallest")
    tail = 2 * generator.standard_gamma(tail_counts / 2, size=(QUANTILE_DRAWS, tail_values.size)) @ tail_values
    head = np.zeros(QUANTILE_DRAWS)
    if head_values.size:
        head_values, head_counts = _grouped(head_values, head_counts, "largest")
        head = 2 * generator.standard_gamma(head_counts / 2, size=(QUANTILE_DRAWS, head_values.size)) @ head_values
    k = _order_statistic(QUANTILE_DRAWS, 1 - quantile)
    if k == 0:
        return 0.0, 0.0
    share = np.partition(tail / (tail + head), k - 1)[k - 1]
    energy = np.partition(tail, k - 1)[k - 1]
    return min(max(float(share), 0.0), 1.0), max(float(energy), 0.0)


def certified_share(
    eigenvalues: np.ndarray, rank: int, copies: int = 1, quantile: float = DEFAULT_CERTIFICATE_QUANTILE
) -> float | None:
    """The per-sample certificate's share h (per_sample_certificate); None when not finite."""
    answer = per_sample_certificate(eigenvalues, rank, copies, quantile)
    return None if answer is None else answer[0]


def certified_psnr_ceiling(
    eigenvalues: np.ndarray, rank: int, peak: float = 1.0, quantile: float = DEFAULT_CERTIFICATE_QUANTILE
) -> float | None:
    """10·log10(peak² · n / e): the PSNR that the visible part of at least `quantile` of the samples stays under (e:
    per_sample_certificate's hidden energy); None when nothing is certified hidden."""
    answer = per_sample_certificate(eigenvalues, rank, 1, quantile)
    return None if answer is None else _psnr(peak, eigenvalues.size, answer[1])


def _psnr(peak: float, unknowns: int, hidden_energy: float) -> float | None:
    """10·log10(peak² · n / e); None when nothing is certified hidden (e = 0) or the figure is not finite."""
    if not hidden_energy > 0:
        return None
    value = 10 * math.log10(peak**2 * unknowns / hidden_energy)
    return value if math.isfinite(value) else None


def largest_protected_rank(
    eigenvalues: np.ndarray, protected_share: float, quantile: float = DEFAULT_CERTIFICATE_QUANTILE
) -> int:
    """The largest R at which the per-sample certificate still reaches `protected_share`: what `protected` asks of
    R_s."""
    return _largest_rank_reaching(
        lambda rank: certified_share(eigenvalues, rank, 1, quantile), protected_share, int(eigenvalues.size)
    )


def _largest_rank_reaching(share_at, protected_share: float, unknowns: int) -> int:
    """The largest R in [0, unknowns] whose certified share `share_at(R)` reaches `protected_share`. The certified
    share never grows with R (a larger subspace shows more), so a bisection finds it."""
    if (share_at(1) or 0.0) < protected_share - 1e-12:
        return 0  # one direction already shows too much (photographs): no bisection over 10⁵ ranks
    low, high = 1, int(unknowns)
    while high - low > 1:
        middle = (low + high) // 2
        if (share_at(middle) or 0.0) >= protected_share - 1e-12:
            low = middle
        else:
            high = middle
    return low


def largest_protected_share_rank(eigenvalues: np.ndarray, protected_share: float) -> float:
    """The largest rank per sample r (fractional: R over `copies` samples) at which the mean hidden share still
    reaches `protected_share`. Over many samples taken together the certified share of the batch approaches the mean
    one from below, so a batch or round of c samples needs R <= c·r at least: where the searches for the first
    protected batch or round start."""
    total = float(eigenvalues.sum())
    tails = np.cumsum(eigenvalues[::-1])[::-1] / total if total > 0 else np.zeros(eigenvalues.size)
    meeting = np.nonzero(tails >= protected_share - 1e-12)[0]
    whole = int(meeting[-1]) if meeting.size else 0
    if whole >= eigenvalues.size or total <= 0 or eigenvalues[whole] <= 0:
        return float(eigenvalues.size)
    spare = (1 - protected_share) * total - float(eigenvalues[:whole].sum())  # visible energy left to spend
    return whole + min(max(spare / float(eigenvalues[whole]), 0.0), 1.0)


def sample_reference(inputs, unknowns: int, data: str | None = None) -> Reference | None:
    """The reference distribution of one sample of a model with these inputs (docs/method.md's order), at
    `unknowns` eigenvalues; None for token inputs (they keep the rank level and their own finding). Several data
    inputs taken together have no reference (nothing certified)."""
    carrying = [spec for spec in inputs if spec.carries_unknowns]
    if not carrying or any(spec.role != "data" for spec in carrying):
        return None
    shape = tuple(carrying[0].shape) if len(carrying) == 1 else None
    reference = reference_for(shape, unknowns, data)
    if reference.eigenvalues.size != unknowns:
        reference = no_reference(unknowns)
    return reference


@dataclass
class EnergyScale:
    """One traced model's sample reference with the thresholds in force: the level of any rank bound on it, as
    `check` reads it (the per-sample certificate), for the design review's edits, withheld sets and rounds. Without
    a reference (token inputs) the level stays the one on directions; a reference that certifies nothing (a
    non-image input without --data) reads every bound at a hidden share of 0."""

    reference: Reference | None
    unknowns: int  # |x|
    max_recoverable: float = DEFAULT_MAX_RECOVERABLE
    exposed_below: float = DEFAULT_EXPOSED_BELOW
    quantile: float = DEFAULT_CERTIFICATE_QUANTILE

    @classmethod
    def of(
        cls, inputs, unknowns: int, data=None, max_recoverable=None, exposed_below=None, quantile=None
    ) -> EnergyScale:
        return cls(
            sample_reference(inputs, unknowns, data),
            unknowns,
            DEFAULT_MAX_RECOVERABLE if max_recoverable is None else max_recoverable,
            DEFAULT_EXPOSED_BELOW if exposed_below is None else exposed_below,
            DEFAULT_CERTIFICATE_QUANTILE if quantile is None else quantile,
        )

    def hidden(self, rank_bound: int, copies: int = 1) -> float | None:
        """The certified per-sample hidden share of a rank bound over `copies` independent samples."""
        if not self.reference.certifies:
            return 0.0
        if self.reference.samples is not None and copies == 1:
            return self.reference.samples.certificate(rank_bound, self.quantile)[0]
        if self.reference.photo_shares is not None and copies == 1:
            return self.reference.photo_shares.certificate(rank_bound, self.quantile)[0]
        return certified_share(self.reference.eigenvalues, rank_bound, copies, self.quantile)

    def level(self, rank_bound: int, copies: int = 1) -> str:
        """The level of a rank bound over `copies` independent samples (1: one sample's R_s)."""
        if self.reference is None:
            return verdict_level(rank_bound, self.unknowns * copies, self.max_recoverable)
        hidden = self.hidden(rank_bound, copies)
        if hidden is None:
            return "exposed"  # no finite figure certifies anything: assume the worst
        return energy_level(hidden, self.max_recoverable, self.exposed_below)

    def whole_protected_rank(self) -> float:
        """Where the searches for the first protected batch or round start: the largest rank per sample at which
        the mean share is still protected (many samples together approach it from below); 0 without a figure."""
        if self.reference is None:
            return self.max_recoverable * self.unknowns
        if not self.reference.certifies:
            return 0.0
        return largest_protected_share_rank(self.reference.eigenvalues, 1 - self.max_recoverable)

    def protected_rank(self) -> float:
        """The largest rank per sample that is still protected (for R over several samples, a starting point: the
        searches check each try on the samples taken together)."""
        if self.reference is None:
            return self.max_recoverable * self.unknowns
        if not self.reference.certifies:
            return 0.0
        if self.reference.samples is not None or self.reference.photo_shares is not None:
            return float(_largest_rank_reaching(self.hidden, 1 - self.max_recoverable, self.unknowns))
        return float(largest_protected_rank(self.reference.eigenvalues, 1 - self.max_recoverable, self.quantile))


def certify(bound, inputs, data: str | None = None, exposed_below: float | None = None, quantile: float | None = None):
    """The energy certificate into `bound` (an Identifiability with its SampleBound): per sample (R_s over |x|) the
    certified hidden share at the quantile, the expected share (Ky Fan) and the PSNR ceiling; for the batch or round
    line (R over N·|x|, each λ once per sample) the certified share of the samples taken together; the
    distribution's name, and the sample level on energy. Token inputs keep the rank level and their own finding.
    Returns the Reference used (None for token inputs)."""
    sample = bound.sample
    reference = sample_reference(inputs, sample.unknowns, data)
    if reference is None:
        return None
    threshold = DEFAULT_EXPOSED_BELOW if exposed_below is None else exposed_below
    scale = EnergyScale(reference, sample.unknowns, bound.max_recoverable, threshold)
    if quantile is not None:
        scale.quantile = quantile
    eigenvalues = reference.eigenvalues
    copies = max(bound.unknowns // sample.unknowns, 1) if sample.unknowns else 1
    sample.certified_hidden_energy = scale.hidden(sample.rank_bound)
    bound.certified_hidden_energy = scale.hidden(bound.rank_bound, copies)
    bound.spectrum = reference.name
    if reference.certifies:
        sample.expected_hidden_energy = hidden_share(eigenvalues, sample.rank_bound)
        sample.visible_psnr_ceiling = certified_psnr_ceiling(
            eigenvalues, sample.rank_bound, reference.peak, scale.quantile
        )
    if reference.certifies and reference.samples is not None:
        energy = reference.samples.certificate(sample.rank_bound, scale.quantile)[1]
        sample.visible_psnr_ceiling = _psnr(reference.peak, sample.unknowns, energy)
        bound.spectrum = f"{reference.name}; {certificate_words(reference.samples, scale.quantile)}"
        bound.certificate_samples = reference.samples.count
        bound.certificate_confidence = SAMPLE_CONFIDENCE
    if reference.certifies and reference.photo_shares is not None:
        per_pixel = reference.photo_shares.certificate(sample.rank_bound, scale.quantile)[1]
        sample.visible_psnr_ceiling = _psnr(reference.peak, 1, per_pixel)
        bound.spectrum = f"{reference.name}; {reference.photo_shares.words(scale.quantile)}"
        bound.certificate_confidence = SAMPLE_CONFIDENCE
    bound.reference_note = reference.note
    bound.certificate_quantile = scale.quantile
    sample.level = scale.level(sample.rank_bound)
    if bound.certified_hidden_energy is not None:  # the batch or round line, read on the same scale (context)
        bound.verdict = scale.level(bound.rank_bound, copies)
    bound.protected_rank = int(scale.protected_rank())
    bound.exposed_below = scale.exposed_below
    return reference


REFERENCE_CROP = Path(__file__).with_name("data") / "reference_crop.npy"


def _area_matrix(target: int, source: int) -> np.ndarray:
    """target×source: each output pixel the average of the source pixels its footprint covers (area resampling)."""
    edges = np.linspace(0.0, source, target + 1)
    matrix = np.zeros((target, source))
    for row in range(target):
        low, high = edges[row], edges[row + 1]
        for col in range(int(np.floor(low)), min(int(np.ceil(high)), source)):
            matrix[row, col] = min(high, col + 1) - max(low, col)
    return matrix / matrix.sum(axis=1, keepdims=True)


def reference_picture(shape: tuple[int, ...], rank: int) -> tuple[np.ndarray, np.ndarray, float | None] | None:
    """One photograph crop shipped with the package (64×64, one of the verifiers' default crops) at C×H×W, and its
    projection onto the top `rank` components of the shipped spectrum: what a server that picks the weights could
    see of it at this bound. (original, visible part, PSNR of the visible part); None for inputs that are not 1- or
    3-channel images."""
    if len(shape) != 3 or shape[0] not in (1, 3) or min(shape) < 1:
        return None
    channels, height, width = (int(s) for s in shape)
    crop = np.load(REFERENCE_CROP).astype(np.float64) / 255.0  # 3 × 64 × 64
    if channels == 1:
        crop = np.tensordot(np.array([0.299, 0.587, 0.114]), crop, axes=1)[None]
    original = np.einsum("hy,cyx,wx->chw", _area_matrix(height, 64), crop, _area_matrix(width, 64))
    axes = _colour_axes(channels)[1]
    to_modes = np.einsum("ca,chw->ahw", axes, original)
    coefficients = np.einsum("ih,ahw,jw->aij", _dct(height), to_modes, _dct(width))
    order = np.argsort(_photo_modes(channels, height, width))[::-1]
    kept = np.zeros(coefficients.size, dtype=bool)
    kept[order[: max(int(rank), 0)]] = True
    coefficients = np.where(kept.reshape(coefficients.shape), coefficients, 0.0)
    visible = np.einsum("ca,aij->cij", axes, np.einsum("ih,aij,jw->ahw", _dct(height), coefficients, _dct(width)))
    error = float(np.mean((visible - original) ** 2))
    psnr = 10 * math.log10(1.0 / error) if error > 1e-20 else None  # below: the crop itself, to rounding
    return original, visible, psnr if psnr is None or math.isfinite(psnr) else None
