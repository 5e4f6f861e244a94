"""The guard's checks on one update: the received weights against the audited model, then the readouts a server can
form from each layer with a bias, judged by their PSNR against the client's own samples (docs/method.md, "The
client-side guard").

The model runs here (one forward and one backward pass at the received weights, in chunks): what each readout layer
reads from each sample, and each sample's signal at each unit. rankaudit.guard.pairs forms the readouts from the
update as sent and scores them; rankaudit.guard.features says what a hidden layer's features determine of the
sample.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import torch
from torch import nn

from rankaudit.guard.batch import as_model_input
from rankaudit.guard.pairs import (
    EVERY_PAIR_MOST,
    adam_undone,
    bias_rate,
    bias_slack,
    decay_share,
    duplicates,
    every_pair,
    few_values,
    fitted_squares,
    isolating_and_nearly,
    isolating_groups,
    merged,
    pair_readouts,
    peaks,
    psnr_of,
    ratio_readouts,
    round_coefficients,
    rounding_dtype,
    scale_bounds,
    scale_open,
    signal_supported,
)
from rankaudit.result import GuardReadout
from rankaudit.verify.attacks.bias import readout_layers, sample_vectors

# How many differing names an architecture reason lists before it counts the rest.
NAMED = 3
# Samples per forward pass of the check: bounds its memory whatever the client's local data set. 128 was the
# fastest of 32 to 256 on a CPU (larger chunks fall out of cache: 256 took 1.8x as long).
CHUNK = 128


def listed(names: list[str]) -> str:
    more = len(names) - NAMED
    return ", ".join(names[:NAMED]) + (f" and {more} more" if more > 0 else "")


def architecture_difference(model: nn.Module, received: dict[str, torch.Tensor]) -> str | None:
    """None when ``received`` has exactly the audited model's state-dict names, shapes and dtypes; else what
    differs, in one phrase (the server changed the model the audit covered)."""
    expected = model.state_dict()
    missing = [name for name in expected if name not in received]
    extra = [name for name in received if name not in expected]
    parts = []
    if missing:
        parts.append(f"missing {listed(missing)}")
    if extra:
        parts.append(f"not in the audited model {listed(extra)}")
    shapes = [
        f"{name} {tuple(received[name].shape)} (audited {tuple(tensor.shape)})"
        for name, tensor in expected.items()
        if name in received and tuple(received[name].shape) != tuple(tensor.shape)
    ]
    if shapes:
        parts.append(f"shapes differ: {listed(shapes)}")
    dtypes = [
        f"{name} {received[name].dtype} (audited {tensor.dtype})".replace("torch.", "")
        for name, tensor in expected.items()
        if name in received
        and tuple(received[name].shape) == tuple(tensor.shape)
        and received[name].dtype != tensor.dtype
    ]
    if dtypes:
        parts.append(f"dtypes differ: {listed(dtypes)}")
    return "; ".join(parts) if parts else None


def weight_layer(name: str) -> str | None:
    """The layer a state-dict entry is the weight of ("" for the model itself), or None when it is no layer's
    weight."""
    if name == "weight":
        return ""
    return name[: -len(".weight")] if name.endswith(".weight") else None


def bias_of(layer: str) -> str:
    """The state-dict name of a layer's bias."""
    return f"{layer}.bias" if layer else "bias"


def named_like_model(model: nn.Module, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Arrays keyed "0", "1", ... (a list of arrays, as Flower's from_numpy_ndarrays keys them) renamed in the
    order of the model's state dict when their count matches; any other keys are returned as they are."""
    expected = list(model.state_dict())
    if list(arrays) == [str(i) for i in range(len(arrays))] and len(arrays) == len(expected):
        return dict(zip(expected, arrays.values()))
    return dict(arrays)


class LayerInputs:
    """What each readout layer reads from each of the client's samples at the received weights, and each sample's
    signal at each of its units: one forward pass in the model's own precision, the model as the client trains it
    (eval mode: dropout off), and one backward pass of the samples' summed loss (with labels; else of a fixed random
    projection of the output, which has the same zeros behind a gate) from the first readout layer on."""

    def __init__(self, model: nn.Module, received: dict[str, torch.Tensor], shared: list[str]):
        self.net = copy.deepcopy(model).eval()
        with torch.no_grad():
            state = self.net.state_dict()
            state.update({name: value.to(state[name].dtype) for name, value in received.items() if name in state})
            self.net.load_state_dict(state)
        # No graph through the weights: the backward only asks for each unit's per-sample signal. (A scripted
        # submodule's parameters may not be leaves here; they are left as they are.)
        for parameter in self.net.parameters():
            if parameter.is_leaf:
                parameter.requires_grad_(False)
        self.layers = readout_layers(self.net, shared)
        # {(layer, sample): what the layer's features determine of the sample, in dB}: a figure of the received
        # weights and the sample alone, so each re-read of an altered update (drop, noise) reuses it.
        self._figures: dict[tuple[str, int], float] = {}

    def vectors(
        self, samples: torch.Tensor, labels: torch.Tensor | None = None, watched: tuple | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, bool], dict[str, str]]:
        """({layer: (N, d) vectors}, {layer: (N, units) signals}, {layer: reads the input itself},
        {layer: why it is not checked}). ``watched``: the tables recorded during the client's training
        (rankaudit.guard.watch), used as they are; else the samples go through in chunks of CHUNK (eval mode: a
        chunk's outputs do not depend on the others)."""
        x = as_model_input(self.net, samples)
        flat = x.reshape(len(x), -1)

        def reads(vectors: torch.Tensor) -> bool:
            # Compared only where the shapes agree: a float64 copy of every sample is costly for thousands of them.
            return vectors.shape == flat.shape and bool(torch.equal(vectors.to(torch.float64), flat.to(torch.float64)))

        if watched is not None:
            found, signals, why_not = watched
            return found, signals, {name: reads(found[name]) for name in found}, dict(why_not)
        parts = [
            self._chunk(x[start : start + CHUNK], None if labels is None else labels[start : start + CHUNK])
            for start in range(0, len(x), CHUNK)
        ]
        found, signals, reads_input, why_not = {}, {}, {}, {}
        for name, _ in self.layers:
            calls, pieces = parts[0][name][0], [part[name][1] for part in parts]
            if calls != 1:
                why_not[name] = f"called {calls} times per forward pass: its update sums the calls"
                continue
            if any(piece is None for piece in pieces):
                why_not[name] = "reads several vectors per sample (positions), not one"
                continue
            vectors = torch.cat(pieces)
            found[name] = vectors.to(torch.float64)
            signals[name] = torch.cat([part[name][2] for part in parts]).to(torch.float64)
            reads_input[name] = reads(vectors)
        return found, signals, reads_input, why_not

    def determined(
        self, pending: dict[str, list[int]], samples: torch.Tensor, min_psnr: float | None = None
    ) -> tuple[dict[str, dict[int, float]], dict[str, list[str]]]:
        """What each layer's features determine of each of its samples ({layer: samples} in; {layer: {sample: PSNR}}
        and {layer: notes} out, rankaudit.guard.features), each (layer, sample) measured once per decision."""
        from rankaudit.guard.features import determined_by_layer

        new = {name: [i for i in indices if (name, i) not in self._figures] for name, indices in pending.items()}
        said: dict[str, list[str]] = {}
        if any(new.values()):
            modules = dict(self.layers)
            figures, said = determined_by_layer(self.net, {name: modules[name] for name in new}, samples, new, min_psnr)
            self._figures.update({(name, i): figure for name, found in figures.items() for i, figure in found.items()})
        return {name: {i: self._figures[(name, i)] for i in indices} for name, indices in pending.items()}, said

    def _chunk(self, x: torch.Tensor, labels: torch.Tensor | None) -> dict:
        """{layer: (calls per forward pass, its (n, d) vectors or None, its (n, units) signals)} for one chunk."""
        from rankaudit.verify.client import logits_of

        seen: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {name: [] for name, _ in self.layers}

        def record(name, module, args, out):
            one_vector = args[0].dim() == 2 if isinstance(module, nn.Linear) else out.shape[2:].numel() == 1
            if not one_vector or not isinstance(out, torch.Tensor):
                seen[name].append((args[0].detach(), None))
                return None
            if not out.requires_grad:  # the first checkable layer: the graph starts at its output
                out = out.detach().requires_grad_()
            seen[name].append((args[0].detach(), out))
            # The model goes on with a copy: a ReLU(inplace=True) after the layer then changes the copy, not the
            # output whose gradient is each sample's signal (nor a leaf, which autograd refuses to change).
            return out.clone()

        hooks = [
            module.register_forward_hook(lambda mod, args, out, name=name: record(name, mod, args, out))
            for name, module in self.layers
        ]
        try:
            with torch.enable_grad():
                output = logits_of(self.net(x))
                # What the forward pass recorded: a checkpointed block runs its forward again during the backward,
                # and those calls are not this pass's.
                recorded = {name: list(calls) for name, calls in seen.items()}
                outputs = [out for name, _ in self.layers for _, out in recorded[name] if out is not None]
                grads = (
                    torch.autograd.grad(_summed_loss(output, labels), outputs, allow_unused=True)
                    if output.requires_grad and outputs
                    else [None] * len(outputs)
                )
        finally:
            for hook in hooks:
                hook.remove()
        result, at = {}, 0
        for name, module in self.layers:
            calls = recorded[name]
            checkable = sum(out is not None for _, out in calls)
            gradients, at = grads[at : at + checkable], at + checkable
            if len(calls) != 1 or calls[0][1] is None:
                result[name] = (len(calls), None, None)
                continue
            vectors = sample_vectors(module, calls[0][0])
            out = calls[0][1]
            signal = torch.zeros(out.shape, dtype=out.dtype) if gradients[0] is None else gradients[0]
            result[name] = (1, None if vectors is None else vectors.detach(), signal.detach().reshape(len(x), -1))
        return result


def _summed_loss(output: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
    """The samples' summed loss (each sample's output gradient is then its own), or, without usable labels, a fixed
    random projection of the output."""
    flat = output.reshape(len(output), -1)
    if labels is not None and len(labels) == len(flat) and labels.dim() == 1:
        if flat.shape[1] == 1:
            signs = torch.where(labels.to(flat.dtype) > 0, 1.0, -1.0).to(flat.dtype)
            return nn.functional.softplus(-signs * flat[:, 0]).sum()
        if not labels.is_floating_point() and bool(((labels >= 0) & (labels < flat.shape[1])).all()):
            return nn.functional.cross_entropy(flat, labels.long(), reduction="sum")
    direction = torch.randn(output.shape, generator=torch.Generator().manual_seed(0), dtype=output.dtype)
    return (output * direction).sum()


class _Variant(NamedTuple):
    """One way a server reads a layer's update: the rows and biases it divides, and what it did to the update first
    (weight decay's share added back, the biases' own learning rate divided out, an Adam step undone), and how far
    each bias update can lie from the training's own through rounding (None: not known, the readout as formed)."""

    rows: torch.Tensor
    bias: torch.Tensor
    share: float | None = None
    rate: float | None = None
    undone: str | None = None
    slack: torch.Tensor | None = None


def layer_readouts(
    name: str,
    weight_update: torch.Tensor,
    bias_update: torch.Tensor,
    vectors: torch.Tensor,
    signals: torch.Tensor | list[torch.Tensor],
    reads_input: bool,
    min_psnr: float,
    received: tuple[torch.Tensor, torch.Tensor] | None = None,
    searched: dict | None = None,
    slack: torch.Tensor | None = None,
    search_every_pair: bool = False,
) -> list[GuardReadout]:
    """Every readout of one layer that shows a sample's vector at ``min_psnr`` or above: each unit's ratio, and each
    pair of units whose signals (one table, or several: their candidates together) isolate one sample; in float64.
    With the layer's ``received`` (weight, bias), each is also read with weight decay's share of the received
    weights added back (decay_share), as a server that knows the client's lr and weight decay does. ``searched``:
    the pair searches of an earlier call on the same signal tables in this decision, reused (and added to).
    ``slack``: how far each bias update can lie from the training's own through float rounding (bias_slack); each
    readout is read at the scale within it nearest the sample, as a server that knows the sample's mean or range
    reads it. ``search_every_pair``: at a layer that reads the samples, every pair is also searched against every
    sample (every_pair; with few values per sample, only the pairs the signals support)."""
    rows = weight_update.reshape(len(weight_update), -1).to(torch.float64)
    bias = bias_update.to(torch.float64)
    if received is not None:
        received = (received[0].reshape(len(rows), -1).to(torch.float64), received[1].to(torch.float64))
    table = vectors.to(torch.float64)
    peak = peaks(table)
    # A hidden layer's vector that is constant (every ReLU before it off) shows nothing of its sample.
    blank = (table.amax(dim=1) == table.amin(dim=1)) & torch.tensor(not reads_input)

    def open_scale(units, kind, variant: _Variant) -> bool:
        # A ratio whose bias update rounding could have made (or that is not a number): no scale is fixed by it.
        if kind != "ratio" or variant.slack is None:
            return False
        return bool(scale_open(variant.bias[units[0]], variant.slack[units[0]]))

    def readout(units, kind, sample, score, scale, variant: _Variant):
        error = float(score - 10 * torch.log10(peak[sample] ** 2 / (table[sample] ** 2).mean().clamp_min(1e-300)))
        return GuardReadout(
            name,
            units,
            kind,
            sample,
            10 ** (-error / 20),  # ‖readout − vector‖ / ‖vector‖, from the PSNR
            reads_input,
            psnr=round(score, 2),
            sample_psnr=round(score, 2) if reads_input else None,
            leaks=reads_input,
            scale=scale,
            received_share=variant.share,
            bias_rate=variant.rate,
            undone=variant.undone,
            scale_open=open_scale(units, kind, variant),
        )

    # Weight decay's share of the update, where the update shows one: the server that knows lr and λ adds it back,
    # to the weights and (as PyTorch decays them too) to the biases, or to the weights alone.
    share = decay_share(rows, received[0], table) if received is not None else None
    variants = [_Variant(rows, bias, slack=slack)]
    if share is not None:
        added = rows + share * received[0]
        variants += [
            _Variant(added, bias + share * received[1], share, slack=slack),
            _Variant(added, bias, share, slack=slack),
        ]
    tables = signals if isinstance(signals, list) else [signals]
    # A sample and its copy in the batch have the same signals: no pair isolates one of them, but a pair that
    # isolates both reads each exactly. The pairs are also searched with each such group as one sample.
    copies = duplicates(table)
    keys = [(k, ()) for k in range(len(tables))]
    group_of = {member: group for group in copies for member in group}
    if copies:
        tables = tables + [merged(table_, copies) for table_ in tables]
        keys += [(k, tuple(map(tuple, copies))) for k in range(len(keys))]
    searched = {} if searched is None else searched
    for key, table_ in zip(keys, tables):
        if key not in searched:  # the same table and the same groups of copies: the same pairs
            searched[key] = isolating_and_nearly(table_)
    found_pairs = [searched[key] for key in keys]
    candidates = sorted({pair for isolating, _ in found_pairs for pair in isolating})
    candidates = _with_members(candidates, group_of)
    if reads_input:
        # A pair that isolates a few samples together reads a mixture of them, which shows each one when they are
        # copies or near copies (a noisy copy in the same bin): formed against each of them. (A hidden layer's
        # readouts are judged by what the read sample's features determine; features of different samples can lie
        # close together without the samples doing so.)
        candidates += [
            (i, j, member, c)
            for table_ in tables
            for i, j, members, c in isolating_groups(table_)
            for member in members
        ]
    if search_every_pair and reads_input:
        found = every_pair(rows, bias, table, peak, min_psnr) or []
        candidates += signal_supported(found, tables) if few_values(table) else found
    candidates = sorted(set(candidates))
    isolated = {pair[:3] for pair in candidates}
    nearly = sorted({pair for _, close in found_pairs for pair in close if pair[:3] not in isolated})
    # Biases on their own learning rate: every isolating readout is the sample times one ratio k, which the server
    # that set the client's learning rates divides out. Read again with the biases' update scaled by k.
    # Weight decay's share, where found, first: the rate is read from the update it leaves.
    for variant in list(variants):
        rate = bias_rate(variant.rows, variant.bias, table, tables, candidates)
        if rate is not None:
            variants.append(
                variant._replace(
                    bias=variant.bias * rate,
                    rate=rate,
                    slack=None if variant.slack is None else variant.slack * abs(rate),
                )
            )
    # One Adam step: the gradients behind it, as a server that knows lr and eps takes them back out.
    adam = adam_undone(rows, bias, tables)
    if adam is not None:
        variants.append(_Variant(adam[0], adam[1], undone=f"Adam's step (lr {adam[2]:.3g}, eps {adam[3]:.3g}) undone"))
    best: dict[tuple, GuardReadout] = {}
    for variant in variants:
        hits = [
            ([unit], "ratio", sample, score, None)
            for unit, sample, score in ratio_readouts(variant.rows, variant.bias, table, peak, variant.slack)
            if score >= min_psnr and not blank[sample]
        ]
        pairs = pair_readouts(variant.rows, variant.bias, table, peak, candidates, slack=variant.slack)
        pairs += pair_readouts(
            variant.rows, variant.bias, table, peak, nearly, nearest_scale=False, slack=variant.slack
        )
        hits += [
            ([i, j], "pair", sample, score, scale)
            for i, j, sample, scale, score in pairs
            if score >= min_psnr and not blank[sample]
        ]
        # A readout of the input that shows one sample shows its near copies too; a hidden layer's readouts are
        # judged by what the read sample's features determine (features of other samples close to them are not).
        beside = (
            _shown_beside(hits, variant.rows, variant.bias, table, peak, min_psnr, blank, variant.slack)
            if reads_input
            else []
        )
        for units, kind, sample, score, scale in hits + beside:
            _keep_best(best, readout(units, kind, sample, score, scale, variant))
    for group in copies:  # what shows one copy shows every copy: their vectors are the same
        for entry in [entry for entry in best.values() if entry.sample in group]:
            for other in group:
                _keep_best(best, dataclasses.replace(entry, sample=other))
    return list(best.values())


def _shown_beside(hits, rows, bias, table, peak, min_psnr, blank, slack=None) -> list[tuple]:
    """Each readout that shows a sample, compared with every other sample too: one that is close to the sample (a
    near copy in another bin) is shown as well, at the factor within the bias updates' rounding (``slack``)
    nearest it. [(units, kind, other sample, psnr, scale)]."""
    if not hits:
        return []
    first = torch.tensor([units[0] for units, *_ in hits])
    second = torch.tensor([units[-1] for units, *_ in hits])
    scale = torch.tensor([0.0 if found is None else found for *_, found in hits], dtype=torch.float64)
    denominator = bias[first] - scale * bias[second]
    readouts = (rows[first] - scale[:, None] * rows[second]) / torch.where(denominator != 0, denominator, 1.0)[:, None]
    bounds = None if slack is None else scale_bounds(denominator, slack[first] + scale.abs() * slack[second])
    squares, factor = fitted_squares(readouts, table, bounds)
    # Expanded squares cancel near an exact match: a margin of 3 dB before the direct check.
    close = squares.clamp_min(0) <= (peak**2)[None, :] * table.shape[1] * 10 ** (-(min_psnr - 3) / 10)
    close[torch.arange(len(hits)), torch.tensor([sample for _, _, sample, *_ in hits])] = False
    which, sample = torch.nonzero(close, as_tuple=True)
    if not len(which):
        return []
    scores = psnr_of(readouts[which] * factor[which, sample][:, None], table[sample], peak[sample]).tolist()
    return [
        (hits[k][0], hits[k][1], n, score, hits[k][4])
        for k, n, score in zip(which.tolist(), sample.tolist(), scores)
        if score >= min_psnr and not blank[n]
    ]


def _with_members(pairs: list[tuple], group_of: dict[int, list[int]]) -> list[tuple]:
    """The candidate pairs (i, j, s, c), each one whose sample is in a group of copies formed against every member."""
    if not group_of:
        return pairs
    return sorted({(i, j, member, c) for i, j, s, c in pairs for member in group_of.get(s, [s])})


def _keep_best(best: dict[tuple, GuardReadout], entry: GuardReadout) -> None:
    """One readout per (units, kind, sample): the one that reads the most."""
    key = (tuple(entry.units), entry.kind, entry.sample)
    if key not in best or entry.psnr > best[key].psnr:
        best[key] = entry


def find_readouts(
    inputs: LayerInputs,
    received: dict[str, torch.Tensor],
    sent: dict[str, torch.Tensor],
    samples: torch.Tensor,
    min_psnr: float,
    *,
    labels: torch.Tensor | None = None,
    check_features: bool = True,
    watched: tuple | None = None,
    at_sent: LayerInputs | None = None,
    steps: int = 0,
) -> tuple[list[GuardReadout], list[str], list[str], list[str]]:
    """(readouts, layers checked, layers skipped with why, notes) for the update ``sent − received``. A readout of
    a hidden layer's features leaks its sample when what those features determine of it reaches ``min_psnr``.
    ``steps``: the optimiser steps the watch recorded (each rounds the weights it writes), 0 when not watched."""
    vectors, signals, reads_input, why_not = inputs.vectors(samples, labels, watched)
    # Without the steps' own records, the signals at the received weights and at the sent ones both propose pairs
    # (a sample whose step ran in between is isolated by the signals near its step), and a hidden layer's readouts
    # are matched with the features at both (they move from step to step).
    later_vectors, later = at_sent.vectors(samples, labels)[:2] if at_sent is not None and watched is None else ({}, {})
    readouts, checked, skipped, notes = [], [], [], []
    features: dict[str, list[GuardReadout]] = {}  # layer -> its readouts of a sample's features
    for name, _ in inputs.layers:
        prefix = f"{name}." if name else ""
        if name in why_not:
            skipped.append(f"{name or 'the model'}: {why_not[name]}")
            continue
        if not reads_input[name] and not check_features:
            skipped.append(f"{name}: reads features, and check-features is off")
            continue
        weight, bias = f"{prefix}weight", f"{prefix}bias"
        if bias not in sent or weight not in sent:
            continue  # a weight sent without its bias is read as a layer without one (row_readouts)
        weight_update = sent[weight].detach().cpu().to(torch.float64) - received[weight].detach().cpu().to(
            torch.float64
        )
        bias_update = sent[bias].detach().cpu().to(torch.float64) - received[bias].detach().cpu().to(torch.float64)
        checked.append(name)
        proposing = [signals[name]] + ([later[name]] if name in later else [])
        if watched is None and reads_input[name]:
            proposing += round_coefficients(weight_update, vectors[name])
        at = (received[weight].detach().cpu(), received[bias].detach().cpu())
        searched: dict = {}  # the pair searches over this layer's signal tables, for both sets of features
        # Each optimiser step rounds the biases it writes, in the dtype it trains in: as many roundings as the
        # watch saw steps (a forward pass with its backward: at least one per optimiser step), or, unwatched, one
        # per sample (a step runs at least one).
        slack = bias_slack(sent[bias], received[bias], steps or len(samples), rounding_dtype(sent[weight], sent[bias]))
        if few_values(vectors[name]):
            # A few values per sample: a readout at a scale the rounding leaves free passes within 30 dB of samples
            # the client never had about as often as of its own (iris sent in bfloat16: 9 of 12 honest rounds
            # "read" held-out flowers). Such readouts are read as formed.
            slack = None
        # At a layer that reads the samples, every pair is also read against every sample, where that search is
        # small enough: without the steps' records, which samples each step isolated is not known, and with them a
        # pair can mix a bin's samples so that one shows a little over the threshold, which no signal test isolates.
        search_every_pair = reads_input[name]
        if search_every_pair and len(bias_update) * (len(bias_update) - 1) // 2 * len(samples) > EVERY_PAIR_MOST:
            search_every_pair = False
            notes.append(
                f"{name}: {len(bias_update)} units over {len(samples)} samples are too many to read every pair "
                "against every sample: only the pairs the signals propose were read"
                + ("" if watched is not None else " (watching the training gives each step's own)")
            )
        found = layer_readouts(
            name,
            weight_update,
            bias_update,
            vectors[name],
            proposing,
            reads_input[name],
            min_psnr,
            at,
            searched,
            slack,
            search_every_pair,
        )
        if not reads_input[name] and name in later_vectors:
            best: dict[tuple, GuardReadout] = {}
            for entry in found + layer_readouts(
                name, weight_update, bias_update, later_vectors[name], proposing, False, min_psnr, at, searched, slack
            ):
                _keep_best(best, entry)
            found = list(best.values())
        if found and not reads_input[name]:
            features[name] = found
        readouts += found
    if features:
        # Every layer's feature readouts judged together: one bound per sample serves all the layers that read it.
        figures, said = inputs.determined(
            {name: sorted({r.sample for r in found}) for name, found in features.items()}, samples, min_psnr
        )
        for name, found in features.items():
            notes += [f"{name}: {line}" for line in said.get(name, [])]
            for entry in found:
                entry.sample_psnr = round(figures[name][entry.sample], 2)
                entry.leaks = figures[name][entry.sample] >= min_psnr
    return readouts, checked, skipped, notes
