"""Recover training inputs from their gradients by one batched optimisation ("Inverting Gradients", Geiping et al. 2020)."""

from __future__ import annotations

import copy
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify import finite
from rankaudit.verify.substitute import differentiable_ops

ProgressCallback = Callable[[int, int], None]

CROSS_ENTROPY = "cross-entropy"
LOGISTIC = "logistic"
LOSS_KINDS = (CROSS_ENTROPY, LOGISTIC)

DEFAULT_STEPS = 1000
DEFAULT_RESTARTS = 2
DEFAULT_LR = 0.1
# In [0, 1] pixel units.
DEFAULT_TV_WEIGHT = 1e-2
# The prior shapes the two coarse learning-rate phases and is then dropped; see invert_gradients.
DEFAULT_TV_UNTIL = 5 / 8


@dataclass(frozen=True)
class LossSpec:
    """The client's loss and, when the attacker knows it, the label.

    ``kind`` is ``"cross-entropy"`` (``label`` a class index) or ``"logistic"``
    (one logit ``mu``, ``label`` in {-1, +1}, loss ``log(1 + exp(-label * mu))``).
    ``label=None`` means the attacker infers it from the gradient.
    """

    kind: str = CROSS_ENTROPY
    label: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss {self.kind!r}; expected one of {LOSS_KINDS}")
        if self.kind == LOGISTIC and self.label not in (None, -1, 1):
            raise ValueError(f"a logistic label must be -1 or +1, got {self.label!r}")
        if self.kind == CROSS_ENTROPY and self.label is not None and int(self.label) < 0:
            raise ValueError(f"a class index must be non-negative, got {self.label!r}")


def as_loss_spec(label_or_loss_spec: LossSpec | str | int) -> LossSpec:
    """A bare int is a cross-entropy class label; a bare string names a loss whose label is inferred."""
    if isinstance(label_or_loss_spec, LossSpec):
        return label_or_loss_spec
    if isinstance(label_or_loss_spec, str):
        return LossSpec(kind=label_or_loss_spec)
    if isinstance(label_or_loss_spec, bool):
        raise TypeError("a label must be an int, not a bool")
    if isinstance(label_or_loss_spec, int):
        return LossSpec(kind=CROSS_ENTROPY, label=label_or_loss_spec)
    raise TypeError(f"expected a LossSpec, a loss name or a class label, got {label_or_loss_spec!r}")


def client_loss(output: torch.Tensor, label: int, kind: str) -> torch.Tensor:
    """The loss of one sample, as the client computes it for its update."""
    if kind == CROSS_ENTROPY:
        logits = output.reshape(1, -1)
        target = torch.tensor([int(label)], device=output.device)
        return F.cross_entropy(logits, target)
    if kind == LOGISTIC:
        if output.numel() != 1:
            raise ValueError(f"the logistic loss needs a single logit, the model gave {output.numel()}")
        # softplus(-y*mu) is log(1 + exp(-y*mu)) without overflow for large margins.
        return F.softplus(-float(label) * output.reshape(()))
    raise ValueError(f"unknown loss {kind!r}; expected one of {LOSS_KINDS}")


def infer_label_idlg(last_weight_grad: torch.Tensor, last_bias_grad: torch.Tensor | None = None) -> int:
    """The true class of one sample from the gradient of the output Linear layer (the iDLG sign rule).

    With softmax cross-entropy the gradient of the output layer's row ``j`` is
    ``(p_j - [j == y]) * h`` for the layer's input ``h``: only the true class has a
    negative coefficient.  The bias gradient is that coefficient vector itself, so
    when it is given the answer is exact.  Without a bias, iDLG reads the sign off
    the row sums, which assumes ``h >= 0`` (a ReLU before the head).  Here the rows'
    pairwise inner products ``(p_i - [i == y])(p_j - [j == y]) |h|^2`` are used
    instead: the true row is the one anti-aligned with every other row, whatever
    the sign of ``h``.  Two classes make that symmetric, and then the row-sum rule
    (and its ``h >= 0`` assumption) decides.
    """
    if last_bias_grad is not None and last_bias_grad.numel() > 1 and bool(last_bias_grad.ne(0).any()):
        return int(torch.argmin(last_bias_grad.detach().reshape(-1)).item())
    rows = last_weight_grad.detach().reshape(last_weight_grad.shape[0], -1).double()
    if rows.shape[0] < 2:
        raise ValueError("cross-entropy label inference needs an output layer with at least two classes")
    if rows.shape[0] > 2:
        gram = rows @ rows.T
        alignment_with_others = gram.sum(dim=1) - gram.diagonal()
        return int(torch.argmin(alignment_with_others).item())
    return int(torch.argmin(rows.sum(dim=1)).item())


def infer_label_logistic(
    last_weight_grad: torch.Tensor | None = None, last_bias_grad: torch.Tensor | None = None
) -> int | None:
    """The label in {-1, +1} of one sample under the logistic loss, or None when the gradient cannot tell.

    ``d loss / d mu = -y * sigmoid(-y * mu)`` has the sign of ``-y``, and the bias
    gradient of the output layer equals it, so a bias gives the label exactly.
    The weight gradient is ``d loss / d mu * h``; its sign also depends on the
    unknown features ``h`` (negative entries are common after LeakyReLU), so
    without a bias no label is claimed and the caller must try both.
    ``last_weight_grad`` is accepted for symmetry with :func:`infer_label_idlg`.
    """
    del last_weight_grad  # see the docstring: on its own it does not determine the sign
    if last_bias_grad is None:
        return None
    value = float(last_bias_grad.detach().reshape(-1)[0])
    if value == 0.0:
        return None
    return -1 if value > 0 else 1


def find_output_linear(model: nn.Module, probe: torch.Tensor) -> tuple[str, str | None] | None:
    """Parameter names ``(weight, bias)`` of the nn.Linear whose output is the model's output, if any."""
    module_names = {id(module): name for name, module in model.named_modules()}
    calls: list[tuple[nn.Module, torch.Tensor]] = []

    def remember(module: nn.Module, _inputs, output) -> None:
        calls.append((module, output))

    handles = [m.register_forward_hook(remember) for m in model.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            model_output = model(probe)
    finally:
        for handle in handles:
            handle.remove()
    if not calls:
        return None
    module, linear_output = calls[-1]
    same_values = linear_output.shape == model_output.shape and torch.equal(linear_output, model_output)
    if linear_output is not model_output and not same_values:
        return None
    prefix = module_names[id(module)]
    prefix = f"{prefix}." if prefix else ""
    bias_name = f"{prefix}bias" if module.bias is not None else None
    return f"{prefix}weight", bias_name


def gradient_distances(dummy_grads: Sequence[torch.Tensor], unit_targets: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per candidate, 1 - cosine similarity of its gradient and its target, each taken as one vector over all layers.

    Every tensor carries the candidates along dimension 0; ``unit_targets`` are
    already scaled to unit length (:func:`unit_gradient`).  Computed as half the
    squared distance between the two unit vectors, which is the same number
    whenever both gradients are nonzero.  Written as ``1 - dot`` it cancels
    catastrophically near a match: in float32 it reads 0 once the gradients
    agree to about 3e-4, and the attack stops getting a signal long before the
    input is pinned down.
    """
    dummy_norm = torch.sqrt(sum(g.pow(2).flatten(1).sum(1) for g in dummy_grads))
    # The floor keeps the objective finite and differentiable at an all-zero gradient.
    dummy_scale = 1.0 / dummy_norm.clamp_min(1e-30)
    squared = sum(
        (g * dummy_scale.view((-1,) + (1,) * (g.dim() - 1)) - t).pow(2).flatten(1).sum(1)
        for g, t in zip(dummy_grads, unit_targets)
    )
    return 0.5 * squared


def unit_gradient(target_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """One sample's gradient scaled to unit length over all its layers (left at zero when it is all zero)."""
    norm = torch.sqrt(sum(t.pow(2).sum() for t in target_grads))
    scale = 1.0 / norm.clamp_min(1e-30)
    return [t * scale for t in target_grads]


def total_variations(images: torch.Tensor) -> torch.Tensor:
    """Per image of a [K, C, H, W] batch, the mean absolute difference between vertically and horizontally adjacent pixels."""
    vertical = (images[..., 1:, :] - images[..., :-1, :]).abs().flatten(1).mean(1)
    horizontal = (images[..., :, 1:] - images[..., :, :-1]).abs().flatten(1).mean(1)
    return vertical + horizontal


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``"auto"`` (or None) picks CUDA when available, else the CPU."""
    if device is None or (isinstance(device, str) and device == "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# How the per-candidate gradients were computed: one vectorised call for the whole batch, or one call per candidate
# (for models torch.func.vmap cannot batch, such as ones with data-dependent Python control flow).
VECTORISED = "vmap"
LOOPED = "loop"


@dataclass
class InvertOutcome:
    """What one attack on one sample produced.

    ``final_loss`` is the gradient distance (1 - cosine, without the TV term) at
    ``x_hat``; ``restart_losses`` holds that distance for every full restart, in
    the order (label, restart); ``initial_loss`` is the distance at the winning
    restart's starting point.  ``steps_run`` counts every optimisation step taken
    by this sample's candidates (restarts and label probes included; candidates
    that run side by side each count their own steps).  ``seconds`` is the wall
    time of the batch this sample ran in, divided by the number of samples in it.
    ``candidate_labels`` are the labels attacked in full (one unless the label
    could not be settled), ``probe_losses`` the distances the label probe reached
    for each possible sign (empty when none was needed).  ``per_sample_gradients``
    says whether the candidates' gradients came from one vectorised call
    (``"vmap"``) or one call per candidate (``"loop"``); ``cuda_graph`` whether
    the steps were replayed from a captured CUDA graph.
    """

    x_hat: torch.Tensor
    final_loss: float
    steps_run: int
    seconds: float
    restart_losses: list[float]
    initial_loss: float = math.nan
    label: int | None = None
    candidate_labels: list[int] = field(default_factory=list)
    probe_losses: list[float] = field(default_factory=list)
    per_sample_gradients: str = VECTORISED
    cuda_graph: bool = False


@dataclass(frozen=True)
class _Settings:
    steps: int
    restarts: int
    lr: float
    tv_weight: float
    tv_until: float
    bounds: tuple[float, float]
    signed_gradients: bool
    tolerance: float


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


# A sign probe runs 1/8 of the step budget, and never fewer than this many steps.
_MIN_PROBE_STEPS = 20
# The probe keeps one sign only when the other fits at least this many times worse.
_PROBE_MARGIN = 4.0
# A host sync every few steps is cheap enough for the early-stop check.
_CHECK_EVERY = 10
# Bytes one candidate holds during a step, in units of (shared parameters + activations) x element size: its
# per-sample gradient, the double-backward graph's saved tensors and their gradients.  Measured on the CPU in
# float64 (peak RSS growth per added candidate): CNN6 10 MB and ResNet18W16 59 MB, about 8 units each; 12 leaves
# a margin.  It only sizes the groups a large batch is split into.
_COPIES_PER_CANDIDATE = 12
# The share of free memory a batch may take (the rest stays for the allocator's slack and other users).
_MEMORY_SHARE = 0.5


class _StepCounter:
    """Counts candidate steps and forwards them to a ``(done, total)`` progress callback."""

    def __init__(self, progress: ProgressCallback | None, total: int) -> None:
        self.progress = progress
        self.total = total
        self.done = 0

    def tick(self, candidates: int) -> None:
        self.done += candidates
        if self.progress is not None:
            self.progress(self.done, self.total)

    def finish(self) -> None:
        # Early stopping can leave the bar short of its total.
        if self.progress is not None and self.done < self.total:
            self.progress(self.total, self.total)


@dataclass
class _Image:
    """One sample under attack: its target gradient at unit length (one tensor per shared parameter), the labels
    still in question, and the seed its restarts start from."""

    unit_targets: list[torch.Tensor]
    labels: list[int]
    seed: int


@dataclass(frozen=True)
class _Candidate:
    image: int
    label: int
    restart: int


@dataclass
class _Runs:
    """Per candidate of one batched optimisation: its best iterate, that iterate's distance, the starting distance
    and the steps it took."""

    x: torch.Tensor
    distances: list[float]
    initial: list[float]
    steps: list[int]


def _invert_images(
    model: nn.Module,
    names: list[str],
    images: list[_Image],
    kind: str,
    sample_shape: tuple[int, ...],
    settings: _Settings,
    counter: _StepCounter,
) -> list[InvertOutcome]:
    """Attack every image at once: label probes as one batch, then every (image, label, restart) as one batch."""
    inversion = _BatchedInversion(model, names, kind, sample_shape, settings, counter)
    steps, restarts = settings.steps, settings.restarts
    probing = [index for index, image in enumerate(images) if len(image.labels) > 1]
    probe_steps = min(steps, max(_MIN_PROBE_STEPS, steps // 8))
    counter.total += probe_steps * sum(len(images[i].labels) for i in probing) + steps * restarts * len(images)
    probe_losses: dict[int, list[float]] = {}
    probe_steps_taken = [0] * len(images)
    if probing:
        # The wrong logistic sign leaves the fit far off (distance near 1 against near 0 for the right one), so a
        # short run per sign usually settles it; only a close call pays for both.
        probes = [_Candidate(i, label, 0) for i in probing for label in images[i].labels]
        runs = inversion.optimise(probes, images, probe_steps)
        for candidate, distance, taken in zip(probes, runs.distances, runs.steps):
            probe_losses.setdefault(candidate.image, []).append(distance)
            probe_steps_taken[candidate.image] += taken
        for index in probing:
            ranked = sorted(zip(probe_losses[index], images[index].labels))
            if ranked[0][0] * _PROBE_MARGIN < ranked[1][0]:
                images[index].labels = [ranked[0][1]]
            else:
                counter.total += steps * restarts * (len(images[index].labels) - 1)

    candidates = [
        _Candidate(i, label, restart)
        for i, image in enumerate(images)
        for label in image.labels
        for restart in range(restarts)
    ]
    runs = inversion.optimise(candidates, images, steps)
    outcomes = []
    for index, image in enumerate(images):
        mine = [k for k, candidate in enumerate(candidates) if candidate.image == index]
        # The first of equal distances wins, as when the restarts ran one after another.
        best = min(mine, key=lambda k: runs.distances[k])
        outcomes.append(
            InvertOutcome(
                x_hat=runs.x[best].cpu(),
                final_loss=runs.distances[best],
                steps_run=probe_steps_taken[index] + sum(runs.steps[k] for k in mine),
                seconds=math.nan,
                restart_losses=[runs.distances[k] for k in mine],
                initial_loss=runs.initial[best],
                label=candidates[best].label,
                candidate_labels=list(image.labels),
                probe_losses=probe_losses.get(index, []),
                per_sample_gradients=VECTORISED if inversion.vectorised else LOOPED,
                cuda_graph=inversion.graphed,
            )
        )
    return outcomes


class _BatchedInversion:
    """Optimises many candidate inputs at once, each matched against its own image's target gradient.

    The candidates' parameter gradients come from ``torch.func``: ``vmap`` over
    ``grad`` of a ``functional_call``, so one call yields every candidate's own
    gradient, and ``grad`` of the summed objective then yields every candidate's
    input gradient (candidates do not interact, so the sum separates).
    """

    def __init__(
        self,
        model: nn.Module,
        names: list[str],
        kind: str,
        sample_shape: tuple[int, ...],
        settings: _Settings,
        counter: _StepCounter,
    ) -> None:
        parameters = dict(model.named_parameters())
        # Parameters outside `names` (not shared, or frozen) and buffers are read from the module itself.
        self.shared = {name: parameters[name].detach() for name in names}
        first = self.shared[names[0]]
        self.model, self.names, self.kind, self.sample_shape = model, names, kind, sample_shape
        self.settings, self.counter = settings, counter
        self.device, self.dtype = first.device, first.dtype
        self.classes, activations = _probe_sizes(model, sample_shape, self.device, self.dtype)
        if kind == LOGISTIC and self.classes != 1:
            raise ValueError(f"the logistic loss needs a single logit, the model gave {self.classes}")
        shared_numel = sum(t.numel() for t in self.shared.values())
        self.group_size = _group_size(
            _COPIES_PER_CANDIDATE * (shared_numel + activations) * first.element_size(), self.device
        )
        self.vectorised = True
        self.graphed = False
        self.use_tv = settings.tv_weight > 0 and len(sample_shape) == 3
        self._objective_and_input_grad = torch.func.grad(self._objective, has_aux=True)

    def optimise(self, candidates: list[_Candidate], images: list[_Image], budget: int) -> _Runs:
        """Run ``budget`` steps for every candidate, in groups small enough for the device's free memory."""
        parts = [
            self._optimise_group(candidates[start : start + self.group_size], images, budget)
            for start in range(0, len(candidates), self.group_size)
        ]
        return _Runs(
            torch.cat([p.x for p in parts]),
            [d for p in parts for d in p.distances],
            [d for p in parts for d in p.initial],
            [s for p in parts for s in p.steps],
        )

    def per_sample_gradients(self, x: torch.Tensor, codes: torch.Tensor) -> list[torch.Tensor]:
        """Each candidate's gradient of the client's loss, one [K, *parameter shape] tensor per shared parameter."""
        gradient_of = torch.func.grad(self._sample_loss)
        if self.vectorised:
            try:
                grads = torch.func.vmap(gradient_of, in_dims=(None, 0, 0))(self.shared, x, codes)
                return [grads[name] for name in self.names]
            except torch.OutOfMemoryError:
                raise
            except (RuntimeError, NotImplementedError):
                # vmap refuses data-dependent control flow and ops without a batching rule; the same gradient,
                # one candidate at a time, is still exact. A genuine fault in the model raises again below.
                self.vectorised = False
        rows = [gradient_of(self.shared, x[k], codes[k]) for k in range(x.shape[0])]
        return [torch.stack([row[name] for row in rows]) for name in self.names]

    def _sample_loss(self, shared: dict[str, torch.Tensor], x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
        output = torch.func.functional_call(self.model, shared, (x.unsqueeze(0),))
        return _coded_loss(output, code, self.kind)

    def objective_and_input_grad(
        self, x: torch.Tensor, codes: torch.Tensor, unit_targets: list[torch.Tensor], tv_weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d objective / d x for every candidate, every candidate's gradient distance)."""
        return self._objective_and_input_grad(x, codes, unit_targets, tv_weight)

    def _objective(
        self, x: torch.Tensor, codes: torch.Tensor, unit_targets: list[torch.Tensor], tv_weight: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        distances = gradient_distances(self.per_sample_gradients(x, codes), unit_targets)
        total = distances.sum()
        if tv_weight is not None:
            total = total + tv_weight * total_variations(x).sum()
        return total, distances

    def _codes(self, labels: list[int]) -> torch.Tensor:
        # Labels enter the vectorised loss as data: a one-hot row for cross-entropy, the sign for the logistic loss.
        if self.kind == CROSS_ENTROPY:
            index = torch.tensor(labels, device=self.device)
            return F.one_hot(index, self.classes).to(self.dtype)
        return torch.tensor([float(label) for label in labels], device=self.device, dtype=self.dtype)

    def _starts(self, candidates: list[_Candidate], images: list[_Image]) -> torch.Tensor:
        low, high = self.settings.bounds
        starts = []
        for candidate in candidates:
            # One generator per restart, seeded from (seed, restart) alone, so a restart's start does not depend
            # on what runs beside it or on the global RNG state.
            generator = torch.Generator().manual_seed(_mix_seed(images[candidate.image].seed, candidate.restart))
            starts.append(torch.rand(self.sample_shape, generator=generator, dtype=self.dtype) * (high - low) + low)
        return torch.stack(starts).to(self.device)

    # The attack differentiates twice through torch.func, which ignores the caller's grad mode; no_grad keeps
    # ordinary autograd from also recording a graph for the module's own parameters.
    @torch.no_grad()
    def _optimise_group(self, candidates: list[_Candidate], images: list[_Image], budget: int) -> _Runs:
        settings = self.settings
        group = _Group(
            self,
            self._starts(candidates, images),
            self._codes([c.label for c in candidates]),
            [torch.stack([images[c.image].unit_targets[i] for c in candidates]) for i in range(len(self.names))],
        )
        milestones = sorted({max(1, int(budget * fraction)) for fraction in (3 / 8, 5 / 8, 7 / 8)})
        tv_steps = int(round(settings.tv_until * budget))
        replay = _CudaGraphStep(group.step, group.written()) if self.device.type == "cuda" and _CUDA_GRAPHS else None
        active_count = len(candidates)
        initial = group.best_distance
        # Nothing below waits on the device except the early-stop check; the host queues steps ahead.
        with _math_attention():
            for step in range(budget):
                if step in milestones:
                    group.lr.mul_(0.1)
                if step == tv_steps and group.tv_weight is not None:
                    group.tv_weight.zero_()
                if replay is not None:
                    replay()
                else:
                    group.step()
                if step == 0:
                    initial = group.distances.clone()
                self.counter.tick(active_count)
                if settings.tolerance > 0 and (step + 1) % _CHECK_EVERY == 0:
                    group.active &= group.best_distance > settings.tolerance
                    active_count = int(group.active.sum())
                    if active_count == 0:
                        break
            # The final projected iterate was never scored inside the loop.
            final = gradient_distances(self.per_sample_gradients(group.x, group.codes), group.unit_targets)
        if replay is not None:
            self.graphed = replay.captured
        improved = (final < group.best_distance) & group.active
        best_x = torch.where(improved.view(group.per_candidate), group.x, group.best_x)
        best_distance = torch.where(improved, final, group.best_distance)
        return _Runs(best_x, best_distance.tolist(), initial.tolist(), group.steps_taken.tolist())


# Whether CUDA runs replay each step from a captured graph (tests switch it off to compare with plain launches).
_CUDA_GRAPHS = True


class _Group:
    """Candidates in flight: every tensor one step reads or writes, at fixed addresses, so that the step can be
    captured once as a CUDA graph and replayed (hyperparameters that change are tensors updated in place).

    A step scores the current iterates, keeps each candidate's best, and moves the active ones by one Adam step
    (Kingma & Ba, torch's default constants, bias-corrected; fed the sign of the input gradient, Geiping et al.)
    projected back into the bounds.  Adam acts element-wise, so every candidate follows the path it would follow
    alone.
    """

    BETAS = (0.9, 0.999)
    EPS = 1e-8

    def __init__(
        self, inversion: _BatchedInversion, x: torch.Tensor, codes: torch.Tensor, unit_targets: list[torch.Tensor]
    ) -> None:
        settings = inversion.settings
        count, device, dtype = x.shape[0], x.device, x.dtype
        self.inversion, self.settings = inversion, settings
        self.x, self.codes, self.unit_targets = x, codes, unit_targets
        self.per_candidate = (-1,) + (1,) * (x.dim() - 1)
        self.first_moment = torch.zeros_like(x)
        self.second_moment = torch.zeros_like(x)
        self.steps_done = torch.zeros((), device=device, dtype=dtype)
        self.lr = torch.full((), settings.lr, device=device, dtype=dtype)
        self.tv_weight = torch.full((), settings.tv_weight, device=device, dtype=dtype) if inversion.use_tv else None
        self.best_x = x.clone()
        self.best_distance = torch.full((count,), math.inf, device=device, dtype=dtype)
        self.distances = torch.full((count,), math.nan, device=device, dtype=dtype)
        self.active = torch.ones(count, dtype=torch.bool, device=device)
        self.steps_taken = torch.zeros(count, dtype=torch.long, device=device)

    def written(self) -> list[torch.Tensor]:
        """Every tensor :meth:`step` writes."""
        return [
            self.x,
            self.first_moment,
            self.second_moment,
            self.steps_done,
            self.best_x,
            self.best_distance,
            self.distances,
            self.steps_taken,
        ]

    def step(self) -> None:
        input_grad, distances = self.inversion.objective_and_input_grad(
            self.x, self.codes, self.unit_targets, self.tv_weight
        )
        if self.settings.signed_gradients:
            input_grad = input_grad.sign()
        self.distances.copy_(distances)
        improved = (distances < self.best_distance) & self.active
        self.best_x.copy_(torch.where(improved.view(self.per_candidate), self.x, self.best_x))
        self.best_distance.copy_(torch.where(improved, distances, self.best_distance))
        moved = adam_update(
            self.x, input_grad, self.first_moment, self.second_moment, self.steps_done, self.lr, self.BETAS, self.EPS
        )
        # A candidate that met the tolerance stays where it stopped.
        self.x.copy_(torch.where(self.active.view(self.per_candidate), moved.clamp_(*self.settings.bounds), self.x))
        self.steps_taken += self.active


def adam_update(
    x: torch.Tensor,
    gradient: torch.Tensor,
    first_moment: torch.Tensor,
    second_moment: torch.Tensor,
    steps_done: torch.Tensor,
    lr: torch.Tensor,
    betas: tuple[float, float],
    eps: float,
) -> torch.Tensor:
    """One Adam step: updates the moments and the step count in place and returns the moved ``x``.

    The same arithmetic as ``torch.optim.Adam`` (no weight decay, no AMSGrad), with the step count and learning
    rate as tensors so a captured CUDA graph can replay it.
    """
    beta1, beta2 = betas
    steps_done += 1
    first_moment.lerp_(gradient, 1 - beta1)
    second_moment.mul_(beta2).addcmul_(gradient, gradient, value=1 - beta2)
    step_size = lr / (1 - beta1**steps_done)
    denominator = (second_moment.sqrt() / (1 - beta2**steps_done).sqrt()).add_(eps)
    return x - step_size * first_moment / denominator


class _CudaGraphStep:
    """Runs a step function as one CUDA graph replay: per step, one launch instead of the hundreds of kernels a
    double backward through a vmapped model issues, whose launch cost otherwise dominates on a GPU.

    The first ``WARMUP`` calls run eagerly on a side stream (lazy initialisation, kernel selection), as CUDA graph
    capture requires.  The next call captures the step, and checks it before trusting it: the step runs eagerly
    from a copy of ``state`` (every tensor the step writes), the state is put back, the graph is replayed, and the
    two results must agree.  Every later call replays the graph.  A step that cannot be captured (an op in the
    model that waits on the host, say) or whose replay disagrees keeps running eagerly.
    """

    WARMUP = 3

    def __init__(self, step: Callable[[], None], state: list[torch.Tensor]) -> None:
        self.step, self.state = step, state
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.captured = False
        self.failed = False

    def __call__(self) -> None:
        self.calls += 1
        if self.graph is not None:
            self.graph.replay()
        elif self.failed:
            self.step()
        elif self.calls <= self.WARMUP:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            self._capture()

    def _capture(self) -> None:
        before = [tensor.clone() for tensor in self.state]
        self.step()
        expected = [tensor.clone() for tensor in self.state]
        for tensor, saved in zip(self.state, before):
            tensor.copy_(saved)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.step()
            graph.replay()
            agrees = all(
                torch.allclose(tensor, wanted, rtol=1e-5, atol=1e-12) for tensor, wanted in zip(self.state, expected)
            )
        except RuntimeError:
            agrees = False
        if agrees:
            self.graph, self.captured = graph, True
            return
        self.failed = True
        for tensor, wanted in zip(self.state, expected):
            tensor.copy_(wanted)


def _coded_loss(output: torch.Tensor, code: torch.Tensor, kind: str) -> torch.Tensor:
    """:func:`client_loss` with the label given as data (see ``_BatchedInversion._codes``), so it can be vmapped."""
    if kind == CROSS_ENTROPY:
        return -(F.log_softmax(output.reshape(-1), dim=0) * code).sum()
    # softplus(-y*mu) is log(1 + exp(-y*mu)) without overflow for large margins.
    return F.softplus(-code * output.reshape(()))


def _math_attention():
    """Fused attention kernels have no double backward; the attack differentiates through the gradient."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(SDPBackend.MATH)


def _probe_sizes(
    model: nn.Module, sample_shape: tuple[int, ...], device: torch.device, dtype: torch.dtype
) -> tuple[int, int]:
    """(output values for one sample, values all leaf modules produce for it), from one forward pass on zeros."""
    produced = [0]

    def count(_module: nn.Module, _inputs, output) -> None:
        if isinstance(output, torch.Tensor):
            produced[0] += output.numel()

    leaves = [m for m in model.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            output = model(torch.zeros((1,) + sample_shape, device=device, dtype=dtype))
    finally:
        for handle in handles:
            handle.remove()
    return output.numel(), max(produced[0], int(math.prod(sample_shape)))


def _group_size(bytes_per_candidate: int, device: torch.device) -> int:
    """How many candidates fit in one batch within a share of the device's free memory (at least one)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # no sysconf (Windows): assume a modest machine
            free = 4 << 30
    return max(1, int(free * _MEMORY_SHARE) // max(1, bytes_per_candidate))


def _check_budget(steps: int, restarts: int) -> None:
    if steps < 1 or restarts < 1:
        raise ValueError(f"steps and restarts must be at least 1, got {steps} and {restarts}")


def _shared_names(model: nn.Module, target_grads: dict[str, torch.Tensor]) -> list[str]:
    """The model's parameters that ``target_grads`` covers, in the model's order; shapes checked."""
    parameters = dict(model.named_parameters())
    unknown = sorted(set(target_grads) - set(parameters))
    if unknown:
        raise KeyError(f"target_grads names parameters the model does not have: {unknown[:5]}")
    names = [name for name in parameters if name in target_grads]
    if not names:
        raise ValueError("target_grads shares no parameter with the model")
    for name in names:
        if parameters[name].shape != target_grads[name].shape:
            raise ValueError(
                f"gradient for {name} has shape {tuple(target_grads[name].shape)}, "
                f"the parameter {tuple(parameters[name].shape)}"
            )
    return names


def _unit_targets(
    target_grads: dict[str, torch.Tensor], names: list[str], device: torch.device, dtype: torch.dtype
) -> list[torch.Tensor]:
    return unit_gradient([target_grads[name].detach().to(device=device, dtype=dtype) for name in names])


def _candidate_labels(
    model: nn.Module,
    target_grads: dict[str, torch.Tensor],
    spec: LossSpec,
    sample_shape: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
) -> list[int]:
    if spec.label is not None:
        return [int(spec.label)]
    probe = torch.zeros((1,) + sample_shape, device=device, dtype=dtype)
    output_layer = find_output_linear(model, probe)
    weight_grad = bias_grad = None
    if output_layer is not None:
        weight_name, bias_name = output_layer
        weight_grad = target_grads.get(weight_name)
        bias_grad = target_grads.get(bias_name) if bias_name is not None else None
    if spec.kind == CROSS_ENTROPY:
        if weight_grad is None and bias_grad is None:
            raise ValueError(
                "cannot infer the class: the model's output is not produced by an nn.Linear whose "
                "gradient is in target_grads; pass the label explicitly"
            )
        if weight_grad is None:
            return [int(torch.argmin(bias_grad.reshape(-1)).item())]
        return [infer_label_idlg(weight_grad, bias_grad)]
    label = infer_label_logistic(weight_grad, bias_grad)
    return [label] if label is not None else [1, -1]


def _model_on(model: nn.Module, device: torch.device) -> nn.Module:
    """The model itself when it already lives on ``device``; otherwise a copy, so the caller's model is untouched."""
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("the model has no parameters, so there is no gradient to invert")
    if first.device == device:
        return model
    return copy.deepcopy(model).to(device)


def _mix_seed(seed: int, restart: int) -> int:
    return (int(seed) * 1_000_003 + restart) % (2**63 - 1)


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


def psnr_from_mse(mse: float, peak: float = 1.0) -> float:
    return math.inf if mse <= 0 else 10.0 * math.log10(peak * peak / mse)


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
