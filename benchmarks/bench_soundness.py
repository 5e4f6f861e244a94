#!/usr/bin/env python3
"""Soundness across the zoo: the static bound (method.md: the bound) against the measured rank of ∂g/∂x (method.md: numerical check).

    python benchmarks/bench_soundness.py [--only examples|torchvision|timm] [--filter SUBSTRING]
                                         [--device auto] [--precision auto] [--max-params N] [--out rows.json]

For every image model of the repository's examples/ (at its INPUT_SHAPE) and every torchvision and timm
classification model installed (at 3x32x32 with 10 classes, random initialisation, nothing downloaded): the static
rank bound and verdict as `rankaudit` computes them from a generated model file, then the measured rank at a seeded
uniform input (seed 0) with its gap, precision and seconds. Rows whose measured rank exceeds the bound are UNSOUND;
a `protected` verdict on a model whose input one gradient determines (full measured rank) is a FALSE PROTECTED.
Both counts must be 0. Models that do not accept 32 px (or whose analysis fails) are skipped with the reason;
models above --max-params shared values are skipped as too slow for the device (the sketch needs one double
backward per row, about n rows, each touching every parameter). The last lines give the counts and which zoos were
absent. CI runs the examples only (tests/test_bench_soundness.py); a GPU run over the whole zoo fills the README.
This is a benchmark: it exits 0 whatever it finds (the counts are the result).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rankaudit.errors import RankauditError  # noqa: E402

ZOO_INPUT = (3, 32, 32)
ZOO_CLASSES = 10
SOURCES = ("examples", "torchvision", "timm")


@dataclass
class Entry:
    name: str  # source/model
    source: str
    spec: str  # a model file rankaudit reads (PATH or PATH:NAME)


@dataclass
class Row:
    name: str
    source: str
    status: str  # ok | UNSOUND | FALSE PROTECTED | skipped
    reason: str = ""
    parameters: int | None = None
    unknowns: int | None = None
    rank_bound: int | None = None
    verdict: str | None = None
    rank: int | None = None
    gap: float | None = None
    precision: str | None = None
    seconds: float | None = None


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def example_entries() -> list[Entry]:
    """Every example that reads one float tensor (the token models take ids: --verify rank does not apply)."""
    entries = []
    for path in sorted((REPO / "examples").glob("*.py")):
        text = path.read_text()
        if "INPUT_DTYPE" in text:
            continue
        entries.append(Entry(f"examples/{path.stem}", "examples", str(path)))
    return entries


def _zoo_file(directory: Path, name: str, code: str) -> str:
    path = directory / (name.replace("/", "__").replace(".", "_") + ".py")
    path.write_text(f"INPUT_SHAPE = {ZOO_INPUT}\n{code}")
    return str(path)


def torchvision_entries(directory: Path) -> list[Entry]:
    import torchvision

    return [
        Entry(
            f"torchvision/{name}",
            "torchvision",
            _zoo_file(
                directory,
                f"torchvision/{name}",
                f"import torchvision\nmodel = torchvision.models.get_model({name!r}, weights=None, "
                f"num_classes={ZOO_CLASSES})\n",
            ),
        )
        for name in sorted(torchvision.models.list_models(module=torchvision.models))
    ]


def timm_entries(directory: Path) -> list[Entry]:
    import timm

    return [
        Entry(
            f"timm/{name}",
            "timm",
            _zoo_file(
                directory,
                f"timm/{name}",
                f"import timm\nmodel = timm.create_model({name!r}, pretrained=False, num_classes={ZOO_CLASSES})\n",
            ),
        )
        for name in sorted(timm.list_models())
    ]


def measure_entry(spec: str, result, *, device: str, precision: str, seed: int = 0):
    """The measured rank at a seeded uniform input, as tests/conftest.py's measured_rank draws it."""
    from rankaudit.verify.client import draw_labels, logits_of, loss_name_for
    from rankaudit.verify.model import build_real_model
    from rankaudit.verify.rank import jacobian as rank

    model, _ = build_real_model(spec, result.input_shape, seed)
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand((1, *result.input_shape), generator=generator, dtype=torch.float64)
    with torch.no_grad():
        logits = logits_of(model(images[:1]))
    loss = loss_name_for(logits.numel())
    labels = draw_labels(1, loss, logits.numel(), seed)
    return rank.measure(model, images, labels, seed=seed, loss=loss, device=device, precision=precision)


def soundness_row(entry: Entry, measure: Callable, *, max_params: int | None) -> Row:
    """One model: the static bound and verdict, the measured rank, and whether they agree."""
    from rankaudit.audit import audit

    try:
        result = audit(entry.spec)
    except (RankauditError, RuntimeError, ValueError, TypeError) as exc:  # e.g. a model that needs more than 32 px
        return Row(entry.name, entry.source, "skipped", f"analysis failed: {_first_line(exc)}")
    bound = result.identifiability
    row = Row(
        entry.name,
        entry.source,
        "skipped",
        parameters=result.parameters,
        unknowns=bound.unknowns,
        rank_bound=bound.rank_bound,
        verdict=result.verdict,
    )
    if max_params is not None and result.parameters > max_params:
        row.reason = f"{result.parameters:,} parameters, above --max-params {max_params:,}"
        return row
    started = time.perf_counter()
    try:
        measured = measure(entry.spec, result)
    except (RankauditError, RuntimeError, ValueError, TypeError) as exc:
        row.reason = f"rank check failed: {_first_line(exc)}"
        return row
    row.seconds = round(time.perf_counter() - started, 2)
    row.rank, row.precision = measured.rank, measured.precision
    row.gap = measured.gap if measured.gap is None or measured.gap != float("inf") else None
    if measured.rank > bound.rank_bound:
        row.status, row.reason = "UNSOUND", f"measured rank {measured.rank} above the bound {bound.rank_bound}"
    elif result.verdict == "protected" and measured.deficit == 0:
        row.status, row.reason = "FALSE PROTECTED", "called protected, but one gradient determines the input"
    else:
        row.status = "ok"
        if not measured.reliable:
            row.reason = "gap under 1e3: the measured rank depends on the tolerance"
    return row


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def summary(rows: list[Row], absent: list[str]) -> list[str]:
    measured = [row for row in rows if row.status != "skipped"]
    unsound = sum(row.status == "UNSOUND" for row in rows)
    false_protected = sum(row.status == "FALSE PROTECTED" for row in rows)
    lines = [
        f"measured {len(measured)} of {len(rows)} models ({len(rows) - len(measured)} skipped)",
        f"unsound rows (measured rank above the bound): {unsound}",
        f"false protected verdicts (protected, but full measured rank): {false_protected}",
    ]
    if absent:
        lines.append("zoos absent: " + ", ".join(absent))
    return lines


def table(rows: list[Row]) -> list[str]:
    lines = [
        f"{'model':<34} {'params':>10} {'bound':>11} {'verdict':<9} {'rank':>6} {'gap':>9} {'prec':<7} {'s':>7}  status"
    ]
    for row in rows:
        bound = f"{row.rank_bound}/{row.unknowns}" if row.unknowns else "-"
        gap = f"{row.gap:.2g}" if row.gap is not None else "-"
        lines.append(
            f"{row.name:<34} {row.parameters or 0:>10,} {bound:>11} {row.verdict or '-':<9} "
            f"{row.rank if row.rank is not None else '-':>6} {gap:>9} {row.precision or '-':<7} "
            f"{row.seconds if row.seconds is not None else '-':>7}  {row.status}"
            + (f": {row.reason}" if row.reason else "")
        )
    return lines


def main(argv: list[str] | None = None, measure: Callable | None = None) -> list[Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=SOURCES, action="append", help="Sources to run (default: all).")
    parser.add_argument("--filter", help="Only models whose name contains this.")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--precision", default="auto", choices=("auto", "float64", "float32"))
    parser.add_argument("--max-params", type=int, help="Skip models with more parameters (too slow).")
    parser.add_argument("--out", help="Write the rows as JSON.")
    args = parser.parse_args(argv)
    from rankaudit.verify.model import resolve_device

    device = resolve_device(args.device)
    measure = measure or (lambda spec, result: measure_entry(spec, result, device=device, precision=args.precision))
    sources = args.only or list(SOURCES)
    absent = [f"{name} (not installed)" for name in ("torchvision", "timm") if name in sources and not _installed(name)]
    with tempfile.TemporaryDirectory(prefix="rankaudit-soundness-") as scratch:
        entries = example_entries() if "examples" in sources else []
        if "torchvision" in sources and _installed("torchvision"):
            entries += torchvision_entries(Path(scratch))
        if "timm" in sources and _installed("timm"):
            entries += timm_entries(Path(scratch))
        if args.filter:
            entries = [entry for entry in entries if args.filter in entry.name]
        rows = []
        print(table([])[0], flush=True)
        for entry in entries:
            rows.append(soundness_row(entry, measure, max_params=args.max_params))
            print(table([rows[-1]])[1], flush=True)
    print(f"\ndevice {device}, precision {args.precision}, torch {torch.__version__}")
    for line in summary(rows, absent):
        print(line)
    if args.out:
        Path(args.out).write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
