"""One source file parsed once and indexed: parents, functions, calls by name, assignments by scope, imports."""

from __future__ import annotations

import ast
from collections import deque
from functools import lru_cache
from pathlib import Path

from rankaudit.deploy.found import call_name
from rankaudit.settings.files import read_source


def syntax_of(path: Path) -> Syntax:
    """The file's tree and index, parsed once while the file is unchanged."""
    resolved = path.resolve()
    stat = resolved.stat()
    return _parsed(resolved, stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=1024)
def _parsed(path: Path, modified: int, size: int) -> Syntax:
    return Syntax(ast.parse(read_source(path), filename=str(path)))


# Nodes with nothing under them that a lookup asks about (Load/Store, operators), shared between parents.
_LEAVES = (ast.expr_context, ast.operator, ast.cmpop, ast.unaryop, ast.boolop)


class Syntax:
    """A module's syntax tree with the tables every lookup reads."""

    def __init__(self, tree: ast.Module):
        """One walk of the syntax tree: each node's parent and function, the calls by name, the assignments by
        scope and name, `self.x = ...` by class, the imports; every later lookup reads these."""
        self.parents: dict[ast.AST, ast.AST] = {}
        self.function: dict[int, ast.AST | None] = {}
        self.calls: list[ast.Call] = []
        self.calls_by_name: dict[str, list[ast.Call]] = {}
        self.names: list[ast.AST] = []
        self.assigned: dict[tuple[int, str], list] = {}  # (id of function or 0, name) -> assignments, in order
        self.unpacking: dict[int, list[ast.Assign]] = {}  # id of function or 0 -> `a, b = f(...)`
        self.attributes: dict[tuple[int, str], list] = {}  # (id of class, attr) -> `self.attr = ...`
        self.definitions: dict[str, list[ast.AST]] = {}  # functions and classes (not methods) by name
        self.imports: dict[str, tuple[list[str], int, str]] = {}  # name -> (module, level, its name there)
        self.module_aliases: dict[str, tuple[list[str], int]] = {}  # `import pkg.mod as m`: m -> (module, level)
        self.tree = tree
        self.loops: list[ast.For] = []
        self.methods: dict[str, list[ast.AST]] = {}  # methods by name
        self.decorated: list[ast.AST] = []  # module-level functions with a decorator (@app.train())
        self.function[id(self.tree)] = None
        owners: dict[int, ast.ClassDef | None] = {id(self.tree): None}
        self.import_nodes: list[ast.Import | ast.ImportFrom] = []
        self.star_imports: list[tuple[list[str], int, str]] = []  # `from mod import *`: (module, level, "*")
        queue = deque([self.tree])
        while queue:  # breadth first, as ast.walk: a parent before its children, calls in walk order
            node = queue.popleft()
            function, owner = self.function[id(node)], owners[id(node)]
            if isinstance(node, ast.Call):
                self.calls.append(node)
                self.calls_by_name.setdefault(call_name(node), []).append(node)
            elif isinstance(node, (ast.Name, ast.Attribute)):
                self.names.append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                self._index_assignment(node, function, owner)
            elif isinstance(node, ast.For):
                self.loops.append(node)
            elif isinstance(node, ast.ImportFrom):
                self.import_nodes.append(node)
                dotted = node.module.split(".") if node.module else []
                for alias in node.names:
                    if alias.name == "*":
                        self.star_imports.append((dotted, node.level, "*"))
                        continue
                    self.imports[alias.asname or alias.name] = (dotted, node.level, alias.name)
                    self.module_aliases[alias.asname or alias.name] = (dotted + [alias.name], node.level)
            elif isinstance(node, ast.Import):
                self.import_nodes.append(node)
                for alias in node.names:
                    dotted = alias.name.split(".")
                    self.module_aliases[alias.asname or dotted[0]] = (dotted if alias.asname else dotted[:1], 0)
            inner_function, inner_owner = function, owner
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(self.parents.get(node), ast.ClassDef):  # a method is reached through its class
                    self.definitions.setdefault(node.name, []).append(node)
                elif not isinstance(node, ast.ClassDef):
                    self.methods.setdefault(node.name, []).append(node)
                if node.decorator_list and self.parents.get(node) is self.tree:
                    self.decorated.append(node)
                if isinstance(node, ast.ClassDef):
                    inner_owner = node
                else:
                    inner_function = node
            for field in node._fields:  # ast.iter_child_nodes, inlined: this loop is most of reading an app
                value = getattr(node, field, None)
                for child in value if isinstance(value, list) else (value,):
                    if isinstance(child, ast.AST) and not isinstance(child, _LEAVES):
                        self.parents[child] = node
                        self.function[id(child)] = inner_function
                        owners[id(child)] = inner_owner
                        queue.append(child)

    def _index_assignment(self, node, function, owner) -> None:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if node.value is not None else []
        scope = id(function) if function is not None else 0
        for target in targets:
            if isinstance(target, ast.Name):
                self.assigned.setdefault((scope, target.id), []).append(node)
            elif (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and owner is not None
            ):
                self.attributes.setdefault((id(owner), target.attr), []).append(node)
            elif isinstance(target, ast.Tuple) and isinstance(node, ast.Assign) and len(node.targets) == 1:
                self.unpacking.setdefault(scope, []).append(node)


def passed_as(reader, subject: ast.AST) -> str:
    """Where a subject that is a parameter gets its value (a ModuleReader's view): the expression its callers
    pass, so that a one-line stop names the key to state (`run_config["optimizer"]`), not the parameter."""
    function = reader.function_of(subject)
    parameters = [arg.arg for arg in [*function.args.posonlyargs, *function.args.args]] if function else []
    if not isinstance(subject, ast.Name) or subject.id not in parameters:
        return ""
    given = reader.caller_arguments(function, subject.id) or []
    passed = [f"`{ast.unparse(expression)}` at {at.where(expression)}" for at, expression in given]
    return f", passed {' or '.join(passed)}" if passed else ""
