"""The energy certificate against the hidden energy `--verify rank` measures at the seeded weights, per example.

For every model in examples/ (or the ones named): h_cert and the PSNR ceiling from the static analysis (the shipped
photograph spectrum), then `rankaudit MODEL --verify rank --samples K` at the seeded initialisation and the default
photo crops: the mean and the smallest measured hidden energy over the K samples. The certificate holds for any
weights, so the mean measured share must not fall below it (up to the sampling error of K samples).

    python benchmarks/bench_energy.py [--samples 4] [--timeout 300] [examples/lenet.py ...]

Token models are skipped (their own finding). Writes a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--timeout", type=int, default=300)
    args = parser.parse_args()
    models = [Path(m) for m in args.models] or sorted(EXAMPLES.glob("*.py"))
    print("| model | R_s of \\|x\\| | h_cert | PSNR ceiling | measured mean h | smallest h | holds |")
    print("|---|---|---|---|---|---|---|")
    for model in models:
        with tempfile.TemporaryDirectory() as folder:
            report = Path(folder) / "report.json"
            command = [sys.executable, "-m", "rankaudit", str(model), "--verify", "rank", "--samples"]
            command += [str(args.samples), "--format", "json", "-o", str(report), "--fail-on", "never", "-q"]
            # Its own session, so that a timeout ends the check's worker processes too, not only the check.
            process = subprocess.Popen(
                command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
            )
            try:
                process.wait(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                print(f"| {model.stem} | timed out after {args.timeout} s | | | | | |", flush=True)
                continue
            if not report.exists():
                print(f"| {model.stem} | no report | | | | | |", flush=True)
                continue
            payload = json.loads(report.read_text())
        sample = (payload.get("identifiability") or {}).get("sample") or {}
        certified = sample.get("certified_hidden_energy")
        rank = (payload.get("verification") or {}).get("rank") or {}
        hidden = [
            entry["hidden_energy"]
            for measured in rank.get("samples") or []
            for entry in measured.get("inputs") or []
            if entry.get("hidden_energy") is not None
        ]
        if certified is None or not hidden:
            print(f"| {model.stem} | no certificate or no measurement (token input?) | | | | | |", flush=True)
            continue
        mean = sum(hidden) / len(hidden)
        ceiling = sample.get("visible_psnr_ceiling")
        print(
            f"| {model.stem} | {sample['rank_bound']:,} of {sample['unknowns']:,} | {certified:.3%} | "
            f"{'∞' if ceiling is None else f'{ceiling:.1f} dB'} | {mean:.3%} | {min(hidden):.3%} | "
            f"{'yes' if mean >= certified else 'NO'} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
