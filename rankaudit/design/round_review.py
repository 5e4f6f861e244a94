"""The round's review: the N, E and C at which each sample of the round is protected, one knob at a time."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rankaudit.bound.energy import EnergyScale
from rankaudit.bound.identifiability import identifiability, round_identifiability, sample_unknowns
from rankaudit.design.searches import first_true
from rankaudit.result import Identifiability, SampleBound
from rankaudit.settings.levels import ceiling as level_ceiling
from rankaudit.settings.round import Round
from rankaudit.trace.records import TracedModel


@dataclass
class RoundSetting:
    """One knob of the round moved to where each sample becomes `protected` (method.md: each sample, energy), with its bound."""

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
    """The round as given and the three single changes that make each sample `protected` (method.md: each sample): the
    verdict, bound and fraction are per sample; `whole_*` are the round as a whole (method.md: the round). The levels are
    read on energy (method.md: energy), as `check` reads them."""

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


# Searches stop here: a round that needs more local samples or clients than this is reported as not found.
MAX_ROUND_SEARCH = 1_000_000


def round_review(
    traced: TracedModel,
    round_: Round,
    max_recoverable: float | None = None,
    energy: EnergyScale | None = None,
    sent: dict | None = None,
) -> RoundReview:
    """Per sample (method.md: each sample): the N, E and C at which each sample of the round is `protected`, one knob at a time,
    each level read on energy (method.md: energy) by `energy` (default: the model's shipped reference), on what the
    client sends (`sent`: the shared or withheld layers, as the bound's keywords; default all).

    R_s = min(|x|, |θ_s|, E·R(1)) holds whatever N, B and C are: more local samples or clients never protect a
    sample (they only raise the hidden share of the round as a whole, reported beside it), and the largest E is the
    last whose E·R(1) (or the |θ_s| cap) keeps the hidden share protected. The hidden share only shrinks as R_s
    grows, so the searches stay monotone. Each try is arithmetic: the bound's max flows are cached.
    """
    ceiling = level_ceiling(max_recoverable)
    energy = energy or EnergyScale.of(traced.inputs, sample_unknowns(traced), max_recoverable=ceiling)
    cache: dict = {}

    def judged(changed: Round) -> Identifiability:
        bound = round_identifiability(traced, changed, max_recoverable=ceiling, cache=cache, **(sent or {}))
        bound.sample.level = energy.level(bound.sample.rank_bound)
        return bound

    def whole_level(bound: Identifiability) -> str:
        return energy.level(bound.rank_bound, max(bound.unknowns // max(bound.sample.unknowns, 1), 1))

    def whole_protected(bound: Identifiability) -> bool:
        return whole_level(bound) == "protected"

    def first_whole(setting: str, low: int, high: int) -> int | None:
        """The least value in [low, high] of one setting at which the round as a whole is protected (method.md: the round), for
        the record. The round's bound per sample, R/(N·C), never grows with N or C (each sample adds at most |x|,
        the |θ_s| cap does not grow), so its hidden share never shrinks: a bisection, not a scan of up to a
        million rounds (photographs need R/(N·C) under one direction per sample)."""

        def protected(value: int) -> bool:
            return whole_protected(judged(dataclasses.replace(round_, **{setting: value})))

        if protected(low):
            return low
        if high <= low or not protected(high):
            return None
        return first_true(protected, low, high)

    base = judged(round_)
    sample = base.sample
    per_sample = sample.unknowns
    values = cache.get("update_values") or identifiability(traced, 1, **(sent or {})).rank_bound
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
        # The round as a whole needs R <= its samples · largest at least (the mean share); its certified share
        # approaches the mean from below as samples add up, so twice that many is where the search stops.
        largest = energy.whole_protected_rank()
        enough = math.ceil(2 * values / max(largest * scale, 1e-300)) if largest > 0 else None
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
