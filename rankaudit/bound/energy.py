"""The energy certificate (spec §15): the share of a typical sample's energy no weights can make visible, and the PSNR
ceiling of what they can."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from rankaudit.settings.levels import DEFAULT_EXPOSED_BELOW, DEFAULT_MAX_RECOVERABLE, energy_level, verdict_level

SPECTRUM_FILE = Path(__file__).with_name("data") / "photo_spectrum.json"
PHOTO_SPECTRUM = "natural-photograph spectrum shipped with rankaudit"
WHITE = "equal energy in every direction (white data assumed: no image shape and no --data)"
# Above this many unknowns a shrunk sample covariance would need an eigendecomposition too large for an analysis
# that runs in seconds; the shipped spectrum (images) or white data is used instead, and the report says so.
LARGEST_EIGENDECOMPOSITION = 4096


class ReferenceDataError(Exception):
    """--data cannot serve as the reference distribution; the message names the problem and the fix."""


@dataclass
class Reference:
    """A reference distribution of one sample, as the eigenvalues of its covariance (largest first)."""

    eigenvalues: np.ndarray
    name: str
    peak: float = 1.0  # the input's range: the PSNR's peak


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


def white_eigenvalues(unknowns: int) -> np.ndarray:
    return np.ones(unknowns)


def data_reference(source: str, shape: tuple[int, ...]) -> Reference:
    """The user's own samples (--data: an image folder or a .npy, read by the verifiers' rules) as the reference.

    With N samples and n unknowns, N < n leaves the sample covariance rank-deficient (it would certify nothing
    beyond its N directions as visible), so it is shrunk toward the shipped reference (photographs for images,
    white otherwise) with weight (n − N)/n on the reference, both at the data's total variance.
    """
    unknowns = int(np.prod(shape))
    samples = _read_samples(source, shape)
    count = samples.shape[0]
    if count < 2:
        raise ReferenceDataError(f"--data {source} holds {count} sample: give at least 2 samples")
    centred = samples.reshape(count, -1) - samples.reshape(count, -1).mean(0)
    if count >= unknowns:
        # Only the eigenvalues are needed: the singular values of the centred samples, not an n×n covariance.
        eigenvalues = np.linalg.svd(centred, compute_uv=False) ** 2 / (count - 1)
        eigenvalues = np.concatenate([eigenvalues, np.zeros(unknowns - eigenvalues.size)])
        return Reference(np.sort(eigenvalues)[::-1], f"--data: {count:,} samples from {Path(source).name}")
    image = len(shape) == 3
    fallback = photo_eigenvalues(*shape) if image else white_eigenvalues(unknowns)
    if unknowns > LARGEST_EIGENDECOMPOSITION:
        # Shrinking would need an n×n eigendecomposition: the reference it would shrink toward is used, and said.
        name = PHOTO_SPECTRUM if image else WHITE
        return Reference(
            fallback,
            f"{name}; --data's {count:,} samples are too few for {unknowns:,} unknowns (give at least that many "
            "to use them)",
        )
    weight = (unknowns - count) / unknowns
    total = float((centred**2).sum() / (count - 1))
    covariance = (1 - weight) * (centred.T @ centred) / (count - 1)
    if image:
        basis = _photo_basis(*shape)
        covariance += weight * total / fallback.sum() * (basis * _photo_modes(*shape)) @ basis.T
    else:
        covariance += weight * total / unknowns * np.eye(unknowns)
    eigenvalues = np.clip(np.linalg.eigvalsh(covariance), 0.0, None)[::-1]
    reference = "the shipped photograph spectrum" if image else "white data"
    return Reference(
        eigenvalues,
        f"--data: {count:,} samples from {Path(source).name}, fewer than the {unknowns:,} unknowns: shrunk "
        f"toward {reference} (weight {weight:.2f})",
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
        from rankaudit.bound.images import _IMAGE_SUFFIXES, DataError, load_images

        if path.is_dir():
            available = sum(1 for p in path.iterdir() if p.suffix.lower() in _IMAGE_SUFFIXES and p.is_file())
        elif path.suffix.lower() == ".npy" and path.exists():
            available = _npy_rows(path)
        else:
            available = 1
        try:
            return load_images(source, tuple(shape), max(available, 1))[0].double().numpy()
        except DataError as exc:
            raise ReferenceDataError(f"--data: {exc}") from exc
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


def _npy_rows(path: Path) -> int:
    try:
        return int(np.load(path, mmap_mode="r", allow_pickle=False).shape[0])
    except Exception:
        return 1  # load_images names the problem


def reference_for(shape: tuple[int, ...] | None, unknowns: int, data: str | None = None) -> Reference:
    """Spec §15's order: the user's samples; the shipped photograph spectrum for C×H×W; else white data."""
    if data is not None and shape is not None:
        return data_reference(data, shape)
    if shape is not None and len(shape) == 3 and min(shape) >= 1:
        return Reference(photo_eigenvalues(*shape), PHOTO_SPECTRUM)
    return Reference(white_eigenvalues(unknowns), WHITE)


def hidden_share(eigenvalues: np.ndarray, rank: int, copies: int = 1) -> float | None:
    """Σ_{k>R} λ_k / Σ λ_k over the sorted eigenvalues, each repeated `copies` times (independent samples): the
    least share of a typical sample's energy outside every subspace of dimension R (Ky Fan). None when not finite."""
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


def largest_protected_rank(eigenvalues: np.ndarray, protected_share: float) -> int:
    """The largest R at which h_cert still reaches `protected_share`: what `protected` asks of R_s."""
    tails = np.cumsum(eigenvalues[::-1])[::-1] / eigenvalues.sum()  # tails[R] = Σ_{k>=R} λ_k / Σ λ (0-based)
    meeting = np.nonzero(tails >= protected_share - 1e-12)[0]
    return int(meeting[-1]) if meeting.size else 0


def sample_reference(inputs, unknowns: int, data: str | None = None) -> Reference | None:
    """The reference distribution of one sample of a model with these inputs (spec §15's order), at `unknowns`
    eigenvalues; None for token inputs (they keep the rank level and their own finding). Several data inputs take
    their unknowns together, white."""
    carrying = [spec for spec in inputs if spec.carries_unknowns]
    if not carrying or any(spec.role != "data" for spec in carrying):
        return None
    shape = tuple(carrying[0].shape) if len(carrying) == 1 else None
    reference = reference_for(shape, unknowns, data)
    if reference.eigenvalues.size != unknowns:
        reference = Reference(white_eigenvalues(unknowns), WHITE)
    return reference


def largest_protected_share_rank(eigenvalues: np.ndarray, protected_share: float) -> float:
    """The largest rank per sample r (fractional: R over `copies` samples) at which the hidden share still reaches
    `protected_share`. hidden_share at R over c copies is the tail interpolated linearly at R/c, so a batch or round
    of c samples is protected exactly when R <= c·r."""
    total = float(eigenvalues.sum())
    whole = largest_protected_rank(eigenvalues, protected_share)
    if whole >= eigenvalues.size or total <= 0:
        return float(eigenvalues.size)
    spare = (1 - protected_share) * total - float(eigenvalues[:whole].sum())  # visible energy left to spend
    if eigenvalues[whole] <= 0:
        return float(eigenvalues.size)
    return whole + min(max(spare / float(eigenvalues[whole]), 0.0), 1.0)


@dataclass
class EnergyScale:
    """One traced model's sample reference with the thresholds in force: the level of any rank bound on it, as
    `check` reads it (spec §15), for the design review's edits, withheld sets and rounds. Without a reference
    (token inputs) the level stays spec §11's, on directions."""

    reference: Reference | None
    unknowns: int  # |x|
    max_recoverable: float = DEFAULT_MAX_RECOVERABLE
    exposed_below: float = DEFAULT_EXPOSED_BELOW

    @classmethod
    def of(cls, inputs, unknowns: int, data=None, max_recoverable=None, exposed_below=None) -> EnergyScale:
        return cls(
            sample_reference(inputs, unknowns, data),
            unknowns,
            DEFAULT_MAX_RECOVERABLE if max_recoverable is None else max_recoverable,
            DEFAULT_EXPOSED_BELOW if exposed_below is None else exposed_below,
        )

    def level(self, rank_bound: int, copies: int = 1) -> str:
        """The level of a rank bound over `copies` independent samples (1: one sample's R_s)."""
        if self.reference is None:
            return verdict_level(rank_bound, self.unknowns * copies, self.max_recoverable)
        hidden = hidden_share(self.reference.eigenvalues, rank_bound, copies)
        if hidden is None:
            return "exposed"  # no finite figure certifies anything: assume the worst
        return energy_level(hidden, self.max_recoverable, self.exposed_below)

    def protected_rank(self) -> float:
        """The largest rank per sample that is still protected (fractional, for R over several samples)."""
        if self.reference is None:
            return self.max_recoverable * self.unknowns
        return largest_protected_share_rank(self.reference.eigenvalues, 1 - self.max_recoverable)


def certify(bound, inputs, data: str | None = None, exposed_below: float | None = None):
    """Spec §15 into `bound` (an Identifiability with its SampleBound): the certified hidden share and the PSNR
    ceiling per sample (R_s over |x|) and for the batch or round line (R over N·|x|, each λ once per sample), the
    distribution's name, and the sample level on energy. Token inputs keep the rank level and their own finding.
    Returns the Reference used (None for token inputs)."""
    sample = bound.sample
    reference = sample_reference(inputs, sample.unknowns, data)
    if reference is None:
        return None
    eigenvalues = reference.eigenvalues
    sample.certified_hidden_energy = hidden_share(eigenvalues, sample.rank_bound)
    sample.visible_psnr_ceiling = psnr_ceiling(eigenvalues, sample.rank_bound, reference.peak)
    copies = max(bound.unknowns // sample.unknowns, 1) if sample.unknowns else 1
    bound.certified_hidden_energy = hidden_share(eigenvalues, bound.rank_bound, copies)
    bound.spectrum = reference.name
    threshold = DEFAULT_EXPOSED_BELOW if exposed_below is None else exposed_below
    scale = EnergyScale(reference, sample.unknowns, bound.max_recoverable, threshold)
    sample.level = scale.level(sample.rank_bound)
    if bound.certified_hidden_energy is not None:  # the batch or round line, read on the same scale (context)
        bound.verdict = scale.level(bound.rank_bound, copies)
    bound.protected_rank = largest_protected_rank(eigenvalues, 1 - bound.max_recoverable)
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
