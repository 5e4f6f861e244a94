"""Design review: single architectural edits, each re-counted and re-bounded on the traced graph, and ranked."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from rankaudit.bound.energy import EnergyScale, ReferenceDataError, certify
from rankaudit.bound.identifiability import (
    gradient_sources,
    identifiability,
    round_identifiability,
    sample_identifiability,
    sample_unknowns,
)
from rankaudit.count.analysis import analyze
from rankaudit.count.calls import trace_and_count
from rankaudit.count.ops import Counting, Role
from rankaudit.errors import RankauditError, UsageError
from rankaudit.findings.apply import readout_layers, token_leakage
from rankaudit.model.load import load_model
from rankaudit.result import DPNoiseSuggestion, Identifiability, Result, SampleBound
from rankaudit.settings.levels import DEFAULT_MAX_RECOVERABLE, VERDICT_LEVELS
from rankaudit.settings.levels import ceiling as level_ceiling
from rankaudit.settings.round import Round
from rankaudit.trace.records import NodeRecord, TracedModel

EDITS = ("cut-skip", "narrow", "stride", "remove-bias")  # batch sizes protect no sample (spec §14)
ACCURACY_NOTE = (
    "Accuracy is not measured: each edit changes what the model can learn, so retrain and compare "
    "before adopting one (R-GAP's Figure 4 found cutting block 3's skip cost no accuracy on CIFAR-10)."
)


@dataclass
class Suggestion:
    edit: str  # one of EDITS
    target: str  # the block's or layer's qualified name (layer2.0), or "batch"
    detail: str  # what exactly changes, e.g. "out_channels 16 -> 5"
    ra_i: int | None
    critical_layer: str | None
    verdict: str  # the per-sample verdict level of the edited model, on energy as `check` reads it (spec §14, §15)
    delta_params: int
    crosses_verdict: bool  # the verdict differs from the unedited model's
    rank_bound: int = 0  # R_s of the edited model: each sample's bound (spec §14)
    certified_deficit: int = 0  # |x| - R_s: directions of each sample certified hidden
    recoverable_fraction: float = 1.0  # R_s/|x| of the edited model: the edits are ranked by it


@dataclass
class RoundSetting:
    """One knob of the round moved to where each sample becomes `protected` (spec §14, §15), with its bound."""

    knob: str  # local-samples | local-epochs | clients
    value: int | None  # the value found; None: no value in the range searched protects the round
    unbounded: bool  # local-epochs only: every number of epochs is protected (the |θ_s| cap binds)
    rank_bound: int = 0
    unknowns: int = 0
    recoverable_fraction: float = 1.0
    binding: str = ""
    explanation: str = ""  # why, or why no value was found


@dataclass
class RoundReview:
    """The round as given and the three single changes that make each sample `protected` (spec §14): the
    verdict, bound and fraction are per sample; `whole_*` are the round as a whole (spec §12). The levels are
    read on energy (spec §15), as `check` reads them."""

    round: Round
    verdict: str
    rank_bound: int
    unknowns: int
    recoverable_fraction: float
    max_recoverable: float
    settings: list[RoundSetting]
    whole_verdict: str = ""
    whole_rank_bound: int = 0
    whole_unknowns: int = 0


@dataclass
class SuggestReport:
    model: str
    input_shape: tuple[int, ...]
    batch_size: int
    ra_i: int | None
    critical_layer: str | None
    verdict: str  # the per-sample verdict on energy (spec §14, §15), as `check` prints it: what the edits aim at
    suggestions: list[Suggestion]
    skipped: list[str] = field(default_factory=list)  # edits that could not be applied, and why
    # The batch as a whole (spec §9, §11) at batch_size: R of n = B·|x|; a statement about all samples at once.
    unknowns: int = 0
    rank_bound: int = 0
    certified_deficit: int = 0
    certifying_batch: int | None = None  # smallest batch size with a certified deficit of the whole batch
    protecting_batch: int | None = None  # smallest batch size whose whole batch is protected (None: none is)
    max_recoverable: float = DEFAULT_MAX_RECOVERABLE  # protected asks that 1 - this of the energy stays hidden
    recoverable_fraction: float = 1.0  # R/n of the model as it is (the whole batch)
    # Layers whose gradients, kept back, make each sample protected (spec §14); [] none needed; None: no set does
    certifying_withheld: list[str] | None = None
    # Where no set of layers reaches protected (norms and other directly used parameters still send enough):
    # layers whose gradients, kept back, give at least a certified deficit (partial).
    deficit_withheld: list[str] | None = None
    # Language models: DAGER's span test on the layers reading per-token vectors (all gradients shared).
    token_span_exposed: list[str] = field(default_factory=list)  # layers whose gradient passes it at this B·n
    tokens_per_batch: int | None = None  # B·n now
    safe_tokens_per_batch: int | None = None  # the smallest B·n at which it fails on every layer
    safe_token_batch: int | None = None  # the smallest batch size reaching it at this length
    note: str = ACCURACY_NOTE
    seconds: float = 0.0
    round_review: RoundReview | None = None  # with a round: the N, E and C that make it protected
    noise: DPNoiseSuggestion | None = None  # with DP options: the least noise meeting --max-reconstruction
    sample: SampleBound | None = None  # each sample's bound as the model is (spec §14)
    readout_layers: list[str] = field(default_factory=list)  # shared layers with a bias readout (spec §14)
    # No single edit, withheld set or round setting makes each sample protected: only noise the client adds can
    # bound what the server reconstructs of a sample.
    noise_is_the_way: bool = False
    spectrum: str = ""  # the reference distribution the levels are read on (spec §15); "" for token inputs
    exposed_below: float | None = None  # the hidden share under which a sample is exposed


def _rebuilt(traced: TracedModel, replaced: dict[str, NodeRecord], dropped: set[str]) -> TracedModel:
    """A copy of the traced graph with some records replaced and some dropped; dead branches are pruned."""
    records = {n: replaced.get(n, traced.records[n]) for n in traced.order if n not in dropped}
    alive, frontier = set(), [n for n in traced.output_ids if n in records]
    while frontier:
        node = frontier.pop()
        if node not in alive:
            alive.add(node)
            frontier.extend(i for i in records[node].inputs if i in records)
    order = [n for n in traced.order if n in alive]
    successors: dict[str, list[str]] = {}
    for node in order:
        for source in dict.fromkeys(records[node].inputs):
            successors.setdefault(source, []).append(node)
    return TracedModel(
        {n: records[n] for n in order},
        successors,
        order,
        traced.input_id,
        [n for n in traced.output_ids if n in alive],
        traced.tracer,
        traced.fallback_reason,
        traced.parameters,
    )


def _params_of(record: NodeRecord) -> int:
    return record.counting.weights + record.counting.frozen_params + record.counting.reported_params


def _cut_skips(traced: TracedModel, base: Result) -> list[tuple[str, str, TracedModel, int]]:
    edits = []
    for block in base.blocks:
        add = traced.record(block.merge)
        main_input = next(i for i in add.inputs if i != block.shortcut_input)
        shortcut = set()
        if block.shortcut_input != block.fork:
            shortcut = (
                (traced.ancestors(block.shortcut_input) | {block.shortcut_input})
                - traced.ancestors(block.fork)
                - {block.fork}
            )
        passthrough = dataclasses.replace(add, inputs=[main_input], counting=Counting(Role.TRANSPARENT))
        removed = sum(_params_of(traced.record(n)) for n in shortcut)
        detail = (
            "remove the identity skip"
            if not shortcut
            else f"remove the skip and its projection ({', '.join(block.shortcut_layers)})"
        )
        edits.append((block.name, detail, _rebuilt(traced, {block.merge: passthrough}, shortcut), -removed))
    return edits


def _produces_output(traced: TracedModel, node_id: str) -> bool:
    """True when no weighted layer stands between this node and a model output."""
    frontier, seen = [node_id], set()
    while frontier:
        node = frontier.pop()
        if node in traced.output_ids:
            return True
        for successor in traced.successors.get(node, ()):
            record = traced.record(successor)
            if successor not in seen and not (record.counting.role is Role.LAYER and record.counting.weights):
                seen.add(successor)
                frontier.append(successor)
    return False


def _narrowed(traced: TracedModel, node_id: str, width: int) -> tuple[TracedModel, int] | str:
    """The graph with one layer's output channels cut to `width`, and Δ params; or why it cannot be done."""
    layer = traced.record(node_id)
    old = layer.counting.out_features
    scale = width / old
    replaced = {
        node_id: dataclasses.replace(
            layer,
            output_numel=layer.output_numel * width // old,
            counting=dataclasses.replace(
                layer.counting,
                weights=layer.counting.weights * width // old,
                bias_params=layer.counting.bias_params * width // old,
                out_features=width,
            ),
        )
    }
    delta = replaced[node_id].counting.weights - layer.counting.weights
    frontier = list(traced.successors.get(node_id, ()))
    while frontier:
        node = frontier.pop()
        if node in replaced:
            continue
        record = traced.record(node)
        role = record.counting.role
        if role is Role.LAYER and record.counting.weights:
            # The consumer loses input channels: its weights shrink, its bias and output stay.
            kernel = record.counting.weights - record.counting.bias_params
            weights = round(kernel * scale) + record.counting.bias_params
            replaced[node] = dataclasses.replace(record, counting=dataclasses.replace(record.counting, weights=weights))
            delta += weights - record.counting.weights
            continue
        if role in (Role.ADD, Role.CAT):
            return f"its output meets another path at {record.name} ({record.op})"
        if node in traced.output_ids:
            return "its channels reach the model's output"
        if record.output_numel * width % old:
            return f"{record.name} ({record.op}) does not keep whole channels"
        replaced[node] = dataclasses.replace(record, output_numel=record.output_numel * width // old)
        frontier.extend(traced.successors.get(node, ()))
    return _rebuilt(traced, replaced, set()), delta


def _narrow_edits(traced: TracedModel, base: Result, skipped: list[str]) -> list[tuple[str, str, TracedModel, int]]:
    edits = []
    rows = {row.node: row for row in base.layers}
    for node_id in traced.order:
        record = traced.record(node_id)
        counting = record.counting
        row = rows.get(node_id)
        if row is None or counting.role is not Role.LAYER or not counting.weights or not counting.out_features:
            continue
        if _produces_output(traced, node_id):
            continue  # the logits: their width is the number of classes
        channels = counting.out_features
        per_channel = counting.weights / channels
        positions = record.output_numel // channels
        # Locally deficient (spec §2 without V): B|x| - c·w_c - B·c·P > 0, so c < B|x| / (w_c + B·P).
        limit = row.inputs / (per_channel + base.batch_size * positions)
        width = min(channels - 1, int(limit) - (1 if limit == int(limit) else 0))
        if row.inputs - row.weights - row.outputs > 0 or width < 1:
            continue  # already deficient, or even one channel is over-determined
        narrowed = _narrowed(traced, node_id, width)
        if isinstance(narrowed, str):
            skipped.append(f"narrow {record.name}: {narrowed}")
            continue
        edits.append((record.name, f"out_features {channels} -> {width}", *narrowed))
    return edits


def _remove_bias_edits(traced: TracedModel) -> list[tuple[str, str, TracedModel, int]]:
    edits = []
    for node_id in traced.order:
        record = traced.record(node_id)
        bias = record.counting.bias_params
        if record.counting.role is Role.LAYER and bias:
            counting = dataclasses.replace(record.counting, weights=record.counting.weights - bias, bias_params=0)
            edits.append(
                (
                    record.name,
                    f"bias=False ({bias} parameters)",
                    _rebuilt(traced, {node_id: dataclasses.replace(record, counting=counting)}, set()),
                    -bias,
                )
            )
    return edits


def _stride_edits(module: nn.Module, input_shape, skipped: list[str]) -> list[tuple[str, str, TracedModel, int]]:
    """Stride changes move every later shape, so these few are re-traced on meta rather than re-counted."""
    edits = []
    for name, conv in module.named_modules():
        if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            continue
        old = conv.stride
        new = tuple(1 for _ in old) if max(old) > 1 else tuple(2 for _ in old)
        conv.stride = new
        try:
            edited = trace_and_count(module, input_shape)
        except RankauditError:
            skipped.append(f"stride {name} {old} -> {new}: a later layer needs the old shape")
            continue
        finally:
            conv.stride = old
        edits.append((name, f"stride {'x'.join(map(str, old))} -> {'x'.join(map(str, new))}", edited, 0))
    return edits


def smallest_certified_batch(traced: TracedModel, start: int = 1, at_start: Identifiability | None = None) -> int:
    """Smallest B >= start with a certified deficit (spec §9).

    Each extra sample adds |x| unknowns and at most |x| flow, so the deficit never shrinks as B grows: a
    bisection finds the first B. Once B·|x| exceeds every shared gradient's size, the deficit is certain.
    """
    per_sample = sample_unknowns(traced)
    if (at_start or identifiability(traced, start)).certified_deficit:
        return start
    capacity = sum(source.numel for n in traced.order for source in gradient_sources(traced.record(n)))
    low, high = start, max(start + 1, capacity // max(per_sample, 1) + 1)
    while high - low > 1:
        middle = (low + high) // 2
        if identifiability(traced, middle).certified_deficit:
            high = middle
        else:
            low = middle
    return high


def smallest_protected_batch(
    traced: TracedModel,
    start: int = 1,
    at_start: Identifiability | None = None,
    max_recoverable: float = DEFAULT_MAX_RECOVERABLE,
    energy: EnergyScale | None = None,
) -> int | None:
    """Smallest B >= start whose batch as a whole is `protected` on energy (spec §15: the hidden share of B
    samples' energy, R over B·|x|); None if no B is.

    Every cut's capacity is a + B·b (gradients a, tensors B·b, both >= 0), so R(B) is their minimum and R(B)/B =
    min(a/B + b) never grows with B; the hidden share over B samples is the tail interpolated at R(B)/B, so it
    never shrinks: a bisection finds the first B. The cut through every shared gradient has b = 0, so from
    B·r >= their total size on (r: the largest protected rank per sample), the batch is protected.
    """
    energy = energy or EnergyScale.of(traced.inputs, sample_unknowns(traced), max_recoverable=max_recoverable)

    def protected(batch: int, bound: Identifiability | None = None) -> bool:
        bound = bound or identifiability(traced, batch, max_recoverable=max_recoverable)
        return energy.level(bound.rank_bound, batch) == "protected"

    if protected(start, at_start):
        return start
    largest = energy.protected_rank()
    if largest <= 0:
        return None
    capacity = sum(source.numel for n in traced.order for source in gradient_sources(traced.record(n)))
    capacity += sum(e.vocab_size * e.dim for e in traced.token_embeddings)
    low, high = start, max(start + 1, int(capacity / largest) + 1)
    if not protected(high):
        return None
    return _first_true(protected, low, high)


def _first_true(holds: Callable[[int], bool], low: int, high: int) -> int:
    """The smallest value in (low, high] at which a monotone `holds` is true, given that it holds at `high`."""
    while high - low > 1:
        middle = (low + high) // 2
        if holds(middle):
            high = middle
        else:
            low = middle
    return high


def certifying_withheld(
    traced: TracedModel,
    batch_size: int,
    *,
    max_recoverable: float = DEFAULT_MAX_RECOVERABLE,
    aim: str = "protected",
    round_: Round | None = None,
    energy: EnergyScale | None = None,
) -> list[str] | None:
    """A small set of layers whose gradients, withheld, bring each sample to the verdict level `aim` (spec §14,
    §15: `protected`, or `partial`); None if no set that still shares some layer's gradient does (withholding
    every layer sends nothing to train with: that is no design, whatever it hides).
    Each sample is judged by sample_identifiability in `round_` (default: FedSGD at batch_size), its level read on
    energy (spec §15) by `energy` (default: the model's shipped reference at these thresholds).

    Greedy: withhold, one at a time, the layer whose removal lowers the rank bound most. Exact minimum sets are
    a combinatorial search; the greedy set is a certificate, not a proof that none smaller exists.
    """
    judged_round = round_ or Round(batch_size=batch_size)
    energy = energy or EnergyScale.of(traced.inputs, sample_unknowns(traced), max_recoverable=max_recoverable)
    cache: dict = {}

    def judge(withheld_layers: list[str]) -> SampleBound:
        key = tuple(sorted(withheld_layers))
        if key not in cache:
            cache[key] = sample_identifiability(
                traced, judged_round, withheld_layers=list(key) or None, max_recoverable=max_recoverable
            )
            cache[key].level = energy.level(cache[key].rank_bound)
        return cache[key]

    capacity: dict[str, int] = {}
    for node_id in traced.order:
        record = traced.record(node_id)
        if record.counting.role is Role.LAYER and record.counting.weights:
            capacity[record.name.split("#")[0]] = record.counting.weights
    names = list(capacity)
    withheld: list[str] = []
    reached = VERDICT_LEVELS[VERDICT_LEVELS.index(aim) :]
    bound = judge([])
    while bound.level not in reached:
        candidates = [name for name in names if name not in withheld]
        if not candidates:
            return None
        trials = [(judge(withheld + [name]), capacity[name], name) for name in candidates]
        # Where no single layer lowers the bound yet (the input itself is the cut), take the most gradient away.
        bound, _, best = min(trials, key=lambda trial: (trial[0].rank_bound, -trial[1]))
        withheld.append(best)
    for name in sorted(withheld, key=capacity.__getitem__):  # then share again what the certificate can spare
        rest = [other for other in withheld if other != name]
        if judge(rest).level in reached:
            withheld = rest
    return withheld if len(withheld) < len(names) or not names else None


# Searches stop here: a round that needs more local samples or clients than this is reported as not found.
MAX_ROUND_SEARCH = 1_000_000


def round_review(
    traced: TracedModel, round_: Round, max_recoverable: float | None = None, energy: EnergyScale | None = None
) -> RoundReview:
    """Per sample (spec §14): the N, E and C at which each sample of the round is `protected`, one knob at a time,
    each level read on energy (spec §15) by `energy` (default: the model's shipped reference).

    R_s = min(|x|, |θ_s|, E·R(1)) holds whatever N, B and C are: more local samples or clients never protect a
    sample (they only raise the hidden share of the round as a whole, reported beside it), and the largest E is the
    last whose E·R(1) (or the |θ_s| cap) keeps the hidden share protected. The hidden share only shrinks as R_s
    grows, so the searches stay monotone. Each try is arithmetic: §9's max flows are cached.
    """
    ceiling = level_ceiling(max_recoverable)
    energy = energy or EnergyScale.of(traced.inputs, sample_unknowns(traced), max_recoverable=ceiling)
    cache: dict = {}

    def judged(changed: Round) -> Identifiability:
        bound = round_identifiability(traced, changed, max_recoverable=ceiling, cache=cache)
        bound.sample.level = energy.level(bound.sample.rank_bound)
        return bound

    def whole_level(bound: Identifiability) -> str:
        return energy.level(bound.rank_bound, max(bound.unknowns // max(bound.sample.unknowns, 1), 1))

    def whole_protected(bound: Identifiability) -> bool:
        return whole_level(bound) == "protected"

    def first_whole(setting: str, low: int, high: int) -> int | None:
        """The least value in [low, high] of one setting at which the round as a whole is protected (spec §12), for
        the record. The round's bound per sample, R/(N·C), never grows with N or C (each sample adds at most |x|,
        the |θ_s| cap does not grow), so its hidden share never shrinks: a bisection, not a scan of up to a
        million rounds (photographs need R/(N·C) under one direction per sample)."""

        def protected(value: int) -> bool:
            return whole_protected(judged(dataclasses.replace(round_, **{setting: value})))

        if protected(low):
            return low
        if high <= low or not protected(high):
            return None
        return _first_true(protected, low, high)

    base = judged(round_)
    sample = base.sample
    per_sample = sample.unknowns
    values = cache.get("update_values") or identifiability(traced, 1).rank_bound
    settings = []
    for knob, setting, symbol, scale in (
        ("local-samples", "local_samples", "N", round_.clients),
        ("clients", "clients", "C", round_.samples),
    ):
        if sample.level == "protected":
            settings.append(
                _sample_setting(
                    knob,
                    None,
                    sample,
                    f"any {symbol}: each sample's bound does not depend on {symbol}",
                    unbounded=True,
                )
            )
            continue
        largest = energy.protected_rank()  # the round as a whole is protected once R <= its samples · largest
        enough = math.ceil(values / max(largest * scale, 1e-300)) if largest > 0 else None
        low = round_.batch_size if setting == "local_samples" else 1
        whole = first_whole(setting, low, max(low, min(enough or MAX_ROUND_SEARCH, MAX_ROUND_SEARCH)))
        whole_text = (
            f"; the round as a whole is protected from {symbol} = {whole:,}, which is no guarantee for any one sample"
            if whole is not None
            else ""
        )
        settings.append(
            _sample_setting(
                knob,
                None,
                None,
                f"no {symbol} protects a sample: {symbol} does not enter each sample's bound{whole_text}",
            )
        )
    # Local epochs E: E·R(1) grows with E; the |θ_s| cap does not.
    one_epoch = judged(dataclasses.replace(round_, local_epochs=1)).sample
    if one_epoch.level != "protected":
        settings.insert(
            1,
            _sample_setting(
                "local-epochs",
                None,
                None,
                f"even one local epoch is not protected per "
                f"sample (one step's R(1) = {one_epoch.single_sample_bound:,} of "
                f"{per_sample:,}): more epochs only add equations",
            ),
        )
    elif energy.level(min(values, per_sample)) == "protected":
        settings.insert(
            1,
            _sample_setting(
                "local-epochs",
                None,
                one_epoch,
                "any number of epochs: the update's |θ_s| values cap each sample whatever the steps carry",
                unbounded=True,
            ),
        )
    else:
        low, high = 1, 2  # the largest E still protected: E·R(1) grows without bound, so doubling ends
        while (
            high < MAX_ROUND_SEARCH
            and judged(dataclasses.replace(round_, local_epochs=high)).sample.level == "protected"
        ):
            low, high = high, high * 2
        while high - low > 1:
            middle = (low + high) // 2
            if judged(dataclasses.replace(round_, local_epochs=middle)).sample.level == "protected":
                low = middle
            else:
                high = middle
        settings.insert(
            1, _sample_setting("local-epochs", low, judged(dataclasses.replace(round_, local_epochs=low)).sample)
        )
    return RoundReview(
        round_,
        sample.level,
        sample.rank_bound,
        sample.unknowns,
        sample.recoverable_fraction,
        ceiling,
        settings,
        whole_verdict=whole_level(base),
        whole_rank_bound=base.rank_bound,
        whole_unknowns=base.unknowns,
    )


def _sample_setting(
    knob: str, value: int | None, sample: SampleBound | None, why: str = "", unbounded: bool = False
) -> RoundSetting:
    if sample is None:
        return RoundSetting(knob, value, unbounded, explanation=why)
    cap = {
        "update-values": "the update's values cap each sample",
        "steps": "the steps that read a sample cap it",
        "unknowns": "no cap below a sample's unknowns",
    }[sample.binding]
    return RoundSetting(
        knob,
        value,
        unbounded,
        sample.rank_bound,
        sample.unknowns,
        sample.recoverable_fraction,
        sample.binding,
        why or f"{cap}: R_s = min(|x|, |θ_s|, E·R(1)) = {sample.rank_bound:,}",
    )


def suggest(
    spec: str,
    *,
    input_shape: tuple[int, ...] | None = None,
    batch_size: int = 1,
    max_recoverable: float | None = None,
    round_: Round | None = None,
    data: str | None = None,
    exposed_below: float | None = None,
) -> SuggestReport:
    """Every single edit of EDITS that applies to the model, re-counted and ranked by the per-sample recoverable
    fraction R_s/|x| it reaches (spec §14; the verdict level follows it, §11), then by the RA-i; with a round,
    also the N, E and C at which each sample is protected. The batch sizes at which the batch as a whole is
    certified or protected are reported beside them: no batch size protects any one sample.

    Every level is read on energy, as `check` reads it (spec §15): the reference is `data` (--data), else the
    shipped photograph spectrum for C×H×W inputs, else white data; `exposed_below` as check's --exposed-below."""
    ceiling = level_ceiling(max_recoverable)
    started = time.perf_counter()
    loaded = load_model(spec, input_shape, device="meta")
    traced = trace_and_count(
        loaded.module, loaded.input_shape, input_dtype=loaded.input_dtype, forward_kwargs=loaded.forward_kwargs
    )
    base = analyze(traced, batch_size)
    base_bound = identifiability(traced, batch_size, max_recoverable=ceiling)
    judged_round = round_ or Round(batch_size=batch_size)
    base_sample = sample_identifiability(traced, judged_round, max_recoverable=ceiling)
    try:
        energy = EnergyScale.of(traced.inputs, base_sample.unknowns, data, ceiling, exposed_below)
        base_bound.sample = base_sample
        reference = certify(base_bound, traced.inputs, data, exposed_below)  # the levels `check` prints
    except ReferenceDataError as exc:
        raise UsageError(str(exc), "give a readable --data, or leave it out to use the shipped reference") from exc
    readouts = {name for _, name, _, _ in readout_layers(traced)}
    skipped: list[str] = []
    suggestions = []

    def add(edit, target, detail, edited, delta):
        result = analyze(edited, batch_size)
        sample = sample_identifiability(edited, judged_round, max_recoverable=ceiling)
        sample.level = energy.level(sample.rank_bound)  # the input, hence the reference, is the unedited one's
        suggestions.append(
            Suggestion(
                edit,
                target,
                detail,
                result.ra_i,
                result.critical_layer,
                sample.level,
                delta,
                sample.level != base_sample.level,
                sample.rank_bound,
                sample.unknowns - sample.rank_bound,
                sample.recoverable_fraction,
            )
        )

    for target, detail, edited, delta in _cut_skips(traced, base):
        add("cut-skip", target, detail, edited, delta)
    for target, detail, edited, delta in _narrow_edits(traced, base, skipped):
        add("narrow", target, detail, edited, delta)
    for target, detail, edited, delta in _stride_edits(loaded.module, loaded.input_shape, skipped):
        add("stride", target, detail, edited, delta)
    for target, detail, edited, delta in _remove_bias_edits(traced):
        if target.split("#")[0] in readouts:
            detail += "; stops the exact bias readout of a sample, though the weight rows still point along it"
        add("remove-bias", target, detail, edited, delta)
    certifying_batch = smallest_certified_batch(traced, batch_size, base_bound)
    protecting_batch = smallest_protected_batch(traced, batch_size, base_bound, ceiling, energy)
    suggestions.sort(key=lambda s: (s.recoverable_fraction, s.ra_i is None, -(s.ra_i if s.ra_i is not None else 0)))
    protecting = certifying_withheld(traced, batch_size, max_recoverable=ceiling, round_=round_, energy=energy)
    deficit_only = (
        None
        if protecting is not None
        else certifying_withheld(
            traced, batch_size, max_recoverable=ceiling, aim="partial", round_=round_, energy=energy
        )
    )
    review = round_review(traced, round_, ceiling, energy) if round_ is not None else None
    structural = (
        base_sample.level == "protected"
        or protecting is not None
        or any(s.verdict == "protected" for s in suggestions)
        or (review is not None and any(setting.value is not None or setting.unbounded for setting in review.settings))
    )
    tokens = token_leakage(traced, batch_size, None)
    span = (
        {
            "token_span_exposed": tokens.span_exposing,
            "safe_tokens_per_batch": tokens.safe_tokens_per_batch,
            "safe_token_batch": tokens.safe_batch_size,
            "tokens_per_batch": tokens.layers[0].tokens_per_batch if tokens.layers else None,
        }
        if tokens
        else {}
    )
    return SuggestReport(
        spec,
        loaded.input_shape,
        batch_size,
        base.ra_i,
        base.critical_layer,
        base_sample.level,
        suggestions,
        skipped,
        unknowns=base_bound.unknowns,
        rank_bound=base_bound.rank_bound,
        certified_deficit=base_bound.certified_deficit,
        certifying_batch=certifying_batch,
        protecting_batch=protecting_batch,
        max_recoverable=ceiling,
        recoverable_fraction=base_bound.recoverable_fraction,
        certifying_withheld=protecting,
        deficit_withheld=deficit_only,
        round_review=review,
        seconds=time.perf_counter() - started,
        sample=base_sample,
        readout_layers=sorted(readouts),
        noise_is_the_way=not structural,
        spectrum=reference.name if reference is not None else "",
        exposed_below=energy.exposed_below,
        **span,
    )
