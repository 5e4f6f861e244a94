"""Client and server code read with ast, never imported: loaders, optimizers, epochs, DP and secure aggregation."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, replace
from pathlib import Path

# Flower's central-DP wrappers: clipping on the client (ClientSide) or the server (ServerSide), Gaussian noise added
# by the server to the aggregate in both. Positional parameters after `strategy`, as Flower declares them.
FLOWER_FIXED = ("DifferentialPrivacyClientSideFixedClipping", "DifferentialPrivacyServerSideFixedClipping")
FLOWER_ADAPTIVE = ("DifferentialPrivacyClientSideAdaptiveClipping", "DifferentialPrivacyServerSideAdaptiveClipping")
_POSITIONAL = {
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
_EVALUATION_WORDS = ("test", "val", "eval", "central")  # server-side evaluation data, not a client's
_DEPTH = 8  # how many assignments a name is followed through
_CONFIGURATION = re.compile(r"\b(run_config|node_config|config|cfg|conf|args|opts?|settings|params|environ|getenv)\b")
_RESOLVING: set = set()  # (function, parameter) pairs being resolved from their callers, against cycles


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
            return Found("", -inner.value, inner.source, inner.line) if inner and _number(inner.value) else None
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
            if left and right and _number(left.value) and _number(right.value):
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
        if not (left and right and _number(left.value) and _number(right.value)):
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
        """The expression passed for parameter `name`, by keyword or by position (per _POSITIONAL)."""
        for keyword in call.keywords:
            if keyword.arg == name:
                return keyword.value
        positions = _POSITIONAL.get(call_name(call), ())
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


def _number(value) -> bool:
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


# ---- what the code says about the round and its privacy --------------------------------------------------------


def read_code(
    files: list[Path],
    root: Path,
    config: dict[str, tuple[object, str]],
    script_args: dict[Path, dict[str, Found]] | None = None,
) -> tuple[list[Found], list[Mechanism]]:
    """Every setting found in `files` (first find of a key wins, training loaders before others) and every
    privacy mechanism, in file order; a training script reads the options its job passes it (`script_args`)."""
    found: list[Found] = []
    mechanisms: list[Mechanism] = []
    script_args = script_args or {}
    readers: list[ModuleReader] = []
    for path in sorted(files, key=lambda path: path.resolve() not in script_args):
        try:
            readers.append(ModuleReader(path, root, config, script_args.get(path.resolve())))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue  # a file that does not parse is the loader's business, not the deployment reader's
    for reader in readers:
        reader.peers = readers
    for reader in readers:
        found += _loaders(reader) + _optimizers(reader) + _epochs(reader) + _rounds(reader)
        mechanisms += _mechanisms(reader)
    return found, mechanisms


def _loaders(reader: ModuleReader) -> list[Found]:
    """DataLoader(batch_size=...) of the training data: a loader bound to a name without test/val/eval in it
    (one with shuffle=True first)."""
    ranked = []
    for call in reader.calls():
        if call_name(call) != "DataLoader":
            continue
        bound = reader.assigned_to(call)
        if any(word in bound for word in _EVALUATION_WORDS):
            continue
        size = reader.resolved(call, "batch_size", "batch-size")
        if size is None or not _number(size.value):
            continue
        shuffled = reader.value(reader.argument(call, "shuffle"))
        ranked.append((0 if shuffled and shuffled.value is True else 1, size))
    return [size for _, size in sorted(ranked, key=lambda pair: pair[0])]


def _optimizers(reader: ModuleReader) -> list[Found]:
    found = []
    calls = [call for call in reader.calls() if call_name(call) in ("SGD", "Adam", "AdamW")]
    live = [(call, reader.branch(call)) for call in calls]
    live = [(call, taken) for call, taken in live if taken is not False]
    undecided = [(call, taken) for call, taken in live if isinstance(taken, str)]
    if undecided and len({call_name(call) for call, _ in live}) > 1:
        # Two optimizers and the condition that picks one is not read: never one's lr with the other's momentum.
        shown = " or ".join(f"{call_name(call)} at {reader.where(call)}" for call, _ in live)
        return [Found("optimizer-choice", f"{shown}, chosen by {undecided[0][1]}", reader.where(live[0][0]))]
    for call, _ in live:
        name = call_name(call)
        kind = "sgd" if name == "SGD" else "adam"
        momentum = reader.resolved(call, "momentum", "momentum") if kind == "sgd" else None
        shown = (
            f"{name}(momentum={momentum.value:g})" if momentum and _number(momentum.value) and momentum.value else name
        )
        found.append(Found("optimizer", kind, f"{shown} at {reader.where(call)}", call.lineno))
        lr = reader.resolved(call, "lr", "lr")
        if lr is not None and _number(lr.value):
            found.append(lr)
        elif reader.argument(call, "lr") is None:  # torch's default: 1e-3 for SGD, Adam and AdamW alike
            found.append(Found("lr", 1e-3, f"{name}'s default lr at {reader.where(call)}", call.lineno))
        if momentum is not None and _number(momentum.value):
            found.append(momentum)
    return found


def _epochs(reader: ModuleReader) -> list[Found]:
    """Local epochs: `for _ in range(E)` around a loop over the data in a train function, or a literal
    `epochs=E` / `local_epochs=E` passed to a call."""
    found = []
    for node in ast.walk(reader.tree):
        if (
            isinstance(node, ast.For)
            and isinstance(node.iter, ast.Call)
            and call_name(node.iter) == "range"
            and len(node.iter.args) == 1
            and any(isinstance(inner, ast.For) for stmt in node.body for inner in ast.walk(stmt))
        ):
            function = reader.function_of(node)
            steps = any(
                isinstance(inner, ast.Call) and call_name(inner) in ("step", "backward") for inner in ast.walk(node)
            )
            if function is None or ("train" not in function.name.lower() and not steps):
                continue
            count = reader.value(node.iter.args[0])
            if count is not None and isinstance(count.value, int) and not isinstance(count.value, bool):
                found.append(Found("local-epochs", count.value, count.source, count.line))
    for call in reader.calls():
        if call_name(call) in ("make_private_with_epsilon",):
            continue  # its `epochs` is the accountant's horizon, read with the mechanism
        for keyword in call.keywords:
            if keyword.arg in ("epochs", "local_epochs", "num_epochs"):
                count = reader.value(keyword.value)
                if count is not None and isinstance(count.value, int) and not isinstance(count.value, bool):
                    found.append(Found("local-epochs", count.value, count.source, count.line))
    return found


def _rounds(reader: ModuleReader) -> list[Found]:
    """Server rounds (ServerConfig(num_rounds=...), strategy.start(num_rounds=...)) and client sampling
    (fraction_fit / fraction_train, min_fit_clients / min_train_nodes)."""
    found = []
    for call in reader.calls():
        name = call_name(call)
        if name in ("ServerConfig", "start", "start_simulation", "start_server"):
            rounds = reader.resolved(call, "num_rounds", "server-rounds")
            if rounds is not None and isinstance(rounds.value, int):
                found.append(rounds)
        if name == "start_simulation":
            nodes = reader.resolved(call, "num_clients", "available-clients")
            if nodes is not None and isinstance(nodes.value, int):
                found.append(nodes)
        if name == "ConfigRecord" and call.args and isinstance(call.args[0], ast.Dict):
            found += _sent_config(reader, call.args[0])
        for keyword, key in (
            ("fraction_fit", "fraction"),
            ("fraction_train", "fraction"),
            ("min_fit_clients", "min-clients"),
            ("min_train_nodes", "min-clients"),
        ):
            value = reader.resolved(call, keyword, key)
            if value is not None and _number(value.value):
                found.append(value)
    return found


# Keys of the config the server sends each round (ConfigRecord({"lr": 0.1})) that the client's training reads.
_SENT_KEYS = {
    "lr": "lr",
    "learning-rate": "lr",
    "learning_rate": "lr",
    "local-epochs": "local-epochs",
    "local_epochs": "local-epochs",
    "epochs": "local-epochs",
    "batch-size": "batch-size",
    "batch_size": "batch-size",
}


def _sent_config(reader: ModuleReader, table: ast.Dict) -> list[Found]:
    found = []
    for key, value in zip(table.keys, table.values):
        if isinstance(key, ast.Constant) and key.value in _SENT_KEYS:
            resolved = reader.value(value)
            if resolved is not None and _number(resolved.value):
                found.append(
                    Found(
                        _SENT_KEYS[key.value],
                        resolved.value,
                        f"{resolved.source} (ConfigRecord sent to the clients)",
                        resolved.line,
                    )
                )
    return found


_OPACUS_ARGUMENTS = {
    "make_private": ("noise_multiplier", "max_grad_norm", "poisson_sampling"),
    "make_private_with_epsilon": ("target_epsilon", "target_delta", "epochs", "max_grad_norm", "poisson_sampling"),
}


def _mechanisms(reader: ModuleReader) -> list[Mechanism]:
    mechanisms = []
    for call in reader.calls():
        name = call_name(call)
        where = reader.where(call)
        if reader.branch(call) is False:
            continue  # a branch the configuration read does not take
        if name == "PrivacyEngine" and reader.argument(call, "noise_multiplier") is not None:
            # Opacus before 1.0: PrivacyEngine(model, sample_rate=..., noise_multiplier=..., max_grad_norm=...)
            arguments = {key: reader.resolved(call, key, key) for key in _OPACUS_ARGUMENTS["make_private"]}
            mechanisms.append(Mechanism("opacus", name, arguments, where))
        elif name in FLOWER_FIXED or name in FLOWER_ADAPTIVE:
            clip = "clipping_norm" if name in FLOWER_FIXED else "initial_clipping_norm"
            arguments = {
                "noise_multiplier": reader.resolved(call, "noise_multiplier", "noise"),
                "clipping_norm": reader.resolved(call, clip, "clip"),
                "num_sampled_clients": reader.resolved(call, "num_sampled_clients", "sampled-clients"),
            }
            if name in FLOWER_ADAPTIVE and arguments["clipping_norm"] is None and reader.argument(call, clip) is None:
                arguments["clipping_norm"] = Found("clip", 0.1, f"{name}'s default initial_clipping_norm")
            mechanisms.append(Mechanism("flower-central", name, arguments, where))
        elif name == "LocalDpMod":
            arguments = {key: reader.resolved(call, key, key) for key in _POSITIONAL["LocalDpMod"]}
            mechanisms.append(Mechanism("local-dp", name, arguments, where))
        elif name in _OPACUS_ARGUMENTS:
            arguments = {key: reader.resolved(call, key, key) for key in _OPACUS_ARGUMENTS[name]}
            kind = "opacus" if name == "make_private" else "opacus-epsilon"
            mechanisms.append(Mechanism(kind, name, arguments, where))
        elif name == "SecAggPlusWorkflow" or name == "SecAggWorkflow":
            mechanisms.append(Mechanism("secagg", name, {}, where))
        elif _privacy_wrapper(name) and name not in _KNOWN_NAMES:
            noise_by = "client" if name.endswith("Mod") or name.endswith("_mod") else "server"
            if "ServerSide" in name or "ClientSide" in name or "Strategy" in name:
                noise_by = "server"
            mechanisms.append(Mechanism("unaccounted", name, {"noise_by": Found("noise-by", noise_by, where)}, where))
        elif name == "ExcludeVars":
            mechanisms.append(
                Mechanism(
                    "exclude-vars", name, {"exclude_vars": reader.resolved(call, "exclude_vars", "withheld")}, where
                )
            )
    for node in reader.names():
        name = node.id if isinstance(node, ast.Name) else node.attr
        if name in ("secaggplus_mod", "secagg_mod") and not isinstance(reader._parents.get(node), ast.alias):
            mechanisms.append(Mechanism("secagg", name, {}, reader.where(node)))
            break
    for index, mechanism in enumerate(mechanisms):
        call = next((c for c in reader.calls() if reader.where(c) == mechanism.source), None)
        taken = reader.branch(call, configured_only=True) if call is not None else True
        if isinstance(taken, str):
            mechanisms[index] = replace(mechanism, condition=taken)
    return mechanisms


_KNOWN_NAMES = {
    *FLOWER_FIXED,
    *FLOWER_ADAPTIVE,
    "LocalDpMod",
    "PrivacyEngine",
    "make_private",
    "make_private_with_epsilon",
}
_PRIVACY_WORDS = re.compile(r"(Privacy|DifferentialPrivacy|^Dp[A-Z]|DP[A-Z]|^dp_|_dp_|clipping_mod$|Clipping)")


def _privacy_wrapper(name: str) -> bool:
    """A call whose name says it clips or adds noise (a wrapper, mod or engine rankaudit has no rule for)."""
    return bool(_PRIVACY_WORDS.search(name)) and not name.startswith(("get_", "add_"))
