"""--defense: what a defendable verifier's runs without and with each defense share: settings, thresholds, scale."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rankaudit.verify.registry import VerifyContext

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


@dataclass(frozen=True)
class AttackSettings:
    """What an attack's undefended run and every defended run take from the request, the device resolved: R-GAP
    reads samples, data, steps and restarts, GDBR trials, class_dist and aux."""

    seed: int
    device: str
    show_progress: bool
    samples: int
    data: str | None
    steps: int
    restarts: int
    trials: int
    class_dist: str
    aux: str | None

    @classmethod
    def of(cls, context: VerifyContext) -> AttackSettings:
        from rankaudit.verify.model import resolve_device

        return cls(
            seed=context.seed,
            device=resolve_device(context.device),
            show_progress=context.show_progress,
            samples=context.samples,
            data=context.data,
            steps=context.steps,
            restarts=context.restarts,
            trials=context.trials,
            class_dist=context.class_dist,
            aux=context.aux,
        )


def defended_rows(context: VerifyContext, first_run: Callable, rows: Callable, defenses: list, **options) -> list[dict]:
    """A verifier's `defended`: its undefended run (`first_run`), then `rows` of the runs against each defense on
    the same inputs, both with the request's settings."""
    settings = AttackSettings.of(context)
    run = first_run(context.result, context.spec, settings, title=" without defense")
    return rows(context.result, run, defenses, settings, **options)
