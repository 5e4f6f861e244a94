"""--verify rank when the matrix-free check stopped before the exact answer (its time budget, or its basis about to
outgrow the device's memory): what it did measure, as bounds (docs/method.md, "The numerical check").

Each sample's reading is a lower bound on rank(J_i) and an upper bound on the share of its detail (its deviation
from its mean) that J_i cannot see; a sample that finished has its exact rank and its hidden share at the
tolerance, which bounds the exact-arithmetic share from above too. A lower bound above the static upper bound is
still a contradiction, and an internal error, as for an exact rank.
"""

from __future__ import annotations

import torch

from rankaudit.verify.rank.gram import invisible_part
from rankaudit.verify.rank.hidden import centred
from rankaudit.verify.rank.krylov import KrylovReading
from rankaudit.verify.rank.measurement import bound_check

STOPPED = {
    "budget": "its time budget was spent",
    "memory": "its basis would outgrow the device's memory",
}


def hidden_at_most(reading: KrylovReading, image: torch.Tensor, centre=None) -> float | None:
    """The sample's hidden share from above: measured on the visible subspace when the reading is exact, else the
    Krylov bound; None for a sample equal to its own mean."""
    if not reading.exact or reading.visible is None:
        return reading.hidden_share_at_most
    energy = float(centred(image.detach().double(), centre).square().sum())
    if energy == 0:
        return None
    return float(invisible_part(reading, image, centre).square().sum()) / energy


def partial_verification(
    result, readings: list[tuple[KrylovReading, float | None]], *, budget, device: str, notes: list[str]
) -> dict:
    """verification["rank"] for matrix-free readings of which at least one stopped early: ``readings`` pairs each
    sample's reading with its hidden share from above (hidden_at_most)."""
    unknowns = readings[0][0].unknowns
    headline = max(reading.rank_at_least for reading, _ in readings)
    shares = [share for _, share in readings if share is not None]
    worst = max(shares) if shares else None  # the sample that shows least: the one its hidden share bounds worst
    stopped = sorted({reading.stopped for reading, _ in readings if not reading.exact})
    why = "; ".join(STOPPED.get(reason, reason) for reason in stopped)
    bound = bound_check(result.identifiability, headline)
    shown = (
        ""
        if worst is None
        else f"; at these weights a server sees at least {100 * (1 - worst):.3g} % of each sample's detail"
    )
    agreement = f"inconclusive, not the exact rank{shown}"
    judgement = f"Inconclusive: stopped before the exact rank ({why}), rank at least {headline} of {unknowns}{shown}"
    return {
        "exact": False,
        "unknowns": unknowns,
        "rank_at_least": headline,
        "hidden_share_at_most": worst,
        "stopped": stopped,
        "stopped_because": why,
        "budget_seconds": budget,
        "seconds": round(sum(reading.seconds for reading, _ in readings), 3),
        "device": device,
        "method": "matrix-free (J and Jᵀ products)",
        "batch_size": 1,
        "samples": [
            {
                "index": index,
                "exact": reading.exact,
                "rank_at_least": reading.rank_at_least,
                "hidden_share_at_most": share,
                "directions": reading.basis,
                "products": reading.products,
                "stopped": reading.stopped,
                "seconds": round(reading.seconds, 3),
            }
            for index, (reading, share) in enumerate(readings)
        ],
        "confirms": None,
        "agreement": agreement,
        "judgement": judgement,
        "verdict": result.verdict,
        "bound": bound,
        "internal_error": bound.get("internal_error") if bound else None,
        "notes": notes,
    }
