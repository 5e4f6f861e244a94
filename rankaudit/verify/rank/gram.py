"""Products with the rank check's Gram matrix A = JᵀJ (J = ∂g/∂x) for a block of input directions, and the
matrix-free rank check of one sample that runs block Lanczos (rankaudit.verify.rank.krylov) on them.

J V (one row per direction, in parameter space) is the directional derivative of the parameter gradient along
each input direction (forward over reverse); Jᵀ U is the sketch's own row product (rankaudit.verify.rank.sketch:
the input gradient's derivative along each parameter direction). Both are vmapped over the block, so a block
costs about what as many rows of the dense sketch cost, and nothing of size |θ| × d is ever formed.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.verify.client import client_mode, logits_of, loss_name_for, mean_loss
from rankaudit.verify.rank.budget import memory_budget
from rankaudit.verify.rank.hidden import centred
from rankaudit.verify.rank.krylov import BLOCK, KrylovReading, krylov_rank
from rankaudit.verify.rank.measurement import RankMeasurement
from rankaudit.verify.rank.sketch import _ForwardOverReverse, _math_attention, shared_names
from rankaudit.verify.rank.spectrum import RELIABLE_GAP
from rankaudit.verify.substitute import differentiable_ops


class GramProducts:
    """A V = Jᵀ (J V) for the gradient of ``net``'s mean loss on ``x`` with respect to the parameters ``names``."""

    def __init__(self, net: nn.Module, x: torch.Tensor, labels: torch.Tensor, loss: str, names: list[str]):
        from torch.func import functional_call, grad, jvp, vmap

        parameters = {name: p.detach() for name, p in net.named_parameters()}
        buffers = {name: b.detach() for name, b in net.named_buffers()}
        shared = {name: parameters[name] for name in names}
        fixed = {name: p for name, p in parameters.items() if name not in shared}
        self.names = names
        self.x = x

        def loss_of(shared_values, inputs):
            logits = functional_call(net, ({**fixed, **shared_values}, buffers), (inputs,))
            return mean_loss(logits, labels, loss)

        parameter_gradient = grad(loss_of, argnums=0)

        def forward(direction):  # J v: how the shared gradient moves along the input direction v
            return jvp(lambda inputs: parameter_gradient(shared, inputs), (x,), (direction,))[1]

        self._forward = vmap(forward)
        self._transpose = _ForwardOverReverse(net, x, labels, loss, names)

    def __call__(self, block: torch.Tensor) -> torch.Tensor:
        """A V for the rows of ``block`` (k × d): k × d."""
        # Only the products run under the checks' op substitutions: the basis's own linear algebra outside them
        # runs at full speed.
        with torch.no_grad(), _math_attention(), differentiable_ops():
            moved = self._forward(block.reshape(len(block), *self.x.shape))
            back = self._transpose([moved[name] for name in self.names])
        return back.reshape(len(block), -1)


def measure_matrix_free(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    shared: Iterable[str] | None = None,
    *,
    device: str | torch.device = "cpu",
    seed: int = 0,
    loss: str | None = None,
    budget_seconds: float | None = None,
    hidden_below: float | None = None,
    block: int = BLOCK,
    progress: Callable[[int, int], None] | None = None,
    bn_mode: str = "eval",
    dtype: torch.dtype = torch.float64,
    memory_bytes: int | None = None,
    centre=None,
) -> KrylovReading:
    """rank(∂g/∂x) from below and the hidden share of ``images``' deviation from above, for one batch (usually
    one sample), without the dense sketch. Stops when exact, past ``budget_seconds``, once the hidden share is
    shown below ``hidden_below``, or before the basis outgrows ``memory_bytes`` (default: half of what the rank
    check may use on the device)."""
    device = torch.device(device)
    if labels.shape[0] != images.shape[0]:
        raise UsageError(f"{images.shape[0]} images but {labels.shape[0]} labels", "give one label per image")
    net = client_mode(copy.deepcopy(model).to(device=device, dtype=dtype), bn_mode)
    x = images.detach().to(device=device, dtype=dtype)
    labels = labels.to(device)
    if loss is None:
        with torch.no_grad(), _math_attention():
            loss = loss_name_for(logits_of(net(x))[:1].numel())
    trainable, names = shared_names(net, shared, type(model).__name__)
    started = time.perf_counter()
    products = GramProducts(net, x, labels, loss, names)
    return krylov_rank(
        products,
        centred(x, centre).reshape(-1),
        seed=seed,
        block=block,
        budget_seconds=None if budget_seconds is None else budget_seconds - (time.perf_counter() - started),
        hidden_below=hidden_below,
        progress=progress,
        # The basis may take half of what the check may use; the products' own passes need the rest.
        memory_bytes=memory_budget(device)[0] // 2 if memory_bytes is None else memory_bytes,
    )


def invisible_part(reading: KrylovReading, images: torch.Tensor, centre=None) -> torch.Tensor:
    """The part of ``images``' deviation from ``centre`` (hidden.centred) that an exact reading's visible subspace
    misses (flat)."""
    x = centred(images.detach().to(reading.visible.dtype), centre).reshape(-1).to(reading.visible.device)
    return x - reading.visible.T @ (reading.visible @ x)


def as_rank_measurement(
    reading: KrylovReading,
    images: torch.Tensor,
    *,
    shared: list[str],
    shared_size: int,
    loss: str,
    device: str,
    centre=None,
) -> RankMeasurement:
    """An exact Krylov reading as the dense check's record, so every reading of the rank (the verdict, the static
    bound, each sample's hidden energy) reads both alike. Refuses an inexact one: a lower bound is not a rank."""
    if not reading.exact or reading.visible is None:
        why = {"memory": "its basis would outgrow the device's memory", "budget": "its time budget was spent"}
        hidden = (
            "not measured"
            if reading.hidden_share_at_most is None
            else (f"at most {100 * reading.hidden_share_at_most:.3g} %")
        )
        raise UsageError(
            f"the matrix-free rank check stopped after {reading.basis:,} of {reading.unknowns:,} directions "
            f"({reading.seconds:.0f} s; {why.get(reading.stopped, reading.stopped)}): the rank is at least "
            f"{reading.rank_at_least:,} and this sample's hidden share of its energy is {hidden}, not yet the "
            "exact answer",
            "lower --input-shape (convolutional models are resolution-independent), or use a device with more "
            "memory (--device cuda)"
            if reading.stopped == "memory"
            else "give it more time (budget_seconds), run it on a GPU (--device cuda), or lower --input-shape",
        )
    values = reading.singular_values
    rank, unknowns = reading.rank_at_least, reading.unknowns
    kept = float(values[rank - 1]) if rank else None
    if rank == 0:
        gap = None
    elif rank < values.size:
        gap = kept / float(values[rank]) if values[rank] > 0 else math.inf
    else:
        gap = kept / reading.tolerance if reading.tolerance > 0 else math.inf
    invisible = invisible_part(reading, images, centre)
    return RankMeasurement(
        unknowns=unknowns,
        rank=rank,
        deficit=unknowns - rank,
        tolerance=reading.tolerance,
        gap=gap,
        reliable=gap is not None and gap >= RELIABLE_GAP,
        sigma_max=float(values[0]) if values.size else 0.0,
        sigma_min_kept=kept,
        singular_values=values,
        spectrum="block Lanczos on JᵀJ",
        seconds=reading.seconds,
        sketch_seconds=reading.seconds,
        spectrum_seconds=0.0,
        device=device,
        method="matrix-free (J and Jᵀ products)",
        loss=loss,
        sketch_rows=reading.basis,
        chunk_rows=BLOCK,
        shared_gradient_size=shared_size,
        shared_parameters=shared,
        invisible=invisible.reshape(images.shape).cpu().numpy(),
        precision="float64",
        precision_note=f"products in float64; a Gram value at or below σ_max² · d · ε counts as zero "
        f"(singular values of J below {reading.tolerance:.3g})",
        sample_ranks=[rank] if images.shape[0] == 1 else [],
    )
