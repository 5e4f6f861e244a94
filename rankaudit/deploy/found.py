"""What reading an app's code finds: a value and where it was read (Found), a privacy mechanism, a call's name."""

from __future__ import annotations

import ast
from dataclasses import dataclass


@dataclass(frozen=True)
class Found:
    """One value read from the code (or the run config the code reads) and where."""

    key: str
    value: object
    source: str
    line: int = 0


@dataclass(frozen=True)
class Mechanism:
    """A privacy mechanism found in the code: its kind and its arguments as resolved (None: not a literal)."""

    kind: str  # flower-central | local-dp | opacus | opacus-epsilon | secagg
    name: str  # the class or call as written
    arguments: dict[str, Found | None]
    source: str
    condition: str | None = None  # the condition, not read, that decides whether this code runs


def call_name(node: ast.AST) -> str:
    """The last dotted part of a call's callee: torch.optim.SGD -> SGD, engine.make_private -> make_private."""
    func = node.func if isinstance(node, ast.Call) else node
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return ""
