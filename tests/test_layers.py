"""The package's shape: one folder per step of the data flow, imports that only look back, no circles, small modules.

Read from the source with `ast` (every import, at the top of a module or inside a function), so a lazy import that
reaches forward fails here just as a top-level one would.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rankaudit"

# The data flow, earliest first: a module may import its own step and the steps before it, never a later one.
# The client-side guard runs the verifiers' readouts on a client's real update, so it comes after them; nothing
# before the report reads it.
# Top-level modules sit where their imports put them: errors and the package's own constants before everything,
# the Result dataclasses right after the settings (they hold the round), the one call that runs the steps and the
# command line on top.
STEPS = (
    ("rankaudit", "rankaudit.errors"),
    ("rankaudit.settings",),
    ("rankaudit.result",),
    ("rankaudit.deploy",),
    ("rankaudit.model",),
    ("rankaudit.trace",),
    ("rankaudit.count",),
    ("rankaudit.bound",),
    ("rankaudit.findings",),
    ("rankaudit.verify",),
    ("rankaudit.guard",),
    ("rankaudit.design",),
    ("rankaudit.report",),
    ("rankaudit.audit",),
    ("rankaudit.cli", "rankaudit.__main__"),
)
STEP_FOLDERS = {
    "settings",
    "deploy",
    "model",
    "trace",
    "count",
    "bound",
    "findings",
    "verify",
    "guard",
    "design",
    "report",
}
# Folders of files that are not Python modules.
DATA_FOLDERS = {"__pycache__"}
MAX_TOP_LEVEL_MODULES = 6
MAX_LINES = 700


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _imported(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports, each resolved to the module (not the name inside it)."""
    is_package = path.name == "__init__.py"
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            candidates = [f"{module}.{alias.name}" for alias in node.names]
        else:
            continue
        for candidate in candidates:
            while candidate not in MODULES and "." in candidate:
                candidate = candidate.rsplit(".", 1)[0]
            if candidate in MODULES and candidate != name:
                targets.add(candidate)
    return targets


GRAPH = nx.DiGraph()
for _name, _path in MODULES.items():
    GRAPH.add_node(_name)
    GRAPH.add_edges_from((_name, target) for target in _imported(_name, _path))


def step_of(module: str) -> int:
    """The index in STEPS of the longest prefix naming the module's step."""
    best, best_length = None, -1
    for index, prefixes in enumerate(STEPS):
        for prefix in prefixes:
            matches = module == prefix or (module.startswith(prefix + ".") and prefix != "rankaudit")
            if matches and len(prefix) > best_length:
                best, best_length = index, len(prefix)
    assert best is not None, f"{module} belongs to no step: add its folder or name to STEPS in {__file__}"
    return best


def test_every_module_has_a_step():
    for module in MODULES:
        step_of(module)


def test_no_import_reaches_a_later_step():
    forward = [
        f"{a} imports {b} ({STEPS[step_of(a)][0]} -> later step {STEPS[step_of(b)][0]})"
        for a, b in GRAPH.edges
        if step_of(b) > step_of(a)
    ]
    assert not forward, "imports from an earlier step to a later one:\n" + "\n".join(sorted(forward))


def test_no_import_circle():
    cycles = list(nx.simple_cycles(GRAPH))
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c + c[:1]) for c in cycles)


def test_the_top_level_holds_the_steps_and_few_modules():
    top_modules = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top_modules) <= MAX_TOP_LEVEL_MODULES, f"{len(top_modules)} modules at the top: {top_modules}"
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir()} - DATA_FOLDERS
    assert folders == STEP_FOLDERS, f"folders that are not steps: {sorted(folders - STEP_FOLDERS)}; " + (
        f"steps without a folder: {sorted(STEP_FOLDERS - folders)}"
    )


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_is_over_the_line_limit(module):
    lines = len(MODULES[module].read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines: split it along the data flow"


# The verifiers' own flow: what every verifier shares (the real model, its inputs, the client's training, the
# catalogue of verifiers), then the exact rank check, then the attacks (some reuse the rank check's Jacobians), then
# the runner that the command line calls.
VERIFY_FLOW = ("rankaudit.verify", "rankaudit.verify.rank", "rankaudit.verify.attacks", "rankaudit.verify.run")


def _verify_stage(module: str) -> int:
    return max(i for i, prefix in enumerate(VERIFY_FLOW) if module == prefix or module.startswith(prefix + "."))


def test_the_verifiers_follow_their_own_flow():
    verify = [m for m in MODULES if m.startswith("rankaudit.verify")]
    backward = [
        f"{a} imports {b}"
        for a, b in GRAPH.edges
        if a in verify and b.startswith("rankaudit.verify") and _verify_stage(b) > _verify_stage(a)
    ]
    assert not backward, "verifier modules importing a later part of the verifiers:\n" + "\n".join(sorted(backward))


def test_the_trace_does_not_import_the_counting_rules():
    trace = [m for m in MODULES if m.startswith("rankaudit.trace")]
    reached = set().union(*(nx.descendants(GRAPH, m) for m in trace))
    counting = sorted(m for m in reached if m.startswith("rankaudit.count"))
    assert not counting, f"the trace reaches {counting}"


def test_the_step_packages_import_nothing():
    """A step's __init__ holds its docstring only: importing one module of a step never loads the rest of it (the
    supervising parent imports the model step's supervisor without torch)."""
    for module, path in MODULES.items():
        if path.name == "__init__.py" and module != "rankaudit":
            assert not _imported(module, path), f"{path} imports {sorted(_imported(module, path))}"


def _own_names(path: Path) -> set[str]:
    """The names a module defines itself (functions, classes, assignments at its top level)."""
    names = set()
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def test_every_name_is_imported_from_its_home():
    """A name is imported from the module that defines it, never through one that merely imports it: a move leaves
    no old path behind that keeps working."""
    roots = [PACKAGE, PACKAGE.parent / "tests", PACKAGE.parent / "benchmarks"]
    through = []
    for path in (p for root in roots for p in sorted(root.rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and not node.level and node.module in MODULES):
                continue
            own = _own_names(MODULES[node.module])
            for alias in node.names:
                if f"{node.module}.{alias.name}" not in MODULES and alias.name not in own:
                    through.append(f"{path.name}:{node.lineno} imports {alias.name} through {node.module}")
    assert not through, "names read through a module that does not define them:\n" + "\n".join(through)
