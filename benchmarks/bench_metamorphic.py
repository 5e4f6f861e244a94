#!/usr/bin/env python3
"""Metamorphic soundness sweep: every base of benchmarks/metamorphic.py (the test suite's and larger ones), every
single rewrite of each step and random mixes of rewrites, at several seeds (weights and input); for each variant
the static per-sample bound against the rank of ∂g/∂x measured in float64.

    python benchmarks/bench_metamorphic.py [--seeds 3] [--mixes 8] [--filter SUBSTRING] [--out rows.json]

Prints one line per variant that is unsound or whose measurement is unreliable, then the totals: variants tried,
unsound ones (must be 0), and the largest and median ratio rank / bound (how close the bound comes to the
measurement). This is a benchmark: it exits 0 whatever it finds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]
import metamorphic  # noqa: E402  (beside this file)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="seeds per variant (weights and input)")
    parser.add_argument("--mixes", type=int, default=8, help="random mixes of rewrites per base and seed")
    parser.add_argument("--filter", default="", help="only variants whose name contains this")
    parser.add_argument("--out", help="write every row as JSON here")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    bases = metamorphic.BASES + metamorphic.EXTRA_BASES
    rows, started = [], time.time()
    for seed in range(args.seeds):
        seen = set()
        for variant in metamorphic.variants(bases, mixes=args.mixes, seed=seed):
            if args.filter not in variant.name or (variant.name, seed) in seen:
                continue
            seen.add((variant.name, seed))
            outcome = metamorphic.check(variant, seed)
            rows.append({**asdict(outcome), "seed": seed, "sound": outcome.sound})
            if not outcome.sound or not outcome.reliable:
                state = "UNSOUND" if not outcome.sound else "unreliable"
                print(f"{state}: {outcome.variant} seed {seed}: bound {outcome.bound}, rank {outcome.rank}", flush=True)
    ratios = [row["rank"] / row["bound"] for row in rows if row["bound"]]
    unsound = sum(not row["sound"] for row in rows)
    print(
        f"{len(rows)} variants ({len({row['variant'] for row in rows})} distinct spellings, {args.seeds} seeds, "
        f"{len(bases)} bases): unsound {unsound}, unreliable {sum(not row['reliable'] for row in rows)}; "
        f"rank / bound: largest {max(ratios):.3f}, median {statistics.median(ratios):.3f}; "
        f"{time.time() - started:.0f} s"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
