#!/usr/bin/env python3
"""Zoo benchmark: run rankaudit, as a user would, over every model the installed libraries can build.

    python benchmarks/bench_zoo.py [--jobs 4] [--timeout 180] [--only hf|torchvision|timm] [--out zoo.json]

Sources: Hugging Face models built from their configs (always; transformers is a test dependency), torchvision's
classification models (all of them, the 15 RegNets included) and a broad sample of timm (the first model of
every family, up to --timm-max) when those libraries are installed. Nothing is downloaded: every model gets its
random initialisation from its constructor.

Each model is one generated model file and one fresh `rankaudit FILE --format json` process (the whole user
path: import, build on meta, trace, count, report), with a wall-clock timeout. Printed: one row per model with
the exit code, seconds, RA-i, verdict, the identifiability bound (rank bound / unknowns) and the caveat codes;
failures (exit 2 or 3, timeouts) with the first line of their error; the summary line "N of M analysed" (exit 0
or 1). This is a benchmark, not a test: it always exits 0.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# Hugging Face: (model class, config class, config overrides, kind). Depth is cut to two layers so a sweep runs
# in minutes on two cores; widths stay at each config's defaults (the analysis is on meta: size costs nothing).
HF_MODELS = [
    ("BertForSequenceClassification", "BertConfig", {"num_hidden_layers": 2}, "text"),
    ("DistilBertForSequenceClassification", "DistilBertConfig", {"n_layers": 2}, "text"),
    ("RobertaForSequenceClassification", "RobertaConfig", {"num_hidden_layers": 2}, "text"),
    ("AlbertForSequenceClassification", "AlbertConfig", {"num_hidden_layers": 2}, "text"),
    ("ElectraForSequenceClassification", "ElectraConfig", {"num_hidden_layers": 2}, "text"),
    ("DebertaV2ForSequenceClassification", "DebertaV2Config", {"num_hidden_layers": 2}, "text"),
    ("GPT2LMHeadModel", "GPT2Config", {"n_layer": 2}, "text"),
    ("GPTNeoXForCausalLM", "GPTNeoXConfig", {"num_hidden_layers": 2}, "text"),
    ("OPTForCausalLM", "OPTConfig", {"num_hidden_layers": 2}, "text"),
    ("BloomForCausalLM", "BloomConfig", {"n_layer": 2}, "text"),
    ("LlamaForCausalLM", "LlamaConfig", {"num_hidden_layers": 2}, "text"),
    ("MistralForCausalLM", "MistralConfig", {"num_hidden_layers": 2}, "text"),
    ("Qwen2ForCausalLM", "Qwen2Config", {"num_hidden_layers": 2}, "text"),
    ("GemmaForCausalLM", "GemmaConfig", {"num_hidden_layers": 2}, "text"),
    ("PhiForCausalLM", "PhiConfig", {"num_hidden_layers": 2}, "text"),
    ("FalconForCausalLM", "FalconConfig", {"num_hidden_layers": 2}, "text"),
    ("T5ForConditionalGeneration", "T5Config", {"num_layers": 2, "num_decoder_layers": 2}, "text"),
    ("BartForConditionalGeneration", "BartConfig", {"encoder_layers": 2, "decoder_layers": 2}, "text"),
    ("ViTForImageClassification", "ViTConfig", {"num_hidden_layers": 2}, "image"),
    ("DeiTForImageClassification", "DeiTConfig", {"num_hidden_layers": 2}, "image"),
    ("BeitForImageClassification", "BeitConfig", {"num_hidden_layers": 2}, "image"),
    ("SwinForImageClassification", "SwinConfig", {"depths": [2, 2], "num_heads": [3, 6]}, "image"),
    ("ConvNextForImageClassification", "ConvNextConfig", {}, "image"),
    ("ResNetForImageClassification", "ResNetConfig", {}, "image"),
    ("MobileViTForImageClassification", "MobileViTConfig", {}, "image"),
    ("SegformerForImageClassification", "SegformerConfig", {}, "image"),
    ("EfficientNetForImageClassification", "EfficientNetConfig", {}, "image"),
    ("RegNetForImageClassification", "RegNetConfig", {}, "image"),
]
SEQUENCE = 128
TORCHVISION_INPUT = {"inception_v3": (3, 299, 299)}


@dataclass
class Entry:
    name: str  # source/model
    source: str  # hf | torchvision | timm
    code: str  # the generated model file's text


@dataclass
class Outcome:
    name: str
    source: str
    exit_code: int | None
    seconds: float
    ra_i: int | None = None
    verdict: str | None = None
    bound: str | None = None
    caveats: list[str] = field(default_factory=list)
    tracer: str | None = None
    build: str | None = None
    error: str | None = None


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def hf_entries() -> list[Entry]:
    import transformers

    entries = []
    for model_class, config_class, overrides, kind in HF_MODELS:
        if not hasattr(transformers, model_class) or not hasattr(transformers, config_class):
            continue
        if kind == "text":
            header = f"INPUT_SHAPE = ({SEQUENCE},)\nINPUT_DTYPE = torch.long\n"
            body = f"model = {model_class}({config_class}(**{overrides!r}))\n"
        else:
            body = (
                f"config = {config_class}(**{overrides!r})\nmodel = {model_class}(config)\n"
                "size = getattr(config, 'image_size', 224)\nsize = size if isinstance(size, int) else size[0]\n"
            )
            header = ""
            body += "INPUT_SHAPE = (getattr(config, 'num_channels', 3), size, size)\n"
        code = f"import torch\nfrom transformers import {model_class}, {config_class}\n{header}{body}"
        entries.append(Entry(f"hf/{model_class}", "hf", code))
    return entries


def torchvision_entries() -> list[Entry]:
    import torchvision

    entries = []
    for name in sorted(torchvision.models.list_models(module=torchvision.models)):
        shape = TORCHVISION_INPUT.get(name, (3, 224, 224))
        code = (
            f"import torchvision\nINPUT_SHAPE = {shape}\nmodel = torchvision.models.get_model({name!r}, weights=None)\n"
        )
        entries.append(Entry(f"torchvision/{name}", "torchvision", code))
    return entries


def timm_entries(limit: int) -> list[Entry]:
    import timm

    by_family: dict[str, str] = {}
    for name in timm.list_models():
        family = name.split("_")[0].rstrip("0123456789")
        by_family.setdefault(family, name)
    families = sorted(by_family.values())
    # Spread over the alphabet (every k-th family), not the first `limit` of it: a broad sample.
    step = max(1, len(families) / max(1, limit))
    chosen = sorted({families[int(i * step)] for i in range(min(limit, len(families)))})
    entries = []
    for name in chosen:
        code = (
            f"import timm\nmodel = timm.create_model({name!r}, pretrained=False)\n"
            "INPUT_SHAPE = tuple(model.pretrained_cfg.get('input_size', (3, 224, 224)))\n"
        )
        entries.append(Entry(f"timm/{name}", "timm", code))
    return entries


def _first_error_line(stderr: str) -> str:
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("rankaudit: error:")]
    line = (errors or lines or ["(no output)"])[-1]
    return line if len(line) <= 300 else line[:297] + "..."


def run_one(entry: Entry, directory: str, timeout: float) -> Outcome:
    path = os.path.join(directory, entry.name.replace("/", "__") + ".py")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(entry.code)
    command = [sys.executable, "-m", "rankaudit", path, "--format", "json", "--fail-on", "exposed"]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
            env={**os.environ, "NO_COLOR": "1", "TOKENIZERS_PARALLELISM": "false"},
        )
    except subprocess.TimeoutExpired:
        return Outcome(
            entry.name, entry.source, None, time.perf_counter() - started, error=f"timeout after {timeout:.0f} s"
        )
    seconds = time.perf_counter() - started
    outcome = Outcome(entry.name, entry.source, done.returncode, seconds)
    if done.returncode in (0, 1):
        try:
            payload = json.loads(done.stdout)
        except json.JSONDecodeError:
            outcome.error = "exit 0/1 but no JSON: " + _first_error_line(done.stderr)
            return outcome
        bound = payload.get("identifiability")
        outcome.ra_i, outcome.verdict = payload.get("ra_i"), payload.get("verdict")
        if bound:  # the identifiability bound (method.md: the bound); absent from older reports
            outcome.bound = f"{bound['rank_bound']}/{bound['unknowns']}"
        outcome.caveats = sorted(Counter(c["code"] for c in payload.get("caveats", [])))
        outcome.tracer, outcome.build = payload.get("tracer"), payload.get("build")
    else:
        outcome.error = _first_error_line(done.stderr)
    return outcome


def _table(outcomes: list[Outcome]) -> str:
    rows = [("model", "exit", "seconds", "RA-i", "verdict", "bound", "tracer", "caveats")]
    for o in outcomes:
        rows.append(
            (
                o.name,
                "timeout" if o.exit_code is None else str(o.exit_code),
                f"{o.seconds:.1f}",
                "-" if o.ra_i is None else str(o.ra_i),
                o.verdict or "-",
                o.bound or "-",
                (o.tracer or "-").replace("torch.", ""),
                ",".join(o.caveats) or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            cell.ljust(widths[i]) if i in (0, 4, 6, 7) else cell.rjust(widths[i]) for i, cell in enumerate(row)
        ).rstrip()
        for row in rows
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per model")
    parser.add_argument("--only", choices=("hf", "torchvision", "timm"), action="append")
    parser.add_argument(
        "--timm-max",
        type=int,
        default=80,
        help="timm families sampled, evenly over the sorted list (first model of each)",
    )
    parser.add_argument("--match", help="only models whose name contains this text")
    parser.add_argument("--out", help="also write every outcome as JSON here")
    args = parser.parse_args(argv)

    sources = args.only or ["hf", "torchvision", "timm"]
    entries, skipped = [], []
    if "hf" in sources:
        entries += hf_entries()
    for library, make in (("torchvision", torchvision_entries), ("timm", lambda: timm_entries(args.timm_max))):
        if library in sources:
            if _installed(library):
                entries += make()
            else:
                skipped.append(library)
    if args.match:
        entries = [e for e in entries if args.match in e.name]
    print(
        f"{len(entries)} models ({', '.join(f'{k}: {v}' for k, v in Counter(e.source for e in entries).items())}); "
        f"{args.jobs} at a time, timeout {args.timeout:.0f} s"
        + (f"; not installed: {', '.join(skipped)}" if skipped else ""),
        flush=True,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="rankaudit-zoo-") as directory:
        with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
            outcomes = list(pool.map(lambda e: run_one(e, directory, args.timeout), entries))
    print(_table(outcomes))
    failures = [o for o in outcomes if o.exit_code not in (0, 1)]
    if failures:
        print("\nFailures:")
        for o in failures:
            print(f"  {o.name}: {'timeout' if o.exit_code is None else 'exit ' + str(o.exit_code)}: {o.error}")
    analysed = len(outcomes) - len(failures)
    by_source = ", ".join(
        f"{source} {sum(1 for o in outcomes if o.source == source and o.exit_code in (0, 1))}/"
        f"{sum(1 for o in outcomes if o.source == source)}"
        for source in dict.fromkeys(o.source for o in outcomes)
    )
    print(
        f"\n{analysed} of {len(outcomes)} analysed ({by_source}) in {time.perf_counter() - started:.0f} s "
        f"wall, {args.jobs} jobs"
    )
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(
                {
                    "analysed": analysed,
                    "total": len(outcomes),
                    "skipped_libraries": skipped,
                    "outcomes": [asdict(o) for o in outcomes],
                },
                handle,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
