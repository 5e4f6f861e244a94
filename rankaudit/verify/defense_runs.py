"""--defense: what a defendable verifier's runs without and with each defense share (the thresholds, the gradient's scale)."""

from __future__ import annotations

import math

# An input attack is degraded when its median MSE at least doubles and leaves the near-perfect zone; it fails when
# the MSE passes the threshold the verifier reads as a poor reconstruction.
DEGRADED_MSE_FACTOR = 2.0
# A label attack is degraded when it loses at least this share of the batch's labels (and at least one label).
DEGRADED_INS_ACC_DROP = 0.05
WARMUP_SEED_OFFSET = 104_729


def rms(tensors) -> float:
    tensors = list(tensors)
    total = sum(float(t.double().pow(2).sum()) for t in tensors)
    count = sum(t.numel() for t in tensors)
    return math.sqrt(total / count) if count else 0.0


def strength_note(defense, rms: float, what: str) -> str | None:
    """Puts σ in the gradient's own units: absolute noise means nothing without the scale it is added to."""
    if defense.name != "noise" or rms <= 0:
        return None
    return f"σ = {defense.param:g} is {defense.param / rms:.3g}× the RMS of {what} ({rms:.3g})"
