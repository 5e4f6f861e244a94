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

import numpy as np
import torch
from torch import nn

from rankaudit.guard.batch import as_model_input, error_line
from rankaudit.guard.jacobian_mode import HiddenPath, KinksCountOn, reaching, without_backward_hooks
from rankaudit.guard.pairs import IDENTICAL_PSNR
from rankaudit.guard.placements import (
    RANK_SHARE,
    WELL_CONDITIONED,
    placement_bounds,
    plain_convolution,
    psnr_of_determined,
    psnr_outside,
    row_space,
)
from rankaudit.verify.attacks.bias import sample_vectors

# Rows of J per batched backward pass: 64 was the fastest of 32 to 256 on a CPU for Flower's quickstart CNN.
ROWS_PER_PASS = 64
# The most entries of J held at once (float32): 1 GB.
MAX_JACOBIAN_VALUES = 1 << 28


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
    for index, rows in _jacobians(net, module, x_all, indices, said):
        if rows is None:
            found[index] = IDENTICAL_PSNR
            continue
        space = row_space(rows)
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
        # At the size of the Jacobian's largest row: the rank cut-off is a share of the largest, and must not drop J's
        # own rows beside these two.
        lengths = seen.norm(dim=1, keepdim=True)
        largest = rows.norm(dim=1).max() if len(rows) else 1.0
        seen = torch.where(lengths > 0, seen / lengths.clamp_min(1e-300), seen) * largest
        widened = torch.cat([rows, seen])
        wide = row_space(widened)
        found[index] = max(
            psnr_outside(rows, *space, (x - mean)[None], x[None])[0],
            IDENTICAL_PSNR if wide is None else psnr_outside(widened, *wide, (x - mean)[None], x[None])[0],
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
# The step of the second test, for samples whose features the first step's random change left within their own
# rounding (features with a large constant part, as a normalisation's offset set in the thousands gives them).
LARGE_INVARIANCE_STEP = 0.5
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
    does not move them either. One batched forward pass to all the layers; a second, with a larger change, for the
    samples whose features the first left within their own rounding (a normalisation's offset set high)."""
    everyone = sorted({index for indices in wanted.values() for index in indices})
    if not everyone or not x_all.is_floating_point():
        return {}, {}
    x = x_all[everyone]
    names = list(modules)
    layers = tuple(modules[name] for name in names)
    # Half-precision samples round far above float32: the test's threshold and step follow the dtype's rounding.
    change = max(INVARIANT_CHANGE, 10 * torch.finfo(x.dtype).eps)
    tested = _invariance(net, layers, x, max(INVARIANCE_STEP, 10 * change))
    if tested is None:
        return {}, {}  # a model that does not run on these copies: the Jacobian's own path decides
    still, unresolved = tested
    again = torch.stack(unresolved).any(dim=0) if unresolved else torch.zeros(len(everyone), dtype=torch.bool)
    if bool(again.any()):
        retested = _invariance(net, layers, x[again], LARGE_INVARIANCE_STEP)
        if retested is not None:
            for layer_still, layer_unresolved, found_still in zip(still, unresolved, retested[0]):
                layer_still[again] |= found_still & layer_unresolved[again]
    found, notes = {}, {}
    for name, layer_still in zip(names, still):
        mine = set(wanted[name])
        hits = [index for index, flag in zip(everyone, layer_still.tolist()) if flag and index in mine]
        if hits:
            found[name] = hits
            notes[name] = [
                f"samples {hits[:8]}: the features do not change when the sample is scaled or shifted (each sample "
                "is normalised before this layer): a server that knows the data's range puts the scale back, so "
                "the features count as the samples"
            ]
    return found, notes


def _invariance(
    net: nn.Module, layers: tuple[nn.Module, ...], x: torch.Tensor, step: float
) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """([per layer: each sample's features do not change under the scaling or the shift], [per layer: a random
    change of the same size left them within their own rounding, so the test says nothing]) for the samples ``x``
    scaled by (1 + step) and shifted by step times their own range; None when the model does not run on them.
    Layers with several vectors per sample are all False (their Jacobian is not formed either, and they count as
    the sample)."""
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
    try:
        with torch.no_grad():
            values = _layer_inputs(net, layers, torch.cat([x, x * (1 + step), shifted, nudged]))
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return None
    scalable = norms > 0  # a zero sample is its own scaling
    stills, unresolved = [], []
    for layer, value in zip(layers, values):
        vectors = sample_vectors(layer, value)
        if vectors is None:
            stills.append(torch.zeros(len(x), dtype=torch.bool))
            unresolved.append(torch.zeros(len(x), dtype=torch.bool))
            continue
        base, scaled, moved, other = vectors.detach().to(torch.float64).reshape(4, len(x), -1)
        size = base.norm(dim=1)
        # Against what a random change of the same size does, not against the features' own size: a large constant
        # part of the features (a big offset) would make any change look small.
        around = (other - base).norm(dim=1)
        still = ((scaled - base).norm(dim=1) <= quiet * around) & scalable
        still |= (moved - base).norm(dim=1) <= quiet * around
        # The random change must move them above their own rounding (a large constant part of the features, a
        # normalisation's offset set high, does not count as moving them): else a larger change is tried.
        usable = (size > 0) & torch.isfinite(size)
        stills.append(still & usable & (around > rounding * size))
        unresolved.append(usable & (around <= rounding * size))
    return stills, unresolved


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


def _jacobians(net: nn.Module, module: nn.Module, x_all: torch.Tensor, indices: list[int], notes: list[str]):
    """(sample, its features' Jacobian rows in float64, or None) for each sample: None where the rows cannot be
    formed (they would not fit in memory, the model passes the sample around autograd, or autograd fails), and then
    the features count as the sample; ``notes`` gets the line that says why (once per layer for the last two)."""
    width, said = None, set()
    for index in indices:
        if width is None:
            with torch.no_grad():
                width = _features(net, module, x_all[:1]).shape[1]
        if width * x_all[0].numel() > MAX_JACOBIAN_VALUES:
            notes.append(
                f"sample {index}: the Jacobian of {width} features in {x_all[0].numel()} inputs does not fit in "
                "memory; its features count as the sample"
            )
            yield index, None
            continue
        try:
            rows = jacobian(net, module, x_all[index]).to(torch.float64)
        except HiddenPath as hidden:
            kind = "hidden"
            line = (
                f"the model {hidden} on the way to this layer, a path the features' Jacobian does not see: "
                "the features of the samples it reads count as the samples"
            )
        except (RuntimeError, NotImplementedError, TypeError, ValueError) as error:
            kind = "failed"
            line = (
                f"the features' Jacobian could not be formed ({error_line(error)[:160]}): the features of the "
                "samples this layer reads count as the samples"
            )
        else:
            yield index, rows
            continue
        if kind not in said:  # one line for the layer of each kind, not one per sample
            said.add(kind)
            notes.append(line)
        yield index, None


def _determined(
    net: nn.Module, module: nn.Module, x_all: torch.Tensor, mean: torch.Tensor, indices: list[int], min_psnr
) -> tuple[dict[int, float], list[str]]:
    """One layer's figures: its first layer's bound where that is under ``min_psnr``, else the Jacobian's."""
    found, notes = {}, []
    if min_psnr is not None and indices:
        bounds = first_layer_bounds(net, module, x_all, mean, indices)
        found.update({index: bound for index, bound in bounds.items() if bound < min_psnr})
    for index, rows in _jacobians(net, module, x_all, [index for index in indices if index not in found], notes):
        if rows is None:
            found[index] = IDENTICAL_PSNR
            continue
        x = x_all[index].to(torch.float64).flatten()
        found[index] = psnr_of_determined(rows, x - mean, x)
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
            space = row_space(weight)
            # Every direction of W's row space must count: one the rank cut-off dropped could be amplified by the
            # layers after it (a server chooses them), and the bound would then be under the exact figure.
            if space is None or len(space[1]) < min(weight.shape) or space[1].min() < WELL_CONDITIONED * space[1].max():
                return {}
            return dict(zip(indices, psnr_outside(weight, *space, xs - mean, xs)))
        if plain_convolution(first, x_all[0].shape):
            reached = _reached_outputs(net, module, first, chosen)
            if reached is None:
                continue
            bounds = placement_bounds(first, reached, xs - mean, xs, x_all[0].shape)
            return {index: bound for index, bound in zip(indices, bounds) if bound is not None}
    return {}
