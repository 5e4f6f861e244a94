"""Snapshot every public output of rankaudit, and compare two snapshots: a refactor leaves them byte-identical.

    python dev/output_snapshot.py capture OUT [--rankaudit CMD]    # run from a checkout's root; writes OUT/
    python dev/output_snapshot.py compare BEFORE AFTER              # exit 1 when anything differs beyond timing

`capture` runs the command line on every example (table, -v, json, sarif, html), every test app (table, json), each
command's --help, suggest, compare, a DP run and a multi-round run; it keeps stdout, stderr and the exit code of each.
`compare` reads two snapshots and lists the files that differ once timings ("seconds": 0.41, "in 0.016 s") and the
checkout's own absolute path (SARIF's originalUriBaseIds) are blanked: those are the only bytes allowed to change.
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_TIMINGS = (
    (re.compile(r'"(seconds|setup_seconds)": [0-9.e+-]+'), r'"\1": T'),
    (re.compile(r"\b\d+(\.\d+)? ?m?s\b"), "T s"),
)
_ROOT_LINE = re.compile(r"^# root: (.*)$", re.M)


def _runs(repo: Path) -> dict[str, list[str]]:
    runs = {}
    for example in sorted((repo / "examples").glob("*.py")):
        path = f"examples/{example.name}"
        runs[f"{example.stem}.table"] = [path]
        runs[f"{example.stem}.verbose"] = [path, "-v"]
        for output in ("json", "sarif", "html"):
            runs[f"{example.stem}.{output}"] = [path, "--format", output]
    for app in sorted(p for p in (repo / "tests" / "apps").iterdir() if p.is_dir()):
        path = f"tests/apps/{app.name}/"
        runs[f"app_{app.name}.table"] = [path, "--format", "table"]
        runs[f"app_{app.name}.json"] = [path, "--format", "json"]
    for command in ("", "check", "suggest", "compare"):
        runs[f"help_{command or 'main'}"] = [command, "--help"] if command else ["--help"]
    runs["suggest_lenet"] = ["suggest", "examples/lenet.py"]
    runs["suggest_strided_json"] = ["suggest", "examples/strided_stem.py", "--format", "json"]
    runs["compare_lenet"] = ["compare", "examples/lenet.py", "examples/cnn6.py"]
    runs["compare_json"] = ["compare", "examples/lenet.py", "examples/mlp6.py", "--format", "json"]
    runs["dp_lenet"] = ["examples/lenet.py", "--dp-noise", "1.0", "--dp-clip", "1.0", "--format", "json"]
    runs["rounds_lenet"] = ["examples/lenet.py", "-v", "--local-samples", "64", "--local-epochs", "2"]
    runs["rounds_lenet"] += ["--server-rounds", "3"]
    return runs


def capture(out: Path, rankaudit: str, jobs: int) -> None:
    repo = Path.cwd()
    out.mkdir(parents=True, exist_ok=True)
    (out / "ROOT").write_text(f"# root: {repo.resolve()}\n", encoding="utf-8")

    def run(item):
        name, arguments = item
        done = subprocess.run([*shlex.split(rankaudit), *arguments], cwd=repo, capture_output=True, timeout=600)
        (out / f"{name}.out").write_bytes(done.stdout)
        (out / f"{name}.err").write_bytes(done.stderr)
        (out / f"{name}.rc").write_text(f"{done.returncode}\n", encoding="utf-8")

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run, _runs(repo).items()))
    print(f"{len(_runs(repo))} runs captured in {out}")


def _normalised(text: str, root: str) -> str:
    text = text.replace(root, "ROOT")
    for pattern, replacement in _TIMINGS:
        text = pattern.sub(replacement, text)
    return text


def compare(before: Path, after: Path) -> int:
    roots = [
        _ROOT_LINE.search((snapshot / "ROOT").read_text(encoding="utf-8")).group(1) for snapshot in (before, after)
    ]
    names = sorted(p.name for p in before.iterdir() if p.name != "ROOT")
    missing = [name for name in names if not (after / name).exists()]
    raw_same, differ = 0, []
    for name in names:
        if name in missing:
            continue
        old, new = (before / name).read_text(errors="replace"), (after / name).read_text(errors="replace")
        raw_same += old == new
        if old != new and _normalised(old, roots[0]) != _normalised(new, roots[1]):
            differ.append(name)
    print(f"{len(names)} files: {raw_same} identical byte for byte, {len(missing)} missing after, ", end="")
    print(f"{len(differ)} differ beyond timings and the checkout's path")
    for name in missing + differ:
        print("  " + name)
    return 1 if missing or differ else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    take = commands.add_parser("capture", help="run every output into OUT (from a checkout's root)")
    take.add_argument("out", type=Path)
    take.add_argument(
        "--rankaudit", default=f"{sys.executable} -m rankaudit", help="the command to run (default: this Python's)"
    )
    take.add_argument("--jobs", type=int, default=2)
    check = commands.add_parser("compare", help="compare two snapshots")
    check.add_argument("before", type=Path)
    check.add_argument("after", type=Path)
    arguments = parser.parse_args()
    if arguments.command == "capture":
        capture(arguments.out, arguments.rankaudit, arguments.jobs)
        return 0
    return compare(arguments.before, arguments.after)


if __name__ == "__main__":
    sys.exit(main())
