"""What each sample's clipped-gradient Jacobian J_i cannot see, for the Fisher line's attacker with a prior.

The attacker who is unbiased on the directions J_i sees and fills the rest with the reference mean μ needs two
readings of J_i beyond its Frobenius norm: its rank r and hidden_i = ‖P_null(J_i)(x_i − μ)‖². Both come from the
rank check's matrix-free reading (rankaudit.verify.rank.krylov: block Lanczos on JᵀJ, started from x_i − μ), run
on the clipped gradient's own Jacobian, which the noise is added to. An exact reading gives r, the visible basis
and tr(JᵀJ) = ‖J‖_F² exactly; a reading stopped by its time budget or memory gives a lower bound on r and nothing
certain about the hidden part, which then counts as zero (both lower the error floor: the ceiling stays an upper
bound). docs/method.md, "What a prior fills in".
"""

from __future__ import annotations

import time

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.verify.jacobian_products import ClippedGradientProducts
from rankaudit.verify.rank.budget import memory_budget
from rankaudit.verify.rank.krylov import krylov_rank

# Samples the reference mean μ is taken over (the user's --data, else the shipped photographs' crops, else the
# seeded inputs): the mean of what the attacker is assumed to know the distribution of.
REFERENCE_SAMPLES = 128


def reference_mean(shape: tuple[int, ...], data: str | None, seed: int) -> tuple[torch.Tensor, str]:
    """μ over REFERENCE_SAMPLES samples like the user's (fewer where --data holds fewer), and what it was taken on."""
    from rankaudit.verify.inputs import images_to_attack, inputs_of_shape

    count = images_to_attack(data, REFERENCE_SAMPLES)
    samples, source = inputs_of_shape(shape, data, count, seed)
    return samples.mean(0), source


def read_visible(
    products: ClippedGradientProducts,
    x: torch.Tensor,
    mean: torch.Tensor,
    *,
    seed: int = 0,
    budget_seconds: float | None = None,
) -> dict:
    """{rank, rank_exact, hidden, trace, stopped, directions, seconds} of one sample's J: `rank` is rank(J) (from
    below where not exact), `hidden` ‖P_null(J)(x − μ)‖² (0 where not exact: nothing is certain of it), `trace`
    tr(JᵀJ) from the exact reading (None otherwise)."""
    deviation = (x - mean.to(x.device, x.dtype)).reshape(-1)

    def gram(block: torch.Tensor) -> torch.Tensor:
        return products.vjp(x, products.jvp(x, block))

    reading = krylov_rank(
        gram,
        deviation,
        seed=seed,
        budget_seconds=budget_seconds,
        memory_bytes=memory_budget(x.device)[0] // 2,
    )
    hidden, trace = 0.0, None
    if reading.exact:
        visible = reading.visible
        invisible = deviation - visible.T @ (visible @ deviation) if visible.shape[0] else deviation
        hidden = float(invisible.square().sum())
        trace = float((reading.singular_values**2).sum())
    return {
        "rank": reading.rank_at_least,
        "rank_exact": reading.exact,
        "hidden": hidden,
        "trace": trace,
        "stopped": reading.stopped,
        "directions": reading.basis,
        "seconds": reading.seconds,
    }


def read_dense(jacobian: torch.Tensor, x: torch.Tensor, mean: torch.Tensor) -> dict:
    """read_visible's record from the dense J (|θ| x d), by the dense rank check's rule: singular values above
    σ_max · max(|θ|, d) · ε count (rankaudit.verify.rank.spectrum)."""
    started = time.perf_counter()
    deviation = (x - mean.to(x.device, x.dtype)).reshape(-1)
    _, values, right = torch.linalg.svd(jacobian, full_matrices=False)
    top = float(values[0]) if values.numel() else 0.0
    rank = int((values > top * max(jacobian.shape) * torch.finfo(jacobian.dtype).eps).sum()) if top > 0 else 0
    seen = right[:rank]
    invisible = deviation - seen.T @ (seen @ deviation)
    return {
        "rank": rank,
        "rank_exact": True,
        "hidden": float(invisible.square().sum()),
        "trace": float(values.square().sum()),
        "stopped": "dense",
        "directions": x.numel(),
        "seconds": time.perf_counter() - started,
    }


def nothing_seen(x: torch.Tensor, mean: torch.Tensor) -> dict:
    """read_visible's record for a J that is zero: rank 0, everything hidden."""
    deviation = (x - mean.to(x.device, x.dtype)).reshape(-1)
    return {
        "rank": 0,
        "rank_exact": True,
        "hidden": float(deviation.square().sum()),
        "trace": 0.0,
        "stopped": "zero",
        "directions": 0,
        "seconds": 0.0,
    }


def refuse_batch_statistics(model: nn.Module, bn_mode: str, batch_size: int, what: str) -> None:
    """DP-SGD clips each sample's own gradient; BatchNorm in training mode over a batch of several samples makes
    each sample's gradient depend on the others', so there is no per-sample gradient to clip and noise (Opacus
    refuses such models for the same reason). One line with the fix, exit 2."""
    if bn_mode != "train" or batch_size <= 1:
        return
    norms = [name for name, module in model.named_modules() if isinstance(module, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    raise UsageError(
        f"{what}: with BatchNorm in training mode ({', '.join(norms[:3])}{', …' if len(norms) > 3 else ''}) each "
        f"sample's gradient depends on the other {batch_size - 1} in its batch, so DP-SGD's per-sample clipping "
        "and noise are not defined for this model",
        "replace BatchNorm with GroupNorm or LayerNorm, as DP training needs, or give --bn-mode eval if the client "
        "trains with BatchNorm on its running statistics",
    )


def prior_notes(measured: list[dict], reference: str, rank_seconds: float | None) -> list[str]:
    """What the line of the attacker with a prior rests on: the reference mean, and any reading that stopped."""
    if not measured or "rank" not in measured[0]:
        return []
    notes = [f"the attacker with a prior fills what the update cannot see with the mean of {reference}"]
    stopped = [number for number, one in enumerate(measured) if not one["rank_exact"]]
    if stopped:
        limit = f"{rank_seconds:g} s" if rank_seconds is not None else "the memory it may use"
        notes.append(
            f"the rank check of sample(s) {', '.join(map(str, stopped))} stopped at {limit} before the exact "
            "rank: their line with a prior reads the rank from below and counts nothing as hidden, a ceiling "
            "higher than the exact one"
        )
    return notes
