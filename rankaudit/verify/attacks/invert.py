"""Recover training inputs from their gradients by one batched optimisation ("Inverting Gradients", Geiping et al. 2020)."""

from __future__ import annotations

import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify import finite

# The attack's steps live beside this module: what is matched and scored (invert_match), the batched optimisation
# (invert_loop).
from rankaudit.verify.attacks.invert_loop import (
    InvertOutcome,
    ProgressCallback,
    _Image,
    _invert_images,
    _Settings,
    _StepCounter,
)
from rankaudit.verify.attacks.invert_match import (
    CROSS_ENTROPY,
    LOGISTIC,
    LossSpec,
    _candidate_labels,
    _shared_names,
    _unit_targets,
    as_loss_spec,
    client_loss,
    psnr_from_mse,
)
from rankaudit.verify.substitute import differentiable_ops

DEFAULT_STEPS = 1000
DEFAULT_RESTARTS = 2
DEFAULT_LR = 0.1
# In [0, 1] pixel units.
DEFAULT_TV_WEIGHT = 1e-2
# The prior shapes the two coarse learning-rate phases and is then dropped; see invert_gradients.
DEFAULT_TV_UNTIL = 5 / 8


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"`` (or None) picks CUDA when available, else the CPU."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def invert_gradients(
    model: nn.Module,
    target_grads: dict[str, torch.Tensor],
    input_shape: Sequence[int],
    label_or_loss_spec: LossSpec | str | int = CROSS_ENTROPY,
    steps: int = DEFAULT_STEPS,
    restarts: int = DEFAULT_RESTARTS,
    lr: float = DEFAULT_LR,
    tv_weight: float = DEFAULT_TV_WEIGHT,
    device: str | torch.device | None = "auto",
    seed: int = 0,
    progress: ProgressCallback | None = None,
    *,
    tv_until: float = DEFAULT_TV_UNTIL,
    bounds: tuple[float, float] = (0.0, 1.0),
    signed_gradients: bool = True,
    tolerance: float = 0.0,
) -> InvertOutcome:
    """Find an input whose gradient points the same way as ``target_grads``.

    ``target_grads`` maps parameter names of ``model`` to the gradient of the
    client's loss on ONE sample; parameters missing from it are ignored, so an
    attacker who sees only part of the update can still run.  ``input_shape`` is
    the shape of one sample without the batch dimension; ``x_hat`` comes back in
    that shape.

    The objective is ``1 - cos(grad(x_hat), target) + tv_weight * TV(x_hat)``,
    minimised with Adam from uniform noise in ``bounds``, with the learning rate
    cut tenfold at 3/8, 5/8 and 7/8 of ``steps``, and ``x_hat`` projected back into
    ``bounds`` after each step.  As in Geiping et al., Adam is fed the sign of the
    input gradient (``signed_gradients``), which copes with the gradient scale
    swinging over orders of magnitude along the way.  TV applies only to inputs
    shaped [C, H, W].  Each restart keeps its best iterate; the restart with the
    smallest gradient distance wins.  A restart stops early once the distance is
    at most ``tolerance`` (0 disables this).  All restarts run side by side as one
    batched optimisation (see :func:`run_inverting`); Adam acts element-wise, so
    each restart follows the same path it would follow alone.

    One departure from Geiping et al.: the TV term is applied for the first
    ``tv_until`` fraction of the steps only (``tv_until=1.0`` is the original).
    Where the gradient pins the input down, the prior's pull otherwise leaves a
    floor under the error (MSE about 1e-4 to 6e-4 on an exactly determined MLP);
    released after the two coarse phases, the exact input is recovered (MSE
    about 1e-9) while the prior's help on ResNets and CNN6 is kept (same MSE as
    with TV throughout in our runs).  It does not rescue nets whose gradient is
    nearly flat in the input, such as a random sigmoid LeNet: there even a small
    TV weight outweighs the gradient term near the solution, and ``tv_weight=0``
    recovers far better (MSE about 1e-8 against 1e-2).

    The model runs in eval mode (its mode is restored afterwards): BatchNorm uses
    its running statistics and dropout is off.  For one sample, train-mode
    BatchNorm normalises with that sample's own statistics (BatchNorm1d refuses a
    batch of one altogether), which mostly hides the attack's target behind
    per-sample renormalisation; eval mode models a client whose BN layers are
    affine maps known to the server, the setting the static analysis reasons
    about.  The simulated client in :func:`run_inverting` uses eval mode too, so
    attacker and client agree.  Eval mode is also what lets the candidates be
    batched: each candidate's forward pass reads the running statistics and
    never writes them, so no candidate sees another.

    Labels: cross-entropy labels come from :func:`infer_label_idlg`, logistic
    ones from :func:`infer_label_logistic`.  When the logistic label cannot be
    read off the gradient (an output layer without a bias), each sign is probed
    with a short run (``max(20, steps // 8)`` steps); a sign whose fit is at
    least 4 times better than the other's is attacked alone, otherwise both get
    the full ``restarts`` and the better fit is kept.  On random CNN6 and LeNet
    the wrong sign stalls at a distance of 0.9 to 2 against below 0.01 for the
    right one, so the probe settles it in practice; pass the label to skip it.

    ``progress(done, total)`` is called after every batched step with the
    candidate steps done so far (a step of two restarts side by side counts 2);
    ``total`` is the step budget, and grows if a label probe cannot settle the
    sign.  Deterministic on the CPU for a given ``seed``.
    """
    _check_budget(steps, restarts)
    spec = as_loss_spec(label_or_loss_spec)
    sample_shape = tuple(int(d) for d in input_shape)
    run_device = resolve_device(device)
    settings = _Settings(
        steps, restarts, lr, tv_weight, tv_until, (float(bounds[0]), float(bounds[1])), signed_gradients, tolerance
    )
    started = time.perf_counter()
    attacked_model = _model_on(model, run_device)
    names = _shared_names(attacked_model, target_grads)
    dtype = dict(attacked_model.named_parameters())[names[0]].dtype
    was_training = attacked_model.training
    attacked_model.eval()
    try:
        labels = _candidate_labels(attacked_model, target_grads, spec, sample_shape, run_device, dtype)
        image = _Image(_unit_targets(target_grads, names, run_device, dtype), labels, seed)
        counter = _StepCounter(progress, 0)
        (outcome,) = _invert_images(attacked_model, names, [image], spec.kind, sample_shape, settings, counter)
    finally:
        attacked_model.train(was_training)
    counter.finish()
    outcome.seconds = time.perf_counter() - started
    return outcome


def _check_budget(steps: int, restarts: int) -> None:
    if steps < 1 or restarts < 1:
        raise ValueError(f"steps and restarts must be at least 1, got {steps} and {restarts}")


def _model_on(model: nn.Module, device: torch.device) -> nn.Module:
    """The model itself when it already lives on ``device``; otherwise a copy, so the caller's model is untouched."""
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("the model has no parameters, so there is no gradient to invert")
    if first.device == device:
        return model
    return copy.deepcopy(model).to(device)


@dataclass
class InvertResult:
    """The attack on a set of images: per-sample errors and timings, and their medians.

    PSNR is on the [0, 1] scale, ``10 * log10(1 / MSE)``; an exact recovery has
    infinite PSNR.
    """

    x_hat: torch.Tensor
    mse: list[float]
    psnr: list[float]
    seconds: list[float]
    median_mse: float
    median_psnr: float
    total_seconds: float
    labels: list[int]
    recovered_labels: list[int | None]
    final_losses: list[float]
    steps_run: list[int]
    loss: str
    steps: int
    restarts: int
    device: str
    outcomes: list[InvertOutcome] = field(default_factory=list, repr=False)


def client_gradient(model: nn.Module, x: torch.Tensor, label: int, kind: str) -> dict[str, torch.Tensor]:
    """The simulated client: gradient of its loss on one sample ``x`` ([C, H, W]), in eval mode."""
    was_training = model.training
    model.eval()
    try:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]

        def output_and_loss():
            output = model(x.unsqueeze(0))
            return output, client_loss(output, label, kind)

        with torch.enable_grad():
            output, loss = output_and_loss()
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        # The attack would match a NaN target and still report an MSE: refuse, naming the op that made it.
        finite.require_finite(
            "--verify rgap (inverting gradients)",
            (output, loss),
            grads,
            model=model,
            rerun=output_and_loss,
            parameters=[p for _, p in named],
            inputs=x,
        )
    finally:
        model.train(was_training)
    return {name: (torch.zeros_like(p) if g is None else g).detach() for (name, p), g in zip(named, grads)}


def run_inverting(
    model: nn.Module,
    images: torch.Tensor,
    loss: str = CROSS_ENTROPY,
    steps: int = DEFAULT_STEPS,
    restarts: int = DEFAULT_RESTARTS,
    device: str | torch.device | None = "auto",
    seed: int = 0,
    progress: ProgressCallback | None = None,
    step_progress: ProgressCallback | None = None,
    *,
    labels: Sequence[int] | None = None,
    infer_labels: bool = True,
    lr: float = DEFAULT_LR,
    tv_weight: float = DEFAULT_TV_WEIGHT,
    tv_until: float = DEFAULT_TV_UNTIL,
    defense: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> InvertResult:
    """Attack every image of ``images`` ([N, C, H, W] in [0, 1]) and score the reconstructions.

    Each image plays a client with one sample: its gradient is computed here
    from the true image, and the attack on it sees only that gradient, the
    weights and the loss (plus the label when ``infer_labels`` is false).
    Without ``labels``, each image gets a label drawn from ``seed`` (a class
    index for cross-entropy, -1/+1 for logistic).  All images and restarts run as
    one batched optimisation (:func:`invert_gradients` on each image, image ``i``
    seeded with ``seed + i``, gives the same reconstructions one at a time), so
    each image's ``seconds`` is the run's wall time divided by N.
    ``step_progress(done, total)`` reports candidate steps over all images,
    ``progress(i, N)`` the images finished (all at the end of the batch).
    ``defense`` (grads -> grads) is applied by the client before sharing; the
    attack matches its output as if it were the gradient (it is not told).
    """
    if images.dim() != 4:
        raise ValueError(f"images must be [N, C, H, W], got shape {tuple(images.shape)}")
    _check_budget(steps, restarts)
    kind = as_loss_spec(loss).kind
    run_device = resolve_device(device)
    attacked_model = _model_on(model, run_device)
    dtype = next(attacked_model.parameters()).dtype
    count = images.shape[0]
    sample_shape = tuple(images.shape[1:])
    true_labels = _client_labels(attacked_model, kind, count, sample_shape, seed, run_device, dtype, labels)
    settings = _Settings(steps, restarts, lr, tv_weight, tv_until, (0.0, 1.0), True, 0.0)

    started = time.perf_counter()
    outcomes: list[InvertOutcome] = []
    if count:
        targets = []
        for index in range(count):
            truth = images[index].to(device=run_device, dtype=dtype)
            target = client_gradient(attacked_model, truth, true_labels[index], kind)
            if defense is not None:
                target = {name: g.to(device=run_device, dtype=dtype) for name, g in defense(target).items()}
            targets.append(target)
        names = _shared_names(attacked_model, targets[0])
        if any(set(target) != set(targets[0]) for target in targets):
            raise ValueError("the defense shared different parameters for different images; the batch needs one set")
        was_training = attacked_model.training
        attacked_model.eval()
        try:
            attacked = []
            for index, target in enumerate(targets):
                spec = LossSpec(kind=kind, label=None if infer_labels else true_labels[index])
                candidates = _candidate_labels(attacked_model, target, spec, sample_shape, run_device, dtype)
                attacked.append(_Image(_unit_targets(target, names, run_device, dtype), candidates, seed + index))
            counter = _StepCounter(step_progress, 0)
            # The attack differentiates the gradient again: ops without a double backward get their stand-ins.
            with differentiable_ops():
                outcomes = _invert_images(attacked_model, names, attacked, kind, sample_shape, settings, counter)
        finally:
            attacked_model.train(was_training)
        counter.finish()
        share = (time.perf_counter() - started) / count
        for index, outcome in enumerate(outcomes):
            outcome.seconds = share
            if progress is not None:
                progress(index + 1, count)

    reconstructions = torch.stack([o.x_hat for o in outcomes]) if outcomes else images.new_zeros(images.shape)
    truths = images.detach().to(device="cpu", dtype=reconstructions.dtype)
    mse = [float(F.mse_loss(reconstructions[i], truths[i])) for i in range(count)]
    psnr = [psnr_from_mse(value) for value in mse]
    return InvertResult(
        x_hat=reconstructions,
        mse=mse,
        psnr=psnr,
        seconds=[o.seconds for o in outcomes],
        median_mse=statistics.median(mse) if mse else math.nan,
        median_psnr=statistics.median(psnr) if psnr else math.nan,
        total_seconds=time.perf_counter() - started,
        labels=list(true_labels),
        recovered_labels=[o.label for o in outcomes],
        final_losses=[o.final_loss for o in outcomes],
        steps_run=[o.steps_run for o in outcomes],
        loss=kind,
        steps=steps,
        restarts=restarts,
        device=str(run_device),
        outcomes=outcomes,
    )


def _client_labels(
    model: nn.Module,
    kind: str,
    count: int,
    sample_shape: tuple[int, ...],
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    labels: Sequence[int] | None,
) -> list[int]:
    if labels is not None:
        if len(labels) != count:
            raise ValueError(f"got {len(labels)} labels for {count} images")
        return [int(label) for label in labels]
    generator = torch.Generator().manual_seed(int(seed))
    if kind == LOGISTIC:
        return [1 if bit else -1 for bit in torch.randint(0, 2, (count,), generator=generator).tolist()]
    with torch.no_grad():
        was_training = model.training
        model.eval()
        try:
            classes = model(torch.zeros((1,) + sample_shape, device=device, dtype=dtype)).numel()
        finally:
            model.train(was_training)
    return torch.randint(0, classes, (count,), generator=generator).tolist()
