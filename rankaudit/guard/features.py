"""What a hidden layer's features determine of the sample they were computed from, at the received weights
(docs/method.md, "The client-side guard").

A server that reads sample s's features h(x_s) exactly knows, to first order, x_s's component in the row space of
J = ∂h/∂x at x_s; the component of x_s − μ outside it (μ the batch's mean) stays unknown, and an attacker that fills
it with μ makes an error of exactly that size. The PSNR of μ + P_row(J)(x_s − μ) against x_s is the figure: at or
above the guard's threshold the features are as good as the sample.

J is formed, only for the samples whose features some readout read, from one forward pass to the layer and its
vector-Jacobian products batched; when it would not fit in memory the sample counts as read and the note says so.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from rankaudit.guard.batch import as_model_input, error_line
from rankaudit.guard.jacobian_mode import HiddenPath, KinksCountOn, reaching, without_backward_hooks
from rankaudit.guard.pairs import IDENTICAL_PSNR
from rankaudit.verify.attacks.bias import sample_vectors

# Rows of J per batched backward pass: 64 was the fastest of 32 to 256 on a CPU for Flower's quickstart CNN.
ROWS_PER_PASS = 64
# The most entries of J held at once (float32): 1 GB.
MAX_JACOBIAN_VALUES = 1 << 28
# An eigenvalue of J·Jᵀ counts in J's rank above this share of the largest (float32 rows are exact to about 1e-7,
# so their squares to 1e-14): erring towards a larger row space, which errs towards a higher figure.
RANK_SHARE = 1e-12


class _Reached(Exception):
    """Raised by the hook at the layer: what comes after it does not change its input, so it does not run."""


def _layer_inputs(net: nn.Module, modules: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's input for a batch ``x``, the forward pass stopped once every one of them has run."""
    seen: dict[int, torch.Tensor] = {}

    def reached(mod, args):
        seen.setdefault(id(mod), args[0])
        if len(seen) == len(modules):
            raise _Reached

    hooks = [module.register_forward_pre_hook(reached) for module in modules]
    try:
        net(x)
    except _Reached:
        pass
    finally:
        for hook in hooks:
            hook.remove()
    if len(seen) != len(modules):
        raise RuntimeError("the layer did not run in the model's forward pass")
    return [seen[id(module)] for module in modules]


def _features(net: nn.Module, module: nn.Module | tuple[nn.Module, ...], x: torch.Tensor) -> torch.Tensor | None:
    """The layer's (batch, d) input vectors for a batch ``x``; for several layers, theirs side by side."""
    modules = module if isinstance(module, tuple) else (module,)
    vectors = [sample_vectors(layer, found) for layer, found in zip(modules, _layer_inputs(net, modules, x))]
    if any(found is None for found in vectors):
        return None  # a layer that reads several vectors per sample
    return vectors[0] if len(vectors) == 1 else torch.cat(vectors, dim=1)


def _one_hots(chosen: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    picks = torch.zeros(len(chosen), width, dtype=dtype)
    picks[torch.arange(len(chosen)), chosen] = 1
    return picks


def jacobian(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The rows of ∂(the layer's input vector)/∂x at one sample x that can be non-zero, (rows, x.numel()): one
    forward pass to the layer, then its vector-Jacobian products batched, ROWS_PER_PASS rows at a time.
    Features that are exactly zero (a ReLU off) are left out when one backward of a random mix of them gives an
    exactly zero gradient: their rows are then all zero (a random mix of non-zero rows is not)."""
    sample = x.detach()
    with without_backward_hooks(net):
        _probe_hidden_paths(net, module, sample)
        try:
            with torch.enable_grad(), KinksCountOn() as mode:
                values, pull = torch.func.vjp(lambda one: _features(net, module, one[None])[0], sample)
                mode.watching = False
                wanted = _wanted_rows(values, lambda mix: pull(mix)[0])
                if not len(wanted):
                    return torch.zeros(0, x.numel(), dtype=x.dtype)
                pulled = torch.func.vmap(pull, chunk_size=ROWS_PER_PASS)
                rows = pulled(_one_hots(wanted, len(values), values.dtype))[0]
            return rows.reshape(len(wanted), -1)
        except (RuntimeError, NotImplementedError):
            # An operation vmap cannot batch (a custom autograd function, a data-dependent branch): the same rows,
            # each batch of them from one backward over as many copies of the sample (eval mode: copies do not mix).
            return _jacobian_by_copies(net, module, sample)


def _probe_hidden_paths(net: nn.Module, module: nn.Module, sample: torch.Tensor) -> None:
    """Raises HiddenPath when a value computed from the sample reaches the layer's features around autograd: one
    forward pass that replaces each such value by a leaf, and one backward that asks whether any leaf is reached."""
    with torch.enable_grad(), KinksCountOn(probe=True) as mode:
        features = _features(net, module, sample[None].clone().requires_grad_(True))
        mode.watching = False
        hidden = mode.hidden or (reaching(mode, features) if features is not None else None)
    if hidden:
        raise HiddenPath(hidden)


def _wanted_rows(values: torch.Tensor, gradient_of) -> torch.Tensor:
    """The features whose rows can be non-zero: all, or only the non-zero ones when a random mix of the zero ones
    has an exactly zero gradient."""
    silent = values == 0
    if bool(silent.any()):
        mix = torch.randn(values.shape, generator=torch.Generator().manual_seed(0), dtype=values.dtype) * silent
        grads = gradient_of(mix)
        if grads is None or not bool(grads.any()):
            return torch.nonzero(~silent).flatten()
    return torch.arange(len(values))


def _jacobian_by_copies(net: nn.Module, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad(), KinksCountOn() as mode:
        copy = x[None].clone().requires_grad_(True)
        values = _features(net, module, copy)[0]
        mode.watching = False

        def gradient_of(mix):
            return _gradient_into((values * mix).sum(), copy, keep_graph=True)

        wanted = _wanted_rows(values.detach(), gradient_of)
        rows = []
        for start in range(0, len(wanted), ROWS_PER_PASS):
            chosen = wanted[start : start + ROWS_PER_PASS]
            copies = x.expand(len(chosen), *x.shape).clone().requires_grad_(True)
            mode.watching = True  # the forward pass's stop-gradients followed, as in the first one
            h = _features(net, module, copies)
            mode.watching = False
            grads = _gradient_into(h[torch.arange(len(chosen)), chosen].sum(), copies, keep_graph=False)
            rows.append(torch.zeros(len(chosen), x.numel(), dtype=x.dtype) if grads is None else grads.flatten(1))
    return torch.cat(rows) if rows else torch.zeros(0, x.numel(), dtype=x.dtype)


def _gradient_into(total: torch.Tensor, leaf: torch.Tensor, keep_graph: bool) -> torch.Tensor | None:
    """The gradient of ``total`` in ``leaf`` (None where it does not reach it), by a plain backward pass: a reentrant
    checkpoint refuses torch.autograd.grad, and the guard's copy of the model has no other leaf that takes one."""
    leaf.grad = None
    if total.requires_grad:
        total.backward(retain_graph=keep_graph)
    grads, leaf.grad = leaf.grad, None
    return grads


def determined_psnr(
    net: nn.Module, module: nn.Module, samples: torch.Tensor, indices: list[int], min_psnr: float | None = None
) -> tuple[dict[int, float], list[str]]:
    """({sample: PSNR of what the layer's features determine of it}, notes); ``net`` holds the received weights,
    ``module`` is the layer whose input the features are. With ``min_psnr``, a sample whose upper bound
    (first_layer_bounds) is under it gets the bound, and no Jacobian."""
    figures, notes = determined_by_layer(net, {"": module}, samples, {"": indices}, min_psnr)
    return figures.get("", {}), notes.get("", [])


def determined_by_layer(
    net: nn.Module,
    modules: dict[str, nn.Module],
    samples: torch.Tensor,
    pending: dict[str, list[int]],
    min_psnr: float | None = None,
) -> tuple[dict[str, dict[int, float]], dict[str, list[str]]]:
    """determined_psnr for several layers at once ({layer: samples} in, {layer: {sample: PSNR}} and {layer: notes}
    out). With ``min_psnr`` and more than one layer, the first layer's bound is formed once per sample for the
    features of all those layers together (an upper bound for each of them); a sample it does not settle gets each
    layer's own bound, then its Jacobian."""
    wanted = {name: indices for name, indices in pending.items() if indices}
    x_all = as_model_input(net, samples)
    if not x_all.is_floating_point():  # token ids: no Jacobian in them, and features that read them determine them
        return {name: dict.fromkeys(indices, IDENTICAL_PSNR) for name, indices in wanted.items()}, {
            name: [
                f"samples {indices[:8]}: the samples are token ids, and what their features determine of them is "
                "not measured: the features count as the samples"
            ]
            for name, indices in wanted.items()
        }
    mean = _prior_mean(x_all)
    # Before any bound or Jacobian: both are first-order figures, and a normalised sample fools them alike.
    normalised, normalised_said = _normalised_samples(net, {name: modules[name] for name in wanted}, x_all, wanted)
    wanted = {
        name: [index for index in indices if index not in normalised.get(name, ())] for name, indices in wanted.items()
    }
    together: dict[int, float] = {}
    if min_psnr is not None and sum(1 for indices in wanted.values() if indices) > 1:
        everyone = sorted({index for indices in wanted.values() for index in indices})
        bounds = first_layer_bounds(net, tuple(modules[name] for name in wanted), x_all, mean, everyone)
        together = {index: bound for index, bound in bounds.items() if bound < min_psnr}
    figures, notes = {}, {}
    for name, indices in wanted.items():
        settled = {index: together[index] for index in indices if index in together}
        rest = [index for index in indices if index not in settled]
        found, said = _determined(net, modules[name], x_all, mean, rest, min_psnr) if rest else ({}, [])
        figures[name], notes[name] = {**settled, **found}, said
    for name, indices in normalised.items():
        found, said = _normalised_figures(net, modules[name], x_all, mean, indices)
        figures[name].update(found)
        notes[name] = normalised_said[name] + said + notes[name]
    return figures, notes


def _normalised_figures(
    net: nn.Module, module: nn.Module, x_all: torch.Tensor, mean: torch.Tensor, indices: list[int]
) -> tuple[dict[int, float], list[str]]:
    """What the features of normalised samples show of them. When the features' Jacobian has the rank of the
    sample less its scales and offsets (one of each per channel), the features are the normalised sample and count
    as the sample. With a lower rank (a narrowing before or after the normalisation, or pooling), the figure is the
    first-order one with two more directions seen: the sample itself and the constant, as the first Linear that
    reads the sample sees them (all of them, without one), for the normalised vector's scale and offset that a
    server puts back; never below the plain first-order figure."""
    found: dict[int, float] = {}
    reduced, said = [], []
    size = x_all[0].numel()
    channels = x_all.shape[1] if x_all.dim() > 2 else 1
    reader = _reading_rows(net, size)
    for index in indices:
        try:
            rows = jacobian(net, module, x_all[index]).to(torch.float64)
        except HiddenPath as hidden:
            found[index] = IDENTICAL_PSNR
            line = (
                f"the model {hidden} on the way to this layer, a path the features' Jacobian does not see: the "
                "features of the samples it reads count as the samples"
            )
            said += [line] if line not in said else []
            continue
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            found[index] = IDENTICAL_PSNR
            continue
        space = _row_space(rows)
        if space is None or len(space[1]) >= size - 2 * channels - 1:
            found[index] = IDENTICAL_PSNR  # the normalised sample itself, less only its scales and offsets
            continue
        # A narrowing: the features' value tells the normalised vector's direction as far as they fix it, and the
        # server puts back the scale and offset that the normalisation took. Those two directions, as the layer
        # that first reads the sample sees them, are added to the Jacobian's rows.
        x = x_all[index].to(torch.float64).flatten()
        seen = torch.stack([x, torch.ones_like(x)])
        if reader is not None:
            seen = seen @ reader.T @ reader
        widened = torch.cat([rows, seen])
        wide = _row_space(widened)
        found[index] = max(
            _psnr_outside(rows, *space, (x - mean)[None], x[None])[0],
            IDENTICAL_PSNR if wide is None else _psnr_outside(widened, *wide, (x - mean)[None], x[None])[0],
        )
        reduced.append((index, len(space[1])))
    if not reduced:
        return found, said
    ranks = sorted({rank for _, rank in reduced})
    return found, said + [
        f"samples {[index for index, _ in reduced][:8]}: the normalised features fix {ranks[0]}"
        f"{'' if len(ranks) == 1 else f'-{ranks[-1]}'} of the sample's {size} values: judged with their scale and "
        "offset known to the server"
    ]


# The step of the invariance test: each sample scaled by (1 + step), and shifted by step times its own range.
INVARIANCE_STEP = 1e-2
# A scaling or shift that moves the features by at most this share of what a random change of the same size does
# leaves them unmoved: the features do not see the sample's scale or offset (or see it through a term a few
# hundredths the size of the rest, which a server that knows the data's range reads past just as well).
QUIET_SHARE = 3e-2
# Features that move by less than this share of their size under that step count as not moving: float32 rounding
# moves them by about 1e-7, a model that reads the sample's scale or offset at all by about the step itself.
INVARIANT_CHANGE = 1e-4


def _normalised_samples(
    net: nn.Module, modules: dict[str, nn.Module], x_all: torch.Tensor, wanted: dict[str, list[int]]
) -> tuple[dict[str, list[int]], dict[str, list[str]]]:
    """({layer: its samples whose features do not change when the sample is scaled or shifted}, {layer: notes}).
    A model that normalises each sample before the layer (LayerNorm, a per-sample standardisation, F.normalize,
    RMSNorm, InstanceNorm or GroupNorm: each is blind to the whole sample's scale) puts the sample's own direction
    in the null space of the features' Jacobian, so the first-order figure counts that direction as unknown; but
    the features' value is the normalised sample, and a server that knows the data's range (0 to 255, 0 to 1) maps
    it back. Such a sample's features count as the sample, unless a change of the same size in a random direction
    does not move them either. One batched forward pass to all the layers."""
    everyone = sorted({index for indices in wanted.values() for index in indices})
    if not everyone or not x_all.is_floating_point():
        return {}, {}
    x = x_all[everyone]
    # Half-precision samples round far above float32: the test's threshold and step follow the dtype's rounding.
    change = max(INVARIANT_CHANGE, 10 * torch.finfo(x.dtype).eps)
    step = max(INVARIANCE_STEP, 10 * change)
    # Features that follow the sample move under a scaling about as much as under a random change of its size; a
    # normalisation moves them by its rounding alone (float32: a ten-thousandth of that change, or less).
    quiet = max(QUIET_SHARE, 30 * torch.finfo(x.dtype).eps / step)
    rounding = 30 * torch.finfo(x.dtype).eps
    flat = x.flatten(1)
    spread = flat.max(1).values - flat.min(1).values
    # A flat sample has no range: it is shifted by its own size (or by one) instead.
    spread = torch.where(spread > 0, spread, flat.abs().max(1).values.clamp(min=1))
    shape = (-1, *[1] * (x.dim() - 1))
    shifted = x + step * spread.reshape(shape)
    # A change of the scaling's size in a random direction: features it does not move either are not normalised,
    # they are locally constant (every ReLU before them off), and the Jacobian's figure already sees that.
    nudge = torch.randn(x.shape, generator=torch.Generator().manual_seed(0)).to(x.dtype)
    norms = flat.norm(dim=1)
    reach = step * torch.where(norms > 0, norms, float(flat.shape[1]) ** 0.5)
    nudged = x + nudge * (reach / nudge.flatten(1).norm(dim=1)).reshape(shape)
    names = list(modules)
    layers = tuple(modules[name] for name in names)
    try:
        with torch.no_grad():
            values = _layer_inputs(net, layers, torch.cat([x, x * (1 + step), shifted, nudged]))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return {}, {}  # a model that does not run on these copies: the Jacobian's own path decides
    found, notes = {}, {}
    scalable = norms > 0  # a zero sample is its own scaling
    for name, layer, value in zip(names, layers, values):
        vectors = sample_vectors(layer, value)
        if vectors is None:
            continue  # several vectors per sample: the Jacobian is not formed either, and they count as the sample
        base, scaled, moved, other = vectors.detach().to(torch.float64).reshape(4, len(everyone), -1)
        size = base.norm(dim=1)
        # Against what a random change of the same size does, not against the features' own size: a large constant
        # part of the features (a big offset) would make any change look small.
        around = (other - base).norm(dim=1)
        still = ((scaled - base).norm(dim=1) <= quiet * around) & scalable
        still |= (moved - base).norm(dim=1) <= quiet * around
        # The random change must move them above their own rounding (a large constant part of the features, a
        # normalisation's offset set high, does not count as moving them).
        still &= (size > 0) & torch.isfinite(size) & (around > rounding * size)
        mine = set(wanted[name])
        hits = [index for index, flag in zip(everyone, still.tolist()) if flag and index in mine]
        if hits:
            found[name] = hits
            notes[name] = [
                f"samples {hits[:8]}: the features do not change when the sample is scaled or shifted (each sample "
                "is normalised before this layer): a server that knows the data's range puts the scale back, so "
                "the features count as the samples"
            ]
    return found, notes


def _reading_rows(net: nn.Module, size: int) -> torch.Tensor | None:
    """An orthonormal basis (rows) of the row space of the model's first Linear that reads the whole sample
    (``size`` inputs) and has fewer outputs: what that layer can see of the sample; None without one."""
    for module in net.modules():
        if isinstance(module, nn.Linear) and module.in_features == size and module.out_features < size:
            basis, singular, _ = torch.linalg.svd(module.weight.detach().to(torch.float64).T, full_matrices=False)
            kept = singular > RANK_SHARE * singular.max() if len(singular) and singular.max() > 0 else singular > 0
            return basis[:, kept].T
    return None


def _prior_mean(x_all: torch.Tensor) -> torch.Tensor:
    """The flat float64 prior an attacker fills the undetermined part with: the batch's mean sample; for a batch of
    one, the sample's own average value per channel."""
    flat = x_all.flatten(1)
    if flat.dtype in (torch.float16, torch.float32, torch.float64) and flat.device.type == "cpu":
        # NumPy sums float32 rows into a float64 total without a float64 copy of the batch (three times faster).
        mean = torch.from_numpy(flat.detach().numpy().sum(0, dtype=np.float64))
    else:  # summed in float64 a chunk at a time: a float64 copy of thousands of samples at once is costly
        mean = torch.zeros(flat.shape[1], dtype=torch.float64)
        for chunk in flat.split(256):
            mean += chunk.to(torch.float64).sum(0)
    mean /= max(len(flat), 1)
    if len(flat) == 1:
        # One sample: its batch mean is the sample itself, a prior no server has. Its own average value per channel
        # (a flat image of its colour) is as much as a server could guess without it, and more.
        one = x_all[0].to(torch.float64)
        rows = one.reshape(len(one), -1) if one.dim() > 1 else one.reshape(1, -1)
        mean = rows.mean(1, keepdim=True).expand_as(rows).flatten().clone()
    return mean


def _determined(
    net: nn.Module, module: nn.Module, x_all: torch.Tensor, mean: torch.Tensor, indices: list[int], min_psnr
) -> tuple[dict[int, float], list[str]]:
    """One layer's figures: its first layer's bound where that is under ``min_psnr``, else the Jacobian's."""
    found, notes, hidden_said, failed_said = {}, [], False, False
    if min_psnr is not None and indices:
        bounds = first_layer_bounds(net, module, x_all, mean, indices)
        found.update({index: bound for index, bound in bounds.items() if bound < min_psnr})
    width = None
    for index in indices:
        if index in found:
            continue
        if width is None:
            with torch.no_grad():
                width = _features(net, module, x_all[:1]).shape[1]
        if width * x_all[0].numel() > MAX_JACOBIAN_VALUES:
            found[index] = IDENTICAL_PSNR
            notes.append(
                f"sample {index}: the Jacobian of {width} features in {x_all[0].numel()} inputs does not fit in "
                "memory; its features count as the sample"
            )
            continue
        try:
            rows = jacobian(net, module, x_all[index]).to(torch.float64)
        except HiddenPath as hidden:
            found[index] = IDENTICAL_PSNR
            if not hidden_said:  # one line for the layer, not one per sample
                hidden_said = True
                notes.append(
                    f"the model {hidden} on the way to this layer, a path the features' Jacobian does not see: "
                    "the features of the samples it reads count as the samples"
                )
            continue
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
            found[index] = IDENTICAL_PSNR
            if not failed_said:
                failed_said = True
                notes.append(
                    f"the features' Jacobian could not be formed ({error_line(error)[:160]}): the features of the "
                    "samples this layer reads count as the samples"
                )
            continue
        x = x_all[index].to(torch.float64).flatten()
        found[index] = _psnr_of_determined(rows, x - mean, x)
    return found, notes


def _reached_outputs(net: nn.Module, module: nn.Module, first: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """_reached_with_hooks_aside, the model's backward hooks set aside (the gradient is the forward pass's own)."""
    try:
        with without_backward_hooks(net):
            return _reached_with_hooks_aside(net, module, first, x)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None  # a backward the model does not allow here (a reentrant checkpoint): the Jacobian decides


def _reached_with_hooks_aside(net: nn.Module, module: nn.Module, first: nn.Module, x: torch.Tensor):
    """Which of ``first``'s outputs reach ``module``'s input, per sample of the batch ``x`` (bool, the outputs'
    shape), when ``first`` reads the sample itself (its input's Jacobian in the sample is the identity) and every
    path from the sample to ``module``'s input goes through it; None otherwise. Random mixes of the features,
    backward: the gradient around ``first`` must be exactly zero, the one at its outputs is non-zero exactly where
    an output reaches a feature (ReLU and max-pool zeros are exact; a random mix of non-zero entries is not zero),
    and the gradient of a random mix of its input, taken in the sample, must be that mix."""
    inputs, outputs = [], []
    mode = KinksCountOn(probe=True)

    def cut(mod, args, out):
        mode.watching = False  # the cut's own detach is not the model's
        inputs.append(args[0])
        outputs.append(mod.forward(args[0].detach()).detach().requires_grad_(True))
        mode.watching = True
        return outputs[-1].clone()  # not the leaf itself: the model may change its output in place (ReLU(inplace))

    generator = torch.Generator().manual_seed(0)
    hook = first.register_forward_hook(cut)
    try:
        with torch.enable_grad(), mode:
            sample = x.detach().clone().requires_grad_(True)
            features = _features(net, module, sample)
    except (RuntimeError, TypeError, ValueError):
        return None  # a model the cut does not run through: no bound, the Jacobian decides
    finally:
        hook.remove()
    if mode.hidden or (features is not None and reaching(mode, features)):
        return None  # a path autograd does not see: no bound, and the Jacobian's figure says so
    if len(inputs) != 1 or features is None or not inputs[0].requires_grad or inputs[0].numel() != sample.numel():
        return None
    reached = torch.zeros(outputs[0].shape, dtype=torch.bool)
    with torch.enable_grad():
        for _ in range(2 if features.requires_grad else 0):
            mix = torch.randn(features.shape, generator=generator, dtype=features.dtype)
            around, through = torch.autograd.grad(
                (features * mix).sum(), [sample, outputs[0]], allow_unused=True, retain_graph=True
            )
            if around is not None and bool(around.any()):
                return None
            if through is not None:
                reached |= through != 0
        mix = torch.randn(inputs[0].shape, generator=generator, dtype=inputs[0].dtype)
        (into,) = torch.autograd.grad((inputs[0] * mix).sum(), sample, allow_unused=True)
    return reached if into is not None and bool(torch.equal(into.reshape(mix.shape), mix)) else None


def first_layer_bounds(
    net: nn.Module,
    module: nn.Module | tuple[nn.Module, ...],
    x_all: torch.Tensor,
    mean: torch.Tensor,
    indices: list[int],
) -> dict[int, float]:
    """{sample: an upper bound on the PSNR of what the layer's features determine of it}, without its Jacobian,
    when a first layer reads the sample itself and every path from the sample to the features goes through it:
    then J = (∂h/∂z)·A (z the first layer's output, A its weights as a linear map), so J's row space lies in the
    span of A's rows whose outputs reach the features, and the part of x − μ in that span bounds the part in
    J's. A Linear with fewer outputs than inputs: W's row space, one for every sample. A convolution without
    padding: the filter placements that reach the features, per sample. {} when no such layer is found; a
    sample whose bound cannot be formed is left out. For several layers (a tuple), the features of all of them
    side by side: each layer's features are some of them, so the bound is one for each layer."""
    size = x_all[0].numel()
    chosen = x_all[indices]
    xs = chosen.to(torch.float64).reshape(len(indices), -1)
    layers = module if isinstance(module, tuple) else (module,)
    for first in net.modules():
        if any(first is layer for layer in layers):
            continue
        if isinstance(first, nn.Linear) and first.in_features == size and first.out_features < size:
            if _reached_outputs(net, module, first, chosen) is None:
                continue
            weight = first.weight.detach().to(torch.float64)
            space = _row_space(weight)
            # Every direction of W's row space must count: one the rank cut-off dropped could be amplified by the
            # layers after it (a server chooses them), and the bound would then be under the exact figure.
            if space is None or len(space[1]) < min(weight.shape) or space[1].min() < WELL_CONDITIONED * space[1].max():
                return {}
            return dict(zip(indices, _psnr_outside(weight, *space, xs - mean, xs)))
        if _plain_convolution(first, x_all[0].shape):
            reached = _reached_outputs(net, module, first, chosen)
            if reached is None:
                continue
            bounds = _placement_bounds(first, reached, xs - mean, xs, x_all[0].shape)
            return {index: bound for index, bound in zip(indices, bounds) if bound is not None}
    return {}


# The first Linear layer's bound is used only when W·Wᵀ's eigenvalues all lie within this share of the largest: its
# eigenvectors are then exact to float64's rounding, and no direction of W's row space is lost to the rank cut-off.
WELL_CONDITIONED = 1e-8

# The shift under the placements' unit-diagonal Gram matrix G: a Cholesky factor of G − SHIFT·I exists only when
# every eigenvalue of G is above SHIFT, and then bᵀ(G − SHIFT·I)⁻¹b is at least bᵀG⁻¹b, the projection it bounds
# (float64 rounding, about 1e-13 of G, is far under the shift). The quickstart CNN's placements have eigenvalues
# of 0.06 to 1.7 on photographs; a shift of 1e-3 loosens the bound by a few percent of the projection at most.
SHIFT = 1e-3


def _plain_convolution(layer: nn.Module, shape: torch.Size) -> bool:
    """A 2-D convolution over the whole sample without padding, dilation or groups: each output is the dot product
    of a filter with one patch, so placements' overlaps are the filters' correlations."""
    return (
        isinstance(layer, nn.Conv2d)
        and len(shape) == 3
        and layer.in_channels == shape[0]
        and layer.groups == 1
        and tuple(layer.dilation) == (1, 1)
        and (layer.padding == "valid" or tuple(layer.padding) == (0, 0))
    )


def _placement_bounds(
    conv: nn.Conv2d, reached: torch.Tensor, deviations: torch.Tensor, xs: torch.Tensor, shape: torch.Size
) -> list[float | None]:
    """For each sample: an upper bound on the PSNR of the mean plus the deviation's part in the span of the
    filter placements that reach the features (None when their Gram matrix is not safely positive definite, or
    they are as many as the sample's values)."""
    weight = conv.weight.detach().to(torch.float64)
    channels, (k1, k2), (s1, s2) = len(weight), weight.shape[2:], conv.stride
    norms = weight.flatten(1).norm(dim=1)
    # The placements' correlations, each placement scaled to unit norm, laid out over every offset two output
    # positions can have (zero where the filters do not overlap): entry [c, d, h1 + Δ1, h2 + Δ2] is placement
    # (c, o) · placement (d, o + Δ / stride), so that one gather with an index that sums a term of each
    # placement fills a sample's Gram matrix.
    h1, h2 = max((reached.shape[2] - 1) * s1, k1 - 1), max((reached.shape[3] - 1) * s2, k2 - 1)
    table = torch.zeros(channels, channels, 2 * h1 + 1, 2 * h2 + 1, dtype=torch.float64)
    scale = torch.where(norms > 0, norms, 1.0)
    correlation = (
        nn.functional.conv2d(weight, weight, padding=(k1 - 1, k2 - 1))
        / (scale[:, None] * scale[None, :])[:, :, None, None]
    )
    table[:, :, h1 - k1 + 1 : h1 + k1, h2 - k2 + 1 : h2 + k2] = correlation
    size1, size2 = table.shape[2:]
    table = table.flatten()
    responses = nn.functional.conv2d(deviations.reshape(len(deviations), *shape), weight, stride=conv.stride)
    if responses.shape != reached.shape:
        return [None] * len(deviations)  # the layer reads the sample's values laid out in another shape
    bounds: list[float | None] = [None] * len(deviations)
    # Every sample's placements at once, each sample's ordered by position, row first: placements that overlap
    # lie within a band of the order.
    sample, row, column, channel = torch.nonzero(
        (reached & (norms > 0)[None, :, None, None]).permute(0, 2, 3, 1), as_tuple=True
    )
    # int32 indices (the table has far fewer than 2³¹ entries) gather twice as fast as int64.
    first = (channel * (channels * size1 * size2) - row * (s1 * size2) - column * s2).int()
    second = (channel * (size1 * size2) + row * (s1 * size2) + column * s2 + h1 * size2 + h2).int()
    b = responses[sample, channel, row, column] / norms[channel]
    counts = torch.bincount(sample, minlength=len(deviations)).tolist()
    parts = zip(*(part.split(counts) for part in (first, second, b, row)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for number, (deviation, x, (first_, second_, b_, row_)) in enumerate(zip(deviations, xs, parts)):
            if len(row_) >= deviation.numel():
                continue
            seen = _seen_through_band(table, first_, second_, b_, row_, (k1 - 1) // s1)
            bounds[number] = None if seen is None else _psnr_with_seen(deviation, x, seen)
    finally:
        torch.set_num_threads(threads)
    return bounds


# The smallest block of the banded factorisation: narrower blocks cost more in calls than they save in arithmetic.
MIN_BLOCK = 64


def _blocks(row: torch.Tensor, reach: int) -> list[tuple[int, int]]:
    """[(start, stop)]: consecutive blocks of the placements (``row`` ascending), each ``reach`` rows of placements
    or more (at least MIN_BLOCK placements where the rows allow), so that two blocks with one between them lie more
    than ``reach`` rows apart: the Gram matrix is block tridiagonal in them. A block as tall as the band is no
    wider than the band is in that part of the sample."""
    groups = torch.div(row, max(reach, 1), rounding_mode="floor")
    starts = [0] + (torch.nonzero(groups[1:] != groups[:-1]).flatten() + 1).tolist()
    blocks: list[tuple[int, int]] = []
    for start, stop in zip(starts, starts[1:] + [len(row)]):
        if blocks and blocks[-1][1] - blocks[-1][0] < MIN_BLOCK:
            blocks[-1] = (blocks[-1][0], stop)
        else:
            blocks.append((start, stop))
    return blocks


def _gram_block(table: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """The placements' Gram matrix entries [i, j] = table[first[i] + second[j]], (len(first), len(second))."""
    return table.index_select(0, (first[:, None] + second[None, :]).flatten()).view(len(first), len(second))


def _seen_through_band(
    table: torch.Tensor, first: torch.Tensor, second: torch.Tensor, b: torch.Tensor, row: torch.Tensor, reach: int
) -> float | None:
    """bᵀ(G − SHIFT·I)⁻¹b for the placements' Gram matrix G (entries as _gram_block gives them), or None when
    G − SHIFT·I has no Cholesky factor. Placements whose rows (``row``, ascending) lie more than ``reach`` apart do
    not overlap, so their entry is exactly zero and G is block tridiagonal in blocks of at least ``reach`` rows
    (_blocks): its Cholesky factor is formed a block at a time (L_kk L_kkᵀ = G_kk − C Cᵀ with
    C = G_k,k-1 L_k-1⁻ᵀ), the same factor as the whole matrix's, with the arithmetic of a band instead of a cube.
    (One sample at a time: samples formed together would all take the widest band and the most blocks, twice the
    arithmetic on photographs.)"""
    count = len(first)
    if not count:
        return 0.0
    seen, previous = 0.0, None
    for start, stop in _blocks(row, reach):
        block = _gram_block(table, first[start:stop], second[start:stop])
        block.diagonal().sub_(SHIFT)
        rhs = b[start:stop, None]
        if previous is not None:
            factor, solved, (before, after) = previous
            coupling = _gram_block(table, first[start:stop], second[before:after])
            c = torch.linalg.solve_triangular(factor, coupling.T, upper=False).T
            block -= c @ c.T
            rhs = rhs - c @ solved
        factor, info = torch.linalg.cholesky_ex(block)
        if int(info) != 0:
            return None
        solved = torch.linalg.solve_triangular(factor, rhs, upper=False)
        seen += float((solved**2).sum())
        previous = (factor, solved, (start, stop))
    return seen


def _psnr_of_determined(jacobian: torch.Tensor, deviation: torch.Tensor, x: torch.Tensor) -> float:
    """PSNR of μ + P_row(J)(x − μ) against x: the error is the part of the deviation outside J's row space,
    |P v|² = (Jv)ᵀ (J Jᵀ)⁺ (Jv)."""
    space = _row_space(jacobian)
    if space is None:
        return IDENTICAL_PSNR  # a Jacobian that cannot be read: assume the features determine the sample
    return _psnr_outside(jacobian, *space, deviation[None], x[None])[0]


def _row_space(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(eigenvectors, eigenvalues) of rows·rowsᵀ that count in the rows' rank; None when a row is not finite."""
    gram = rows @ rows.T
    # A row with an infinity or a NaN has one on the diagonal (the squares of float32 values cannot overflow).
    if not bool(torch.isfinite(gram.diagonal()).all()):
        return None
    # A few hundred rows gain nothing from LAPACK's threads, and lose seconds to them on shared cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        values, vectors = torch.linalg.eigh(gram)
    finally:
        torch.set_num_threads(threads)
    kept = values > RANK_SHARE * values.max() if len(values) and values.max() > 0 else values > math.inf
    return vectors[:, kept], values[kept]


def _psnr_outside(
    rows: torch.Tensor, vectors: torch.Tensor, values: torch.Tensor, deviations: torch.Tensor, xs: torch.Tensor
) -> list[float]:
    """For each (deviation, sample) row pair: the PSNR of the mean plus the deviation's part in the rows' row
    space, against the sample."""
    seen = ((vectors.T @ (rows @ deviations.T)) ** 2 / values[:, None]).sum(0)
    return [_psnr_with_seen(deviation, x, part) for deviation, x, part in zip(deviations, xs, seen.tolist())]


def _psnr_with_seen(deviation: torch.Tensor, x: torch.Tensor, seen: float) -> float:
    """PSNR against x of the mean plus a part of the deviation whose squared norm is ``seen``."""
    unknown = max(float(deviation @ deviation) - seen, 0.0)
    spread = float(x.max() - x.min()) or 1.0
    mse = unknown / x.numel()
    return IDENTICAL_PSNR if mse <= 0 else min(IDENTICAL_PSNR, 10 * math.log10(spread**2 / mse))
