"""Metamorphic soundness: small models rewritten into the same maths spelled differently (benchmarks/metamorphic.py),
each variant's static per-sample bound at least the rank of ∂g/∂x measured on real float64 tensors.

Every single rewrite of every step is tried once (a rewrite of a step several bases share, in the first of them);
benchmarks/bench_metamorphic.py runs the longer sweep with random mixes of rewrites and more seeds."""

from __future__ import annotations

import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import metamorphic  # noqa: E402

VARIANTS = list(metamorphic.variants(each_rewrite_once=True))


def test_the_generator_rewrites_every_step_of_every_base():
    rewrites = {
        (label, spelling) for base in metamorphic.BASES for label, choices, _ in base.steps for spelling in choices[1:]
    }
    tried = {
        (label, spelling)
        for variant in VARIANTS
        for (label, choices, _), spelling in zip(variant.base.steps, variant.spellings)
        if spelling != choices[0]
    }
    assert tried == rewrites
    assert len(VARIANTS) >= 60


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda variant: variant.name)
def test_bound_is_at_least_the_measured_rank(variant):
    outcome = metamorphic.check(variant)
    assert outcome.reliable, f"{outcome.variant}: the measured rank is not reliable"
    assert outcome.sound, (
        f"{outcome.variant}: static per-sample bound {outcome.bound} < measured rank {outcome.rank}"
        f" of {outcome.unknowns} unknowns"
    )
