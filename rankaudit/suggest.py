"""Design review: single architectural edits, each re-counted and re-bounded on the traced graph, and ranked."""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

from torch import nn

from rankaudit.analysis import analyze
from rankaudit.bound import gradient_sources, identifiability, round_identifiability
from rankaudit.errors import RankauditError
from rankaudit.findings import token_leakage
from rankaudit.levels import DEFAULT_MAX_RECOVERABLE, VERDICT_LEVELS, verdict_level
from rankaudit.load import load_model
from rankaudit.ops import Counting, Role
from rankaudit.result import DPNoiseSuggestion, Identifiability, Result
from rankaudit.round import Round
from rankaudit.trace import NodeRecord, TracedModel, trace_model

EDITS = ("cut-skip", "narrow", "stride", "remove-bias", "batch-size")
ACCURACY_NOTE = ("Accuracy is not measured: each edit changes what the model can learn, so retrain and compare "
                 "before adopting one (R-GAP's Figure 4 found cutting block 3's skip cost no accuracy on CIFAR-10).")


@dataclass
class Suggestion:
    edit: str                  # one of EDITS
    target: str                # the block's or layer's qualified name (layer2.0), or "batch"
    detail: str                # what exactly changes, e.g. "out_channels 16 -> 5"
    ra_i: int | None
    critical_layer: str | None
    verdict: str               # the identifiability bound's verdict level on the edited model (spec §9, §11)
    delta_params: int
    crosses_verdict: bool      # the verdict differs from the unedited model's
    rank_bound: int = 0
    certified_deficit: int = 0
    recoverable_fraction: float = 1.0   # R/n of the edited model: the edits are ranked by it


@dataclass
class RoundSetting:
    """One knob of the round moved to where the round becomes `protected` (spec §11-§12), with its bound."""

    knob: str                      # local-samples | local-epochs | clients
    value: int | None              # the value found; None: no value in the range searched protects the round
    unbounded: bool                # local-epochs only: every number of epochs is protected (the |θ_s| cap binds)
    rank_bound: int = 0
    unknowns: int = 0
    recoverable_fraction: float = 1.0
    binding: str = ""
    explanation: str = ""          # why, or why no value was found


@dataclass
class RoundReview:
    """The round as given and the three single changes that make it `protected`."""

    round: Round
    verdict: str
    rank_bound: int
    unknowns: int
    recoverable_fraction: float
    max_recoverable: float
    settings: list[RoundSetting]


@dataclass
class SuggestReport:
    model: str
    input_shape: tuple[int, ...]
    batch_size: int
    ra_i: int | None
    critical_layer: str | None
    verdict: str
    suggestions: list[Suggestion]
    skipped: list[str] = field(default_factory=list)   # edits that could not be applied, and why
    unknowns: int = 0
    rank_bound: int = 0
    certified_deficit: int = 0
    certifying_batch: int | None = None        # smallest batch size with a certified deficit
    protecting_batch: int | None = None        # smallest batch size whose verdict is protected (None: none is)
    max_recoverable: float = DEFAULT_MAX_RECOVERABLE  # the ceiling on R/n that protected asks for
    recoverable_fraction: float = 1.0          # R/n of the model as it is
    certifying_withheld: list[str] | None = None  # layers whose gradients, kept back, make the verdict protected
    # Where no set of layers reaches protected (norms and other directly used parameters still send enough):
    # layers whose gradients, kept back, give at least a certified deficit (partial).
    deficit_withheld: list[str] | None = None
    # Language models: DAGER's span test on the layers reading per-token vectors (all gradients shared).
    token_span_exposed: list[str] = field(default_factory=list)  # layers whose gradient passes it at this B·n
    tokens_per_batch: int | None = None                  # B·n now
    safe_tokens_per_batch: int | None = None             # the smallest B·n at which it fails on every layer
    safe_token_batch: int | None = None                  # the smallest batch size reaching it at this length
    note: str = ACCURACY_NOTE
    seconds: float = 0.0
    round_review: RoundReview | None = None   # with a round: the N, E and C that make it protected
    noise: DPNoiseSuggestion | None = None     # with DP options: the least noise meeting --max-reconstruction


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
    return TracedModel({n: records[n] for n in order}, successors, order, traced.input_id,
                       [n for n in traced.output_ids if n in alive], traced.tracer, traced.fallback_reason,
                       traced.parameters)


def _params_of(record: NodeRecord) -> int:
    return record.counting.weights + record.counting.frozen_params + record.counting.reported_params


def _cut_skips(traced: TracedModel, base: Result) -> list[tuple[str, str, TracedModel, int]]:
    edits = []
    for block in base.blocks:
        add = traced.record(block.merge)
        main_input = next(i for i in add.inputs if i != block.shortcut_input)
        shortcut = set()
        if block.shortcut_input != block.fork:
            shortcut = ((traced.ancestors(block.shortcut_input) | {block.shortcut_input})
                        - traced.ancestors(block.fork) - {block.fork})
        passthrough = dataclasses.replace(add, inputs=[main_input], counting=Counting(Role.TRANSPARENT))
        removed = sum(_params_of(traced.record(n)) for n in shortcut)
        detail = "remove the identity skip" if not shortcut else \
            f"remove the skip and its projection ({', '.join(block.shortcut_layers)})"
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
    replaced = {node_id: dataclasses.replace(
        layer, output_numel=layer.output_numel * width // old,
        counting=dataclasses.replace(layer.counting, weights=layer.counting.weights * width // old,
                                     bias_params=layer.counting.bias_params * width // old, out_features=width))}
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
            edits.append((record.name, f"bias=False ({bias} parameters)",
                          _rebuilt(traced, {node_id: dataclasses.replace(record, counting=counting)}, set()), -bias))
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
            edited = trace_model(module, input_shape)
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
    per_sample = sum(traced.record(input_id).output_numel for input_id in traced.input_ids)
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


def smallest_protected_batch(traced: TracedModel, start: int = 1, at_start: Identifiability | None = None,
                             max_recoverable: float = DEFAULT_MAX_RECOVERABLE) -> int | None:
    """Smallest B >= start whose verdict is `protected` (R/n <= max_recoverable, spec §11); None if no B is.

    Every cut's capacity is a + B·b (gradients a, tensors B·b, both >= 0), so R(B) is their minimum and
    R(B)/(B·|x|) = min(a/B + b)/|x| never grows with B: a bisection finds the first B. The cut through every
    shared gradient has b = 0, so from B·|x|·max_recoverable >= their total size on, the verdict is protected.
    """
    def protected(batch: int, bound: Identifiability | None = None) -> bool:
        bound = bound or identifiability(traced, batch, max_recoverable=max_recoverable)
        return bound.verdict == "protected"

    if protected(start, at_start):
        return start
    if max_recoverable <= 0:
        return None
    per_sample = sum(traced.record(input_id).output_numel for input_id in traced.input_ids)
    capacity = sum(source.numel for n in traced.order for source in gradient_sources(traced.record(n)))
    capacity += sum(e.vocab_size * e.dim for e in traced.token_embeddings)
    low, high = start, max(start + 1, int(capacity / (max_recoverable * max(per_sample, 1))) + 1)
    if not protected(high):
        return None
    while high - low > 1:
        middle = (low + high) // 2
        if protected(middle):
            high = middle
        else:
            low = middle
    return high


def certifying_withheld(traced: TracedModel, batch_size: int, all_shared: Identifiability | None = None,
                        max_recoverable: float = DEFAULT_MAX_RECOVERABLE, aim: str = "protected") -> list[str] | None:
    """A small set of layers whose gradients, withheld, reach the verdict level `aim` (spec §11: `protected`, or
    `partial` for any certified deficit); None if even withholding all of them does not.

    Greedy: withhold, one at a time, the layer whose removal lowers the rank bound most. Exact minimum sets are
    a combinatorial search; the greedy set is a certificate, not a proof that none smaller exists.
    """
    capacity: dict[str, int] = {}
    for node_id in traced.order:
        record = traced.record(node_id)
        if record.counting.role is Role.LAYER and record.counting.weights:
            capacity[record.name.split("#")[0]] = record.counting.weights
    names = list(capacity)
    withheld: list[str] = []
    reached = VERDICT_LEVELS[VERDICT_LEVELS.index(aim):]
    bound = all_shared or identifiability(traced, batch_size, max_recoverable=max_recoverable)
    while bound.verdict not in reached:
        candidates = [name for name in names if name not in withheld]
        if not candidates:
            return None
        trials = [(identifiability(traced, batch_size, withheld_layers=withheld + [name],
                                   max_recoverable=max_recoverable), capacity[name], name)
                  for name in candidates]
        # Where no single layer lowers the bound yet (the input itself is the cut), take the most gradient away.
        bound, _, best = min(trials, key=lambda trial: (trial[0].rank_bound, -trial[1]))
        withheld.append(best)
    for name in sorted(withheld, key=capacity.__getitem__):   # then share again what the certificate can spare
        rest = [other for other in withheld if other != name]
        if identifiability(traced, batch_size, withheld_layers=rest,
                           max_recoverable=max_recoverable).verdict in reached:
            withheld = rest
    return withheld


# Searches stop here: a round that needs more local samples or clients than this is reported as not found.
MAX_ROUND_SEARCH = 1_000_000


def _setting(knob: str, value: int | None, bound: Identifiability | None, why: str = "",
             unbounded: bool = False) -> RoundSetting:
    if bound is None:
        return RoundSetting(knob, value, unbounded, explanation=why)
    caps = bound.round
    return RoundSetting(knob, value, unbounded, bound.rank_bound, bound.unknowns, bound.recoverable_fraction,
                        caps.binding if caps else "cut", why or (caps.explanation if caps else "§9's min cut"))


def round_review(traced: TracedModel, round_: Round, max_recoverable: float | None = None) -> RoundReview:
    """The smallest N, the largest E and the smallest C at which the round is `protected`, one knob at a time.

    ρ = min(n, |θ_s|, Σ) / n with n = C·N·|x|: the |θ_s| term falls as N or C grow and the steps' term Σ/n is
    about E·R(B)/(B·|x|), so more samples or clients can only help through the |θ_s| cap and more epochs only
    hurt. N and C are scanned upward to where |θ_s|/n reaches the ceiling (every round past it is protected);
    E upward while the round stays protected. Each try costs arithmetic: §9's max flows are cached per batch size.
    """
    ceiling = DEFAULT_MAX_RECOVERABLE if max_recoverable is None else max_recoverable
    cache: dict = {}

    def judged(changed: Round) -> Identifiability:
        return round_identifiability(traced, changed, max_recoverable=ceiling, cache=cache)

    def protected(bound: Identifiability) -> bool:   # FedSGD's bound included: spec §11's level at this ceiling
        return verdict_level(bound.rank_bound, bound.unknowns, ceiling) == "protected"

    base = judged(round_)
    per_sample = sum(traced.record(input_id).output_numel for input_id in traced.input_ids)
    values = cache.get("update_values") or identifiability(traced, 1).rank_bound
    settings = []
    # Local samples N: past |θ_s| / (ρ_max·C·|x|) the |θ_s| cap alone protects the round.
    enough = math.ceil(values / max(ceiling * round_.clients * per_sample, 1e-300)) if ceiling > 0 else None
    def first_protected(knob: str, field: str, values: range, symbol: str):
        """The least value of one round setting whose round is protected (the scan stops at the first)."""
        for value in values:
            bound = judged(dataclasses.replace(round_, **{field: value}))
            if protected(bound):
                return _setting(knob, value, bound)
        return _setting(knob, None, None, f"no {symbol} up to {MAX_ROUND_SEARCH:,} protects this round")

    last = max(round_.batch_size, min(enough or MAX_ROUND_SEARCH, MAX_ROUND_SEARCH))   # N >= B: one full batch
    settings.append(first_protected("local-samples", "local_samples", range(round_.batch_size, last + 1), "N"))
    # Local epochs E: the steps' term grows with E, the other caps do not change.
    one_epoch = judged(dataclasses.replace(round_, local_epochs=1))
    if not protected(one_epoch):
        settings.append(_setting("local-epochs", None, None, "even one local epoch is not protected: more epochs "
                                 "only add equations"))
    else:
        epochs, bound = 1, one_epoch
        if values <= ceiling * bound.unknowns:
            settings.append(_setting("local-epochs", None, bound, "any number of epochs: the update's |θ_s| values "
                                     "cap the round whatever the steps carry", unbounded=True))
        else:
            while epochs < MAX_ROUND_SEARCH:
                following = judged(dataclasses.replace(round_, local_epochs=epochs + 1))
                if not protected(following):
                    break
                epochs, bound = epochs + 1, following
            settings.append(_setting("local-epochs", epochs, bound))
    # Clients C under secure aggregation: the |θ_s| cap over C·N·|x| unknowns.
    enough = math.ceil(values / max(ceiling * round_.samples * per_sample, 1e-300)) if ceiling > 0 else None
    settings.append(first_protected("clients", "clients", range(1, min(enough or MAX_ROUND_SEARCH,
                                                                      MAX_ROUND_SEARCH) + 1), "C"))
    return RoundReview(round_, verdict_level(base.rank_bound, base.unknowns, ceiling), base.rank_bound,
                       base.unknowns, base.recoverable_fraction, ceiling,
                       settings)


def suggest(spec: str, *, input_shape: tuple[int, ...] | None = None, batch_size: int = 1,
            max_recoverable: float | None = None, round_: Round | None = None) -> SuggestReport:
    """Every single edit of EDITS that applies to the model, re-counted and ranked by the recoverable fraction
    R/n it reaches (the verdict level follows it, spec §11), then by the RA-i; with a round, also the N, E and C
    at which it is protected."""
    ceiling = DEFAULT_MAX_RECOVERABLE if max_recoverable is None else max_recoverable
    started = time.perf_counter()
    loaded = load_model(spec, input_shape, device="meta")
    traced = trace_model(loaded.module, loaded.input_shape, input_dtype=loaded.input_dtype,
                         forward_kwargs=loaded.forward_kwargs)
    base = analyze(traced, batch_size)
    base_bound = identifiability(traced, batch_size, max_recoverable=ceiling)
    skipped: list[str] = []
    suggestions = []

    def add(edit, target, detail, edited, delta, batch=batch_size):
        result = analyze(edited, batch)
        bound = identifiability(edited, batch, max_recoverable=ceiling)
        suggestions.append(Suggestion(edit, target, detail, result.ra_i, result.critical_layer, bound.verdict, delta,
                                      bound.verdict != base_bound.verdict, bound.rank_bound,
                                      bound.certified_deficit, bound.recoverable_fraction))

    for target, detail, edited, delta in _cut_skips(traced, base):
        add("cut-skip", target, detail, edited, delta)
    for target, detail, edited, delta in _narrow_edits(traced, base, skipped):
        add("narrow", target, detail, edited, delta)
    for target, detail, edited, delta in _stride_edits(loaded.module, loaded.input_shape, skipped):
        add("stride", target, detail, edited, delta)
    for target, detail, edited, delta in _remove_bias_edits(traced):
        add("remove-bias", target, detail, edited, delta)
    certifying_batch = smallest_certified_batch(traced, batch_size, base_bound)
    protecting_batch = smallest_protected_batch(traced, batch_size, base_bound, ceiling)
    for batch in dict.fromkeys((certifying_batch, protecting_batch)):
        if batch is not None and batch != batch_size:
            add("batch-size", "batch", f"batch size {batch_size} -> {batch} (samples per shared gradient)",
                traced, 0, batch=batch)
    suggestions.sort(key=lambda s: (s.recoverable_fraction, s.ra_i is None, -(s.ra_i if s.ra_i is not None else 0)))
    protecting = certifying_withheld(traced, batch_size, base_bound, ceiling)
    deficit_only = None if protecting is not None else certifying_withheld(traced, batch_size, base_bound, ceiling,
                                                                            aim="partial")
    tokens = token_leakage(traced, batch_size, None)
    span = {"token_span_exposed": tokens.span_exposing, "safe_tokens_per_batch": tokens.safe_tokens_per_batch,
            "safe_token_batch": tokens.safe_batch_size,
            "tokens_per_batch": tokens.layers[0].tokens_per_batch if tokens.layers else None} if tokens else {}
    return SuggestReport(spec, loaded.input_shape, batch_size, base.ra_i, base.critical_layer, base_bound.verdict,
                         suggestions, skipped, unknowns=base_bound.unknowns, rank_bound=base_bound.rank_bound,
                         certified_deficit=base_bound.certified_deficit, certifying_batch=certifying_batch,
                         protecting_batch=protecting_batch, max_recoverable=ceiling,
                         recoverable_fraction=base_bound.recoverable_fraction,
                         certifying_withheld=protecting, deficit_withheld=deficit_only,
                         round_review=round_review(traced, round_, ceiling) if round_ is not None else None,
                         seconds=time.perf_counter() - started, **span)
