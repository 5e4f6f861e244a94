"""The per-sample certificate read from real samples: an order statistic of their hidden shares under the worst
visible subspace the method can name (docs/method.md, "The certificate, read from samples")."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

# The order statistic sits at or below the true quantile with this probability (a 95 % lower confidence bound).
SAMPLE_CONFIDENCE = 0.95


def order_statistic(count: int, below: float, confidence: float = SAMPLE_CONFIDENCE) -> int:
    """The largest k whose k-th smallest of `count` independent samples lies at or below the true `below`-quantile
    with probability `confidence`: P(Binomial(count, below) < k) <= 1 − confidence. 0: none does (too few samples)."""
    if count <= 0 or below <= 0:
        return 0
    if below >= 1:
        return count
    log_below, log_above = math.log(below), math.log1p(-below)
    cumulative, k = 0.0, 0
    while k < count:
        term = math.exp(
            math.lgamma(count + 1)
            - math.lgamma(k + 1)
            - math.lgamma(count - k + 1)
            + k * log_below
            + (count - k) * log_above
        )
        if cumulative + term > 1 - confidence:
            return k
        cumulative += term
        k += 1
    return count


def samples_needed(below: float, confidence: float = SAMPLE_CONFIDENCE) -> int:
    """The fewest samples whose smallest share already bounds the `below`-quantile with `confidence`: 29 for the
    10 % quantile at 95 %."""
    if below <= 0:
        return 0
    if below >= 1:
        return 1
    return max(math.ceil(math.log(1 - confidence) / math.log1p(-below) - 1e-12), 1)


def _principal_coordinates(rows: np.ndarray) -> np.ndarray:
    """The rows' coordinates in their own principal basis (columns by descending variance): n × min(n, d), from the
    smaller of the two Gram matrices, so a 3×224×224 input never builds a d × d one."""
    count, size = rows.shape
    if count <= size:
        values, vectors = np.linalg.eigh(rows @ rows.T)
        order = np.argsort(values)[::-1]
        return vectors[:, order] * np.sqrt(np.clip(values[order], 0.0, None))
    values, vectors = np.linalg.eigh(rows.T @ rows)
    return rows @ vectors[:, np.argsort(values)[::-1]]


@dataclass
class SampleShares:
    """Real samples' deviations from their mean, read in each candidate visible subspace: for candidate c and rank R,
    the visible energy of sample i is cumulative[c][i, R − 1] (the first R directions of that candidate's basis)."""

    energies: np.ndarray  # ‖x_i − μ‖² per sample
    cumulative: list[np.ndarray]  # per candidate: n × m cumulative visible energy; a basis spans every deviation
    candidates: list[str]  # what each candidate subspace is, in the report's words

    @classmethod
    def of(cls, samples: np.ndarray, mean: np.ndarray | None = None) -> SampleShares:
        """Candidates: the top principal directions of the deviations from `mean` (default: the samples' own; the
        subspace that shows most energy) and of the deviations scaled to unit length (the one that shows the
        largest share, summed over the samples)."""
        flat = samples.reshape(samples.shape[0], -1).astype(np.float64)
        deviations = flat - (flat.mean(0) if mean is None else np.asarray(mean, dtype=np.float64).reshape(1, -1))
        energies = np.einsum("ij,ij->i", deviations, deviations)
        norms = np.sqrt(energies)
        scaled = deviations / np.where(norms > 0, norms, 1.0)[:, None]
        # Coordinates in the scaled rows' basis, scaled back: x_i − μ = ‖x_i − μ‖ · (its unit row).
        candidates = [_principal_coordinates(deviations), _principal_coordinates(scaled) * norms[:, None]]
        cumulative = [np.cumsum(coordinates**2, axis=1) for coordinates in candidates]
        names = ["the top principal directions of their deviations", "those of their deviations scaled to one length"]
        return cls(energies, cumulative, names)

    @property
    def count(self) -> int:
        return int(self.energies.size)

    def hidden_energies(self, rank: int) -> list[np.ndarray]:
        """Per candidate: each sample's deviation energy outside the candidate's first `rank` directions."""
        rank = max(int(rank), 0)
        found = []
        for cumulative in self.cumulative:
            if rank == 0:
                found.append(self.energies.copy())
            elif rank >= cumulative.shape[1]:
                found.append(np.zeros(self.count))  # the basis spans every deviation: all of it can be shown
            else:
                found.append(np.clip(self.energies - cumulative[:, rank - 1], 0.0, None))
        return found

    def hidden_shares(self, rank: int) -> list[np.ndarray]:
        """Per candidate: each sample's hidden share; a sample equal to the mean counts as hiding nothing."""
        safe = np.where(self.energies > 0, self.energies, 1.0)
        return [
            np.where(self.energies > 0, np.clip(hidden / safe, 0.0, 1.0), 0.0) for hidden in self.hidden_energies(rank)
        ]

    def certificate(self, rank: int, quantile: float, confidence: float = SAMPLE_CONFIDENCE) -> tuple[float, float]:
        """(h, e): the k-th smallest hidden share and hidden energy over the samples, for the worst candidate, with k
        the order statistic that bounds the (1 − quantile)-quantile from below with `confidence`; (0, 0) when the
        samples are too few for any k."""
        k = order_statistic(self.count, 1 - quantile, confidence)
        if k == 0:
            return 0.0, 0.0
        share = min(float(np.partition(shares, k - 1)[k - 1]) for shares in self.hidden_shares(rank))
        energy = min(float(np.partition(hidden, k - 1)[k - 1]) for hidden in self.hidden_energies(rank))
        return share, energy

    def order(self, quantile: float, confidence: float = SAMPLE_CONFIDENCE) -> int:
        return order_statistic(self.count, 1 - quantile, confidence)


def ordinal(number: int) -> str:
    """1st, 2nd, 3rd, 11th, 22nd."""
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number:,}{suffix}"


def certificate_words(shares: SampleShares, quantile: float, confidence: float = SAMPLE_CONFIDENCE) -> str:
    """How the figure was read, for the reference's name: which order statistic of how many samples, and what it
    bounds; or, with too few samples, how many a figure needs."""
    k = shares.order(quantile, confidence)
    below = 1 - quantile
    if k == 0:
        return (
            f"{shares.count:,} samples are too few to certify the {100 * below:.3g} % quantile at "
            f"{100 * confidence:.3g} % confidence: nothing is certified (give at least "
            f"{samples_needed(below, confidence):,})"
        )
    return (
        f"h is the {ordinal(k)} smallest of their {shares.count:,} hidden shares under the worst of "
        f"{len(shares.candidates)} subspaces ({' and '.join(shares.candidates)}): a {100 * confidence:.3g} % lower "
        f"confidence bound on the {100 * below:.3g} % quantile"
    )


# ---- without --data: the photographs' per-sample reference shipped with the package ---------------------------------

PHOTO_SHARES_FILE = Path(__file__).with_name("data") / "photo_shares.json"
PHOTO_REFERENCE = "photographs' per-sample reference shipped with rankaudit"


@lru_cache(maxsize=1)
def _photo_tables() -> dict:
    return json.loads(PHOTO_SHARES_FILE.read_text())


@dataclass
class PhotoShares:
    """The shipped table of photograph crops' hidden shares at one fitted size (benchmarks/make_photo_shares.py): at
    each rank of `ranks`, the share (and the hidden energy per pixel) that at least `quantile` of crops keep outside
    any subspace of that dimension, measured on the worst candidate subspace with a margin for other photographs."""

    channels: int
    size: int
    ranks: list[int]
    shares: list[float]
    energies: list[float]  # per pixel
    quantile: float

    def certificate(self, rank: int, quantile: float) -> tuple[float, float]:
        """(h, hidden energy per pixel) at `rank`: read at the smallest tabulated rank at or above it (a larger
        subspace shows more, so that reading is lower); (0, 0) beyond the table, and for a quantile above the one
        the table was fitted at (it says nothing of more samples)."""
        rank = max(int(rank), 0)
        if quantile > self.quantile + 1e-9:
            return 0.0, 0.0
        if rank == 0:
            return 1.0, self.energies[0]  # the energy at one direction: under the whole of it, so conservative
        for position, tabulated in enumerate(self.ranks):
            if tabulated >= rank:
                return self.shares[position], self.energies[position]
        return 0.0, 0.0

    def words(self, quantile: float) -> str:
        if quantile > self.quantile + 1e-9:
            return (
                f"it speaks for {100 * self.quantile:.3g} % of photographs, not {100 * quantile:.3g} %: nothing is "
                "certified; give --data (a few hundred samples like yours) for a figure"
            )
        return (
            f"read off crops of photographs at {self.size}x{self.size} px at the same rank (a larger picture keeps "
            f"more detail outside as many directions), fitted at the {100 * self.quantile:.3g} % quantile with a "
            "margin for photographs unlike them; the expected share from the natural-photograph spectrum shipped "
            "beside it; --data gives a figure for samples like yours"
        )


def photo_shares_for(shape: tuple[int, ...]) -> PhotoShares | None:
    """The table for a C×H×W input: its channel count (1 or 3), the largest fitted size that fits inside H×W; None
    where there is none (other channel counts, or inputs under the smallest size): no reference is trustworthy."""
    if len(shape) != 3:
        return None
    channels, height, width = (int(s) for s in shape)
    model = _photo_tables()
    fitting = [
        table for table in model["tables"] if table["channels"] == channels and table["size"] <= min(height, width)
    ]
    if not fitting:
        return None
    table = max(fitting, key=lambda t: t["size"])
    return PhotoShares(
        channels,
        table["size"],
        list(table["ranks"]),
        list(table["hidden_share"]),
        list(table["hidden_energy_per_pixel"]),
        float(model["quantile"]),
    )
