"""Inverting gradients' batched optimisation: every (image, label, restart) candidate stepped by Adam at once."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify.attacks.invert_match import (
    CROSS_ENTROPY,
    LOGISTIC,
    _coded_loss,
    gradient_distances,
    total_variations,
)

ProgressCallback = Callable[[int, int], None]

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


def _mix_seed(seed: int, restart: int) -> int:
    return (int(seed) * 1_000_003 + restart) % (2**63 - 1)
