"""The searches beside the edits: the smallest batch certified or protected as a whole, the layers to withhold."""

from __future__ import annotations

from collections.abc import Callable

from rankaudit.bound.energy import EnergyScale
from rankaudit.bound.identifiability import (
    FlowNetwork,
    covers,
    identifiability,
    sample_identifiability,
    sample_unknowns,
    shared_predicate,
)
from rankaudit.count.op_counting import Role
from rankaudit.result import Identifiability, SampleBound
from rankaudit.settings.levels import DEFAULT_MAX_RECOVERABLE, VERDICT_LEVELS
from rankaudit.settings.round import Round
from rankaudit.trace.records import TracedModel


def smallest_certified_batch(
    traced: TracedModel, start: int = 1, at_start: Identifiability | None = None, sent: dict | None = None
) -> int:
    """Smallest B >= start with a certified deficit (method.md: the bound); `sent`: the layers sent (the shared or
    withheld layers, as keywords of the bound; default all).

    Each extra sample adds |x| unknowns and at most |x| flow, so the deficit never shrinks as B grows: a
    bisection finds the first B. Once B·|x| exceeds every shared gradient's size, the deficit is certain.
    """
    sent = sent or {}
    per_sample = sample_unknowns(traced)
    if (at_start or identifiability(traced, start, **sent)).certified_deficit:
        return start
    capacity = _sent_capacity(traced, sent)
    low, high = start, max(start + 1, capacity // max(per_sample, 1) + 1)
    while high - low > 1:
        middle = (low + high) // 2
        if identifiability(traced, middle, **sent).certified_deficit:
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
    sent: dict | None = None,
) -> int | None:
    """Smallest B >= start whose batch as a whole is `protected` on energy (method.md: energy: the hidden share of B
    samples' energy, R over B·|x|); None if no B is. `sent`: as smallest_certified_batch's.

    Every cut's capacity is a + B·b (gradients a, tensors B·b, both >= 0), so R(B) is their minimum and R(B)/B =
    min(a/B + b) never grows with B; the hidden share over B samples is the tail interpolated at R(B)/B, so it
    never shrinks: a bisection finds the first B. The cut through every shared gradient has b = 0, so from
    B·r >= their total size on (r: the largest protected rank per sample), the batch is protected.
    """
    energy = energy or EnergyScale.of(traced.inputs, sample_unknowns(traced), max_recoverable=max_recoverable)

    def protected(batch: int, bound: Identifiability | None = None) -> bool:
        bound = bound or identifiability(traced, batch, max_recoverable=max_recoverable, **(sent or {}))
        return energy.level(bound.rank_bound, batch) == "protected"

    if protected(start, at_start):
        return start
    largest = energy.whole_protected_rank()
    if largest <= 0:
        return None
    capacity = _sent_capacity(traced, sent or {})
    # The batch's certified share approaches the mean share from below as samples add up: at twice the batch where
    # the mean share is protected, the certificate is too (checked, not assumed).
    low, high = start, max(start + 1, int(2 * capacity / largest) + 1)
    if not protected(high):
        return None
    return first_true(protected, low, high)


def _sent_capacity(traced: TracedModel, sent: dict) -> int:
    """The values the server reads (every gradient sent, token tables and running statistics included, each tied
    parameter once): past B·|x| of them, the batch's deficit is certain."""
    is_sent = shared_predicate(sent.get("shared_layers"), sent.get("withheld_layers"))
    return FlowNetwork(traced, 1, is_sent).gradient_values()


def first_true(holds: Callable[[int], bool], low: int, high: int) -> int:
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
    sent: dict | None = None,
) -> list[str] | None:
    """A small set of layers whose gradients, withheld, bring each sample to the verdict level `aim` (method.md: each sample,
    method.md: energy: `protected`, or `partial`); None if no set that still shares some layer's gradient does (withholding
    every layer sends nothing to train with: that is no design, whatever it hides).
    Each sample is judged by sample_identifiability in `round_` (default: FedSGD at batch_size), its level read on
    energy (method.md: energy) by `energy` (default: the model's shipped reference at these thresholds).

    Greedy: withhold, one at a time, the layer whose removal lowers the rank bound most. Exact minimum sets are
    a combinatorial search; the greedy set is a certificate, not a proof that none smaller exists.

    `sent`: what the deployment already sends (its shared or withheld layers, as the bound's keywords): the set
    found is kept back beside the deployment's own withheld layers, or taken out of its shared ones.
    """
    judged_round = round_ or Round(batch_size=batch_size)
    energy = energy or EnergyScale.of(traced.inputs, sample_unknowns(traced), max_recoverable=max_recoverable)
    cache: dict = {}
    shared_layers, already = (sent or {}).get("shared_layers"), list((sent or {}).get("withheld_layers") or [])

    def judge(withheld_layers: list[str]) -> SampleBound:
        key = tuple(sorted(withheld_layers))
        if key not in cache:
            kept = (
                {"shared_layers": [name for name in shared_layers if name not in key]}
                if shared_layers
                else {"withheld_layers": already + list(key) or None}
            )
            cache[key] = sample_identifiability(traced, judged_round, max_recoverable=max_recoverable, **kept)
            cache[key].level = energy.level(cache[key].rank_bound)
        return cache[key]

    capacity: dict[str, int] = {}
    for node_id in traced.order:
        record = traced.record(node_id)
        if record.counting.role is Role.LAYER and record.counting.weights:
            layer = record.name.split("#")[0]
            if shared_layers:  # a name shared_layers gives stands for every layer under it
                for name in (name for name in shared_layers if covers(layer, [name])):
                    capacity[name] = capacity.get(name, 0) + record.counting.weights
            elif not covers(layer, already):
                capacity[layer] = record.counting.weights
    names = list(capacity)
    withheld: list[str] = []
    reached = VERDICT_LEVELS[VERDICT_LEVELS.index(aim) :]
    bound = judge([])
    while bound.level not in reached:
        candidates = [name for name in names if name not in withheld]
        if not candidates or (shared_layers and len(candidates) == 1):  # nothing left shared is no design
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
