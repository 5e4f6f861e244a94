"""What the model an app names cannot be, or does not cover: a model built with another framework (refused in one
line: rankaudit reads PyTorch models), and a submodule forward() never reaches that the app's training calls (a
decoder, an auxiliary head: named in a note, its gradients are not in the trace)."""

from __future__ import annotations

import ast
from pathlib import Path

from rankaudit.deploy.found import call_name
from rankaudit.deploy.syntax import syntax_of
from rankaudit.errors import UsageError
from rankaudit.settings.files import read_source


def pytorch_only(directory: Path, files: list[Path]) -> None:
    """An app whose model is built with another framework is told what rankaudit reads, not to install it."""
    other = other_framework(files)
    if other is not None:
        framework, path = other
        raise UsageError(
            f"{_shown(directory, path)} builds the app's model with {framework} (it imports "
            f"{framework.lower()} and not torch); rankaudit reads PyTorch models (torch.nn.Module) only",
            'audit the PyTorch version of the model, if the app has one: model = "pkg/task.py:Net" in [tool.rankaudit]',
        )


def outside_forward_notes(directory: Path, model: str, files: list[Path]) -> list[str]:
    """A submodule of the model class that forward() never reaches but the app's code calls (a decoder, an
    auxiliary head): its gradients are in the update, not in the trace; said, never silently left out."""
    if model.count(":") != 1:
        return []
    path, name = Path(model.split(":")[0]), model.split(":")[1]
    texts = []
    for file in files:
        texts.append(read_source(file))
    notes = []
    for attribute, line, user in outside_forward(path, name):
        word = user or attribute
        if any(f".{word}(" in text for text in texts):
            by = f" but by {name}.{user}()" if user else ""
            notes.append(
                f"{name}.{attribute} ({_shown(directory, path)}:{line}) is not used by forward(){by}, "
                f"which the app's code calls: rankaudit traces forward() alone, so the gradients {attribute} adds to "
                "the update are not counted and the bound covers only what forward() uses; make forward() compute "
                "what training computes to count them"
            )
    return notes


# Frameworks whose models rankaudit does not read (it traces torch.nn.Module), by the top-level module imported.
_OTHER_FRAMEWORKS = {"tensorflow": "TensorFlow", "keras": "Keras", "jax": "JAX", "flax": "Flax"}


def other_framework(paths: list[Path]) -> tuple[str, Path] | None:
    """(framework, file) where the files import TensorFlow, Keras, JAX or Flax and none imports torch: an app
    whose model is not a PyTorch model. None otherwise (a torch app that also imports one is read as torch)."""
    found = None
    for path in paths:
        try:
            nodes = syntax_of(path).import_nodes
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in nodes:
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                top = name.split(".")[0]
                if top == "torch":
                    return None
                if top in _OTHER_FRAMEWORKS and found is None:
                    found = (_OTHER_FRAMEWORKS[top], path)
    return found


def outside_forward(path: Path, name: str) -> list[tuple[str, int, str]]:
    """Submodules the model class sets in __init__ (`self.decoder = nn.Sequential(...)`) that forward() never
    reaches, directly or through the methods it calls: (attribute, line, the method that uses it, or "").
    rankaudit traces forward() alone, so a decoder or an auxiliary head that training calls on its own adds
    gradients the trace does not see."""
    try:
        tree = syntax_of(path).tree
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return []
    cls = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)
    if cls is None:
        return []
    methods = {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}
    if "forward" not in methods or "__init__" not in methods:
        return []

    def self_attributes(node: ast.AST) -> set[str]:
        return {
            inner.attr
            for inner in ast.walk(node)
            if isinstance(inner, ast.Attribute) and isinstance(inner.value, ast.Name) and inner.value.id == "self"
        }

    reached, pending = set(), ["forward"]
    while pending:
        method = pending.pop()
        if method in reached:
            continue
        reached.add(method)
        pending += [attribute for attribute in self_attributes(methods[method]) if attribute in methods]
    used = set().union(*(self_attributes(methods[method]) for method in reached))
    found = []
    for statement in ast.walk(methods["__init__"]):
        if not (isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Call)):
            continue
        for target in statement.targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and target.attr not in used
                and call_name(statement.value)[:1].isupper()  # a layer or a module, not a helper's value
            ):
                others = [m for m in methods if m not in reached and m != "__init__"]
                user = next((m for m in others if target.attr in self_attributes(methods[m])), "")
                found.append((target.attr, statement.lineno, user))
    return found


def _shown(directory: Path, path: Path) -> str:
    resolved = path.resolve()
    return resolved.relative_to(directory).as_posix() if resolved.is_relative_to(directory) else str(resolved)
