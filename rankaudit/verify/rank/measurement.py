"""The record of one --verify rank measurement, and its readings: against the verdict, the static bound, as images."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RankMeasurement:
    """One sketch: the rank of ∂g/∂x at one input (a batch of B samples counts as one input of B·|x| values)."""

    unknowns: int  # n = B·|x|
    rank: int
    deficit: int  # n - rank: input directions the shared gradient cannot see
    tolerance: float  # singular values of S at or below this are dropped
    gap: float | None  # σ_last_kept / σ_first_dropped; at full rank σ_min / tolerance; None at rank 0
    reliable: bool  # gap >= RELIABLE_GAP
    sigma_max: float
    sigma_min_kept: float | None
    singular_values: np.ndarray | None  # of S, descending, when a full SVD ran (not when QR showed full rank)
    spectrum: str  # how: svd | qr+inverse-iteration
    seconds: float  # sketch and SVD
    sketch_seconds: float
    spectrum_seconds: float
    device: str
    method: str  # forward-over-reverse | reverse-over-reverse
    loss: str
    sketch_rows: int
    chunk_rows: int
    shared_gradient_size: int  # m: entries of the shared gradient g
    shared_parameters: list[str] = field(default_factory=list)
    # Right singular vectors of the smallest dropped singular values, shaped like the input batch (up to
    # `directions` of them, smallest first), with their singular values; empty at full rank.
    directions: np.ndarray | None = None
    direction_singular_values: list[float] = field(default_factory=list)
    # With hidden=True: P c, the batch with each sample's mean removed, projected onto the whole measured
    # invisible subspace (all n - rank dropped directions), shaped like the batch; zeros at full rank.
    invisible: np.ndarray | None = None
    precision: str = "float64"  # the sketch whose spectrum gave the rank: float32 (accepted) | float64
    precision_note: str = ""  # why that precision
    # method.md: each sample: rank(J_i) of each sample of the batch from its column block of the same sketch (R·J_i), in order.
    sample_ranks: list[int] = field(default_factory=list)


def judge(verdict: str, rank: int, unknowns: int) -> tuple[bool | None, str, str]:
    """(confirms, agreement, judgement): full rank agrees with `exposed`, a deficit with `partial` and `protected`
    (method.md: verdicts; how much a deficit hides is the hidden-energy measurement's business); `boundary` has nothing to
    agree with (confirms None). `agreement` is the short form the table prints."""
    deficit = unknowns - rank
    measured = (
        "one gradient determines the input"
        if deficit == 0
        else f"{deficit} input directions are invisible to the gradient"
    )
    detail = (
        f"the gradient's Jacobian has full rank {rank} of {unknowns}: {measured}"
        if deficit == 0
        else f"the gradient's Jacobian has rank {rank} of {unknowns}: {measured}"
    )
    if verdict == "exposed" and deficit:
        # The levels read energy: `exposed` says that too little of each sample's detail is certified hidden,
        # which a deficit of directions does not contradict. What the invisible directions hold is the energy
        # line's judgement (rankaudit.verify.rank.energy.read_energy), which settles `confirms`.
        return (
            None,
            f"consistent with exposed ({measured}; the energy line judges what they hide)",
            f"consistent with exposed: {detail}; exposed reads how much of a sample's energy is certified hidden, "
            "which the energy line measures",
        )
    if verdict in ("exposed", "partial", "protected"):
        confirms = (deficit == 0) == (verdict == "exposed")
        if confirms:
            return True, f"confirms {verdict} ({measured})", f"confirms {verdict}: {detail}"
        return False, f"disagrees with {verdict} ({measured})", f"disagrees: the analysis says {verdict}, but {detail}"
    return (
        None,
        f"no verdict to compare with ({measured})",
        f"no verdict to compare with ({verdict or 'none'}): {detail}",
    )


def bound_check(identifiability, rank: int) -> dict | None:
    """The measured rank against the static upper bound of method.md: the bound; a rank above it means the bound is wrong."""
    if identifiability is None:
        return None
    bound = int(identifiability.rank_bound)
    consistent = rank <= bound
    check = {"rank_bound": bound, "certified_deficit": int(identifiability.certified_deficit), "consistent": consistent}
    if not consistent:
        check["internal_error"] = (
            f"internal error: the measured rank {rank} exceeds the static upper bound {bound}: the static "
            "bound is wrong for this model; please report it with this model file"
        )
    return check


def save_directions(directory, measurement: RankMeasurement) -> list[dict]:
    """The invisible input directions as .npy (raw, unit norm) and PNG (scaled to ±max|v| around mid-grey)."""
    from pathlib import Path

    if measurement.directions is None:
        return []
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    saved = []
    for index, (direction, value) in enumerate(zip(measurement.directions, measurement.direction_singular_values)):
        npy = directory / f"invisible_direction_{index}.npy"
        np.save(npy, direction)
        png = _save_direction_png(directory / f"invisible_direction_{index}.png", direction)
        saved.append({"index": index, "singular_value": value, "npy": str(npy), "png": png})
    return saved


def _save_direction_png(target, direction: np.ndarray) -> str | None:
    """One PNG per direction, the batch's samples side by side; None for inputs that are not images."""
    from PIL import Image

    if direction.ndim != 4 or direction.shape[1] not in (1, 3):
        return None
    peak = float(np.abs(direction).max()) or 1.0
    # Signed values around grey: the direction's sign is arbitrary, its pattern is the point.
    scaled = np.clip(0.5 + 0.5 * direction / peak, 0.0, 1.0)
    tiles = [np.transpose(sample, (1, 2, 0)) for sample in scaled]
    separator = np.ones((tiles[0].shape[0], 1, tiles[0].shape[2]))
    strip = np.concatenate([piece for tile in tiles for piece in (tile, separator)][:-1], axis=1)
    pixels = (strip * 255.0 + 0.5).astype(np.uint8)
    Image.fromarray(pixels[:, :, 0] if pixels.shape[2] == 1 else pixels).save(target)
    return str(target)
