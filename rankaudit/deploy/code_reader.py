"""One source file read with ast, never imported: expressions resolved to literal values, and where each was read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rankaudit.deploy.found import Found, call_name

# Flower's central-DP wrappers: clipping on the client (ClientSide) or the server (ServerSide), Gaussian noise added
# by the server to the aggregate in both. Positional parameters after `strategy`, as Flower declares them.
FLOWER_FIXED = ("DifferentialPrivacyClientSideFixedClipping", "DifferentialPrivacyServerSideFixedClipping")
FLOWER_ADAPTIVE = ("DifferentialPrivacyClientSideAdaptiveClipping", "DifferentialPrivacyServerSideAdaptiveClipping")
POSITIONAL = {
    "DataLoader": ("dataset", "batch_size", "shuffle"),
    "SGD": ("params", "lr", "momentum"),
    "Adam": ("params", "lr"),
    "AdamW": ("params", "lr"),
    "LocalDpMod": ("clipping_norm", "sensitivity", "epsilon", "delta"),
    "ServerConfig": ("num_rounds",),
    "ExcludeVars": ("exclude_vars",),
    **{name: ("strategy", "noise_multiplier", "clipping_norm", "num_sampled_clients") for name in FLOWER_FIXED},
    **{
        name: ("strategy", "noise_multiplier", "num_sampled_clients", "initial_clipping_norm")
        for name in FLOWER_ADAPTIVE
    },
}
_DEPTH = 8  # how many assignments a name is followed through
_CONFIGURATION = re.compile(r"\b(run_config|node_config|config|cfg|conf|args|opts?|settings|params|environ|getenv)\b")
_RESOLVING: set = set()  # (function, parameter) pairs being resolved from their callers, against cycles


class ModuleReader:
    """One source file: resolves expressions to literal values (following local names, run-config reads and
    simple arithmetic) and lists the calls rankaudit understands."""

    def __init__(
        self,
        path: Path,
        root: Path,
        config: dict[str, tuple[object, str]],
        script_args: dict[str, Found] | None = None,
    ):
        self.path, self.root, self.config = path, root, config
        self.relative = (
            path.resolve().relative_to(root).as_posix() if path.resolve().is_relative_to(root) else path.as_posix()
        )
        self.tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        self._parents: dict[ast.AST, ast.AST] = {}
        for parent in ast.walk(self.tree):
            for child in ast.iter_child_nodes(parent):
                self._parents[child] = parent
        # The script's command-line options: what the job passes it (script_args) over argparse's defaults.
        from rankaudit.deploy.scripts import argparse_defaults

        defaults = argparse_defaults(self)
        passed = {self.option_names.get(name, name): found for name, found in (script_args or {}).items()}
        self.options = {**defaults, **passed}
        self.peers: list[ModuleReader] = [self]  # the app's other files: where its functions are called from

    def where(self, node: ast.AST) -> str:
        return f"{self.relative}:{node.lineno}"

    def function_of(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        while node in self._parents:
            node = self._parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return node
        return None

    # ---- values -----------------------------------------------------------------------------------------------
    def value(self, node: ast.AST | None, depth: int = 0) -> Found | None:
        """The literal value `node` stands for, with its source; None where it is not static."""
        if node is None or depth > _DEPTH:
            return None
        if isinstance(node, ast.Constant) and isinstance(node.value, (bool, int, float, str)):
            return Found("", node.value, self.where(node), node.lineno)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            inner = self.value(node.operand, depth + 1)
            return Found("", -inner.value, inner.source, inner.line) if inner and is_number(inner.value) else None
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [self.value(item, depth + 1) for item in node.elts]
            if all(items):
                return Found("", [item.value for item in items], self.where(node), node.lineno)
            return None
        read = self._run_config_read(node)
        if read is not None:
            return read
        if isinstance(node, ast.Call) and call_name(node) in ("int", "float", "bool") and len(node.args) == 1:
            inner = self.value(node.args[0], depth + 1)
            if inner is not None and not isinstance(inner.value, (list, str)):
                kind = {"int": int, "float": float, "bool": bool}[call_name(node)]
                return Found("", kind(inner.value), inner.source, inner.line)
            return None
        if isinstance(node, ast.BinOp):
            return self._arithmetic(node, depth)
        if isinstance(node, ast.IfExp):
            # Both branches literal: the smaller one, the weaker setting (less noise, fewer of anything).
            left, right = self.value(node.body, depth + 1), self.value(node.orelse, depth + 1)
            if left and right and is_number(left.value) and is_number(right.value):
                return Found(
                    "",
                    min(left.value, right.value),
                    f"{self.where(node)} (the smaller of {left.value!r} and {right.value!r})",
                    node.lineno,
                )
            return None
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self.value(node.left, depth + 1), self.value(node.comparators[0], depth + 1)
            if left is None or right is None:
                return None
            compare = {
                ast.Eq: lambda a, b: a == b,
                ast.NotEq: lambda a, b: a != b,
                ast.In: lambda a, b: a in b if isinstance(b, (list, str)) else None,
                ast.NotIn: lambda a, b: a not in b if isinstance(b, (list, str)) else None,
            }.get(type(node.ops[0]))
            result = compare(left.value, right.value) if compare else None
            return None if result is None else Found("", result, left.source, node.lineno)
        if isinstance(node, ast.Name):
            return self._name(node, depth)
        if isinstance(node, ast.Attribute):
            return self._attribute(node, depth)
        if isinstance(node, ast.Subscript):
            return self._item(node, depth)
        if isinstance(node, ast.JoinedStr):
            parts = [
                self.value(part.value, depth + 1) if isinstance(part, ast.FormattedValue) else self.value(part)
                for part in node.values
            ]
            if all(parts):
                return Found("", "".join(str(part.value) for part in parts), self.where(node), node.lineno)
        return None

    def decorates(self, call: ast.Call) -> bool:
        """`@app.train()`: a decorator's call, not a call of the function it shares a name with."""
        parent = self._parents.get(call)
        return (
            isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and call in parent.decorator_list
        )

    def branch(self, node: ast.AST, configured_only: bool = False) -> bool | str:
        """Whether the code at `node` runs: True, False (a branch the configuration read rules out), or the text
        of the condition that decides it where that is not read (with `configured_only`, only a condition that
        reads the configuration; one on run-time state, `current_round == 0`, counts as running)."""
        child = node
        while child in self._parents:
            parent = self._parents[child]
            if isinstance(parent, (ast.If, ast.IfExp)) and child is not parent.test:
                inside_body = child in parent.body if isinstance(parent, ast.If) else child is parent.body
                test = self.value(parent.test)
                if test is None or not isinstance(test.value, bool):
                    if configured_only and not self._reads_configuration(parent.test):
                        child = parent
                        continue
                    return f"`{ast.unparse(parent.test)}` at {self.where(parent)}"
                if test.value != inside_body:
                    return False
            child = parent
        return True

    def _reads_configuration(self, test: ast.AST) -> bool:
        """Whether a condition reads the app's configuration: the run or node config, the script's options, a
        config object or the environment, directly or through the names it uses."""
        texts = [ast.unparse(test)] + [
            ast.unparse(self.expression(name)) for name in ast.walk(test) if isinstance(name, ast.Name)
        ]
        return any(_CONFIGURATION.search(text) for text in texts)

    def expression(self, node: ast.AST, depth: int = 0) -> ast.AST:
        """The expression a name stands for (its last assignment above the use), followed through names."""
        while isinstance(node, ast.Name) and depth < _DEPTH:
            assigned = self._assignment(node)
            if assigned is None:
                break
            node, depth = assigned.value, depth + 1
        return node

    def _attribute(self, node: ast.Attribute, depth: int) -> Found | None:
        """`self.lr` (the one value the class assigns it), `args.batch_size` (the script's option)."""
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            owner = self._enclosing(node, ast.ClassDef)
            if owner is None:
                return None
            values = [
                self.value(statement.value, depth + 1)
                for statement in ast.walk(owner)
                if isinstance(statement, (ast.Assign, ast.AnnAssign))
                and statement.value is not None
                and any(
                    isinstance(t, ast.Attribute)
                    and t.attr == node.attr
                    and isinstance(t.value, ast.Name)
                    and t.value.id == "self"
                    for t in (statement.targets if isinstance(statement, ast.Assign) else [statement.target])
                )
            ]
            # One value wherever the class sets it; two different ones are a choice the code makes at run time.
            if values and all(values) and len({repr(v.value) for v in values}) == 1:
                return values[0]
            return None
        if isinstance(node.value, ast.Name) and node.attr in self.options:
            return self.options[node.attr]
        dotted = ast.unparse(node).split(".", 1)[-1]  # cfg.train.lr -> train.lr, a YAML config's key
        if dotted in self.config:
            value, source = self.config[dotted]
            return Found("", value, f"{source} {dotted}", node.lineno)
        return None

    def _item(self, node: ast.Subscript, depth: int) -> Found | None:
        """`PARAMS["batch_size"]` of a dict literal the module or function assigns."""
        if not (isinstance(node.slice, ast.Constant) and isinstance(node.value, ast.Name)):
            return None
        table = self.expression(node.value)
        if isinstance(table, ast.Call) and call_name(table) == "dict" and not table.args:
            pairs = {keyword.arg: keyword.value for keyword in table.keywords if keyword.arg}
        elif isinstance(table, ast.Dict):
            pairs = {key.value: value for key, value in zip(table.keys, table.values) if isinstance(key, ast.Constant)}
        else:
            return None
        return self.value(pairs.get(node.slice.value), depth + 1)

    def _enclosing(self, node: ast.AST, kind):
        while node in self._parents:
            node = self._parents[node]
            if isinstance(node, kind):
                return node
        return None

    def _arithmetic(self, node: ast.BinOp, depth: int) -> Found | None:
        left, right = self.value(node.left, depth + 1), self.value(node.right, depth + 1)
        if not (left and right and is_number(left.value) and is_number(right.value)):
            return None
        operations = {
            ast.Add: lambda a, b: a + b,
            ast.Sub: lambda a, b: a - b,
            ast.Mult: lambda a, b: a * b,
            ast.Div: lambda a, b: a / b if b else None,
            ast.FloorDiv: lambda a, b: a // b if b else None,
        }
        operation = operations.get(type(node.op))
        result = operation(left.value, right.value) if operation else None
        if result is None:
            return None
        sources = left.source if left.source == right.source else f"{left.source} and {right.source}"
        return Found("", result, sources, node.lineno)

    def _run_config_read(self, node: ast.AST) -> Found | None:
        """`context.run_config["key"]`, `run_config["key"]`, `context.run_config.get("key", default)`."""
        key = None
        if isinstance(node, ast.Subscript) and self._run_config(node.value):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and self._run_config(node.func.value)
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            key = node.args[0].value
            if key not in self.config and len(node.args) > 1:
                return self.value(node.args[1])
        if not isinstance(key, str) or key not in self.config:
            return None
        value, source = self.config[key]
        return Found("", value, f"{source} {key}", node.lineno)

    def _run_config(self, node: ast.AST) -> bool:
        """`context.run_config`, or a name assigned it (`cfg = context.run_config`)."""
        return _is_run_config(node) or (isinstance(node, ast.Name) and _is_run_config(self.expression(node)))

    def _name(self, node: ast.Name, depth: int) -> Found | None:
        """A local name: its last assignment above the use in the same function, else the function parameter's
        literal default, else the module-level assignment."""
        assigned = self._assignment(node)
        if assigned is not None:
            return self.value(assigned.value, depth + 1)
        unpacked = self._unpacked(node, depth)
        if unpacked is not None:
            return unpacked
        function = self.function_of(node)
        if function is not None and any(arg.arg == node.id for arg in _all_arguments(function)):
            passed = self._passed(function, node.id, depth)
            if passed is not None:
                return passed
            default = _parameter_default(function, node.id)
            if default is not None:
                return self.value(default, depth + 1)
        return None

    def _unpacked(self, node: ast.Name, depth: int) -> Found | None:
        """`a, noise, b = helper(...)`: the element of the tuple the module's own `helper` returns."""
        function = self.function_of(node)
        for statement in ast.walk(function if function is not None else self.tree):
            if not (
                isinstance(statement, ast.Assign)
                and statement.lineno <= node.lineno
                and len(statement.targets) == 1
                and isinstance(statement.targets[0], ast.Tuple)
                and isinstance(statement.value, ast.Call)
                and isinstance(statement.value.func, ast.Name)
            ):
                continue
            names = [t.id if isinstance(t, ast.Name) else None for t in statement.targets[0].elts]
            if node.id not in names:
                continue
            helper = next(
                (d for d in self.tree.body if isinstance(d, ast.FunctionDef) and d.name == statement.value.func.id),
                None,
            )
            returns = [r.value for r in ast.walk(helper) if isinstance(r, ast.Return)] if helper else []
            if len(returns) == 1 and isinstance(returns[0], ast.Tuple) and len(returns[0].elts) == len(names):
                return self.value(returns[0].elts[names.index(node.id)], depth + 1)
        return None

    def _passed(self, function, name: str, depth: int) -> Found | None:
        """A parameter's value where every call of the function in the app passes the same one."""
        key = (id(function), name)
        if key in _RESOLVING:
            return None  # a call inside the function's own branches: no value from the function itself
        _RESOLVING.add(key)
        try:
            return self._passed_by_callers(function, name, depth)
        finally:
            _RESOLVING.discard(key)

    def _passed_by_callers(self, function, name: str, depth: int) -> Found | None:
        positional = [arg.arg for arg in [*function.args.posonlyargs, *function.args.args]]
        values = []
        for reader in self.peers:
            for call in reader.calls():
                if call_name(call) != function.name or reader.branch(call) is False or reader.decorates(call):
                    continue
                if any(isinstance(arg, ast.Starred) for arg in call.args) or any(k.arg is None for k in call.keywords):
                    return None
                given = next((k.value for k in call.keywords if k.arg == name), None)
                if given is None and name in positional and positional.index(name) < len(call.args):
                    given = call.args[positional.index(name)]
                if given is None:
                    return None  # a call that leaves it to the default
                values.append(reader.value(given, depth + 1))
        if values and all(values) and len({repr(v.value) for v in values}) == 1:
            return values[0]
        return None

    def _assignment(self, node: ast.Name) -> ast.Assign | ast.AnnAssign | None:
        """The last plain assignment of `node`'s name above it, in its function, else at module level (a
        function parameter of that name stops the search: its value is the caller's)."""
        function = self.function_of(node)
        scopes = [function, self.tree] if function is not None else [self.tree]
        for scope in scopes:
            assigned = None
            for statement in ast.walk(scope):
                if scope is self.tree and self.function_of(statement) is not None:
                    continue
                targets = (
                    statement.targets
                    if isinstance(statement, ast.Assign)
                    else [statement.target]
                    if isinstance(statement, ast.AnnAssign) and statement.value
                    else []
                )
                if (
                    any(isinstance(t, ast.Name) and t.id == node.id for t in targets)
                    and statement.lineno <= node.lineno
                    and (assigned is None or statement.lineno > assigned.lineno)
                ):
                    assigned = statement
            if assigned is not None:
                return assigned
            if scope is function and any(arg.arg == node.id for arg in _all_arguments(function)):
                return None
        return None

    def argument(self, call: ast.Call, name: str) -> ast.AST | None:
        """The expression passed for parameter `name`, by keyword or by position (per POSITIONAL)."""
        for keyword in call.keywords:
            if keyword.arg == name:
                return keyword.value
        positions = POSITIONAL.get(call_name(call), ())
        if name in positions and positions.index(name) < len(call.args):
            argument = call.args[positions.index(name)]
            return None if isinstance(argument, ast.Starred) else argument
        return None

    def resolved(self, call: ast.Call, name: str, key: str) -> Found | None:
        found = self.value(self.argument(call, name))
        return Found(key, found.value, found.source, found.line) if found else None

    def calls(self) -> list[ast.Call]:
        return [node for node in ast.walk(self.tree) if isinstance(node, ast.Call)]

    def names(self) -> list[ast.Name | ast.Attribute]:
        return [node for node in ast.walk(self.tree) if isinstance(node, (ast.Name, ast.Attribute))]

    def assigned_to(self, call: ast.Call) -> str:
        """The names a call's result is bound to (`trainloader = DataLoader(...)`), lower-cased, for telling a
        training loader from a test loader."""
        parent = self._parents.get(call)
        while isinstance(parent, (ast.Tuple, ast.List)):
            parent = self._parents.get(parent)
        if isinstance(parent, (ast.Assign, ast.AnnAssign)):
            targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
            return " ".join(ast.unparse(target) for target in targets).lower()
        if isinstance(parent, ast.keyword) and parent.arg:
            return parent.arg.lower()
        function = self.function_of(call)
        return function.name.lower() if function is not None else ""


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_run_config(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "run_config") or (
        isinstance(node, ast.Name) and node.id == "run_config"
    )


def _all_arguments(function) -> list[ast.arg]:
    arguments = function.args
    return [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]


def _parameter_default(function, name: str) -> ast.AST | None:
    arguments = function.args
    positional = [*arguments.posonlyargs, *arguments.args]
    defaults = dict(
        zip([arg.arg for arg in positional[len(positional) - len(arguments.defaults) :]], arguments.defaults)
    )
    defaults.update(
        {arg.arg: default for arg, default in zip(arguments.kwonlyargs, arguments.kw_defaults) if default is not None}
    )
    return defaults.get(name)
