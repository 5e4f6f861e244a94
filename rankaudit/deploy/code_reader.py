"""One source file read with ast, never imported: expressions resolved to literal values, and where each was read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from rankaudit.deploy.found import Found, call_name
from rankaudit.deploy.syntax import passed_as, syntax_of

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
_RESOLVING: set = set()
_STRING_METHODS = (
    "lower",
    "upper",
    "strip",
    "casefold",
)  # (function, parameter) pairs being resolved from their callers, against cycles


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
        syntax = syntax_of(path)  # parsed and indexed once per file, shared by every reader of it
        self.tree, self._parents, self._function, self._calls = (
            syntax.tree,
            syntax.parents,
            syntax.function,
            syntax.calls,
        )
        self._calls_by_name, self._names, self._assigned = syntax.calls_by_name, syntax.names, syntax.assigned
        self._unpacking, self._attributes, self._definitions = syntax.unpacking, syntax.attributes, syntax.definitions
        self.imports, self.module_aliases, self.loops = syntax.imports, syntax.module_aliases, syntax.loops
        self.methods, self.decorated, self.star_imports = syntax.methods, syntax.decorated, syntax.star_imports
        self.live: set[int] | None = None  # the function definitions that run (reach.mark_live); None: all
        self.dead_blocks: set[int] = set()  # `if __name__ == "__main__":` blocks that never run
        self.component_args: dict[str, dict[str, Found]] = {}  # class -> constructor arguments a job config gives
        self.memo: dict = {}  # results shared by the app's readers (set by read_code), each computed once
        self.module_of = None  # (reader, dotted, level) -> the app's module that import names (set by read_code)
        # The script's command-line options: what the job passes it (script_args) over argparse's defaults.
        from rankaudit.deploy.scripts import argparse_defaults

        defaults = argparse_defaults(self)
        passed = {self.option_names.get(name, name): found for name, found in (script_args or {}).items()}
        self.options = {**defaults, **passed}
        self.peers: list[ModuleReader] = [self]  # the app's other files: where its functions are called from

    def where(self, node: ast.AST) -> str:
        return f"{self.relative}:{node.lineno}"

    def function_of(self, node: ast.AST) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        return self._function.get(id(node))

    def enclosing_class(self, node: ast.AST) -> ast.ClassDef | None:
        return self._enclosing(node, ast.ClassDef)

    def definitions(self, name: str, top_level: bool = False) -> list[ast.AST]:
        """The module's functions and classes named `name` (methods aside); `top_level`: those at module level."""
        found = self._definitions.get(name, [])
        return [node for node in found if self.function_of(node) is None] if top_level else found

    def definitions_by_name(self) -> dict[str, list[ast.AST]]:
        return self._definitions

    def calls_named(self, name: str) -> list[ast.Call]:
        return self._calls_by_name.get(name, [])

    def runs(self, node: ast.AST) -> bool:
        """Whether the code at `node` is reached from the app's entry points (reach.mark_live)."""
        if self.live is None and not self.dead_blocks:
            return True
        child = node
        while child in self._parents:
            parent = self._parents[child]
            if id(parent) in self.dead_blocks:
                return False
            if (
                self.live is not None
                and isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef))
                and child not in parent.decorator_list
                and id(parent) not in self.live
            ):
                return False
            child = parent
        return True

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
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in _STRING_METHODS
            and not node.args
            and not node.keywords
        ):
            inner = self.value(node.func.value, depth + 1)
            if inner is not None and isinstance(inner.value, str):
                return Found("", getattr(inner.value, node.func.attr)(), inner.source, inner.line)
            return None
        if isinstance(node, ast.Call) and call_name(node) == "str" and len(node.args) == 1 and not node.keywords:
            inner = self.value(node.args[0], depth + 1)  # str(run_config["algorithm"]): a string stays itself
            return inner if inner is not None and isinstance(inner.value, str) else None
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
        """Whether the code at `node` runs: True, False (code the app's entry points never reach, or a branch the
        configuration read rules out: an `if`, a `match` case, code after an `if ...: return` that returns), or the
        text of the condition that decides it where that is not read (with `configured_only`, only a condition
        that reads the configuration; one on run-time state, `current_round == 0`, counts as running)."""
        key = ("branch", id(node), configured_only)
        if key not in self.memo:
            self.memo[key] = self._branch(node, configured_only) if self.runs(node) else False
        return self.memo[key]

    def _branch(self, node: ast.AST, configured_only: bool) -> bool | str:
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
            elif isinstance(parent, ast.match_case) and child in parent.body:
                taken = self._case_taken(parent)
                if taken is False:
                    return False
                if isinstance(taken, str) and not (
                    configured_only and not self._reads_configuration(self._parents[parent].subject)
                ):
                    return taken
            if isinstance(child, ast.stmt) and self._returned_before(child, parent):
                return False
            child = parent
        return True

    def _case_taken(self, case: ast.match_case) -> bool | str:
        """Whether `match` takes this case: its subject read and matched against each case in order."""
        match = self._parents[case]
        undecided = f"`match {ast.unparse(match.subject)}` at {self.where(match)}{passed_as(self, match.subject)}"
        subject = self.value(match.subject)
        if subject is None:
            return undecided
        for each in match.cases:
            matched = self._pattern(each.pattern, subject.value)
            if matched and each.guard is not None:
                guard = self.value(each.guard)
                matched = guard.value if guard is not None and isinstance(guard.value, bool) else None
            if matched is None:
                return undecided
            if matched:
                return each is case
        return False

    def _pattern(self, pattern: ast.pattern, subject) -> bool | None:
        if isinstance(pattern, ast.MatchValue):
            value = self.value(pattern.value)
            return None if value is None else value.value == subject
        if isinstance(pattern, ast.MatchSingleton):
            return pattern.value is subject
        if isinstance(pattern, ast.MatchAs):  # `case _:` and `case name:` take anything
            return True if pattern.pattern is None else self._pattern(pattern.pattern, subject)
        if isinstance(pattern, ast.MatchOr):
            results = [self._pattern(option, subject) for option in pattern.patterns]
            return True if any(results) else None if None in results else False
        return None

    def _returned_before(self, statement: ast.stmt, parent: ast.AST) -> bool:
        """Whether an `if` above `statement` in the same block returns (or raises) on a branch that is read to
        be taken: `if privacy == "vanilla": return strategy` ends the function before what follows."""
        for field in ("body", "orelse", "finalbody"):
            block = getattr(parent, field, None)
            if isinstance(block, list) and statement in block:
                break
        else:
            return False
        for earlier in block[: block.index(statement)]:
            if not isinstance(earlier, ast.If):
                continue
            ends = [
                branch and isinstance(branch[-1], (ast.Return, ast.Raise)) for branch in (earlier.body, earlier.orelse)
            ]
            if not any(ends):
                continue
            test = self.value(earlier.test)
            if test is not None and isinstance(test.value, bool) and ends[0 if test.value else 1]:
                return True
        return False

    def _reads_configuration(self, test: ast.AST) -> bool:
        """Whether a condition reads the app's configuration: the run or node config, the script's options, a
        config object or the environment, directly or through the names it uses."""
        texts = [ast.unparse(test)] + [
            ast.unparse(self.expression(name)) for name in ast.walk(test) if isinstance(name, ast.Name)
        ]
        # A plain function's parameter compared with a word (`if privacy == "global-dp":` in a strategy factory)
        # is a setting its caller passes, not run-time state (a method's `task_name == "train"` is the framework's).
        function = self.function_of(test)
        factory = function is not None and not isinstance(self._parents.get(function), ast.ClassDef)
        parameters = {arg.arg for arg in _all_arguments(function)} if factory else set()
        named = any(
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Name)
            and node.left.id in parameters
            and any(isinstance(side, ast.Constant) and isinstance(side.value, str) for side in node.comparators)
            for node in ast.walk(test)
        )
        return named or any(_CONFIGURATION.search(text) for text in texts)

    def expression(self, node: ast.AST, depth: int = 0) -> ast.AST:
        """The expression a name stands for (its last assignment above the use), followed through names."""
        while isinstance(node, ast.Name) and depth < _DEPTH:
            assigned = self._assignment(node)
            if assigned is None:
                break
            node, depth = assigned.value, depth + 1
        return node

    def _attribute(self, node: ast.Attribute, depth: int) -> Found | None:
        """`self.lr` (the one value the class assigns it), `args.batch_size` (the script's option), `cfg.train.lr`
        (a config key), `prefs.optimizer` of `prefs = Preferences()` (the field's default in the app's class)."""
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            owner = self._enclosing(node, ast.ClassDef)
            if owner is None:
                return None
            values = [
                self.value(statement.value, depth + 1) for statement in self._attributes.get((id(owner), node.attr), ())
            ]
            # One value wherever the class sets it; two different ones are a choice the code makes at run time.
            if values and all(values) and len({repr(v.value) for v in values}) == 1:
                return values[0]
            return None
        if node.attr == "value" and isinstance(node.value, ast.Attribute) and isinstance(node.value.value, ast.Name):
            member = self._enum_member(node.value.value.id, node.value.attr, node.lineno)
            if member is not None:  # `Algorithm.FEDREP.value`: the member's literal in the app's Enum class
                return member
        if isinstance(node.value, ast.Name) and node.attr in self.options:
            option = self.options[node.attr]
            return option if option.value is not None else None  # passed, but its value is known only at run time
        parts = ast.unparse(node).split(".")
        for start in range(1, len(parts)):  # self.cfg.train.lr -> cfg.train.lr, train.lr: a YAML config's key
            dotted = ".".join(parts[start:])
            single = start == len(parts) - 1  # one key: only off a config object (cfg.lr, self.cfg.lr)
            if dotted in self.config and (not single or len(parts) == 2 or _CONFIGURATION.search(parts[start - 1])):
                value, source = self.config[dotted]
                return Found("", value, f"{source} {dotted}", node.lineno)
        return self._instance_field(node, depth)

    def _enum_member(self, cls: str, member: str, line: int) -> Found | None:
        """The literal member `member` of the app's class `cls` (an Enum: `FEDREP = "fedrep"`), where exactly one
        class of that name in the app's code assigns it."""
        values = [
            (statement.value.value, f"{reader.relative}:{statement.lineno}")
            for reader in [self, *(peer for peer in self.peers if peer is not self)]
            for owner in ast.walk(reader.tree)
            if isinstance(owner, ast.ClassDef) and owner.name == cls
            for statement in owner.body
            if isinstance(statement, ast.Assign)
            and isinstance(statement.value, ast.Constant)
            and any(isinstance(target, ast.Name) and target.id == member for target in statement.targets)
        ]
        if len(values) != 1:
            return None
        value, where = values[0]
        return Found("", value, f"{where} ({cls}.{member})", line)

    def _instance_field(self, node: ast.Attribute, depth: int) -> Found | None:
        """`prefs.optimizer` where `prefs = Preferences(...)` builds a class of the app: the keyword passed, else the
        class's own default for that field."""
        if not isinstance(node.value, ast.Name):
            return None
        reader, made = self, self.expression(node.value)
        function = self.function_of(node)
        if isinstance(made, ast.Name) and function is not None and made.id in {a.arg for a in _all_arguments(function)}:
            # A parameter: the object every caller passes (`make_optimizer(net, prefs)`), built the same way.
            given = self.caller_arguments(function, made.id) or []
            built = [(caller, caller.expression(expression)) for caller, expression in given]
            if not built or len({ast.unparse(expression) for _, expression in built}) != 1:
                return None
            reader, made = built[0]
        if not isinstance(made, ast.Call) or made.args:
            return None
        passed = next((k.value for k in made.keywords if k.arg == node.attr), None)
        if passed is not None:
            return reader.value(passed, depth + 1)
        if any(k.arg is None for k in made.keywords):
            return None
        for reader in self.peers:
            for definition in reader.definitions(call_name(made), top_level=True):
                if not isinstance(definition, ast.ClassDef):
                    continue
                for statement in definition.body:
                    if (
                        isinstance(statement, ast.AnnAssign)
                        and isinstance(statement.target, ast.Name)
                        and statement.target.id == node.attr
                        and statement.value is not None
                    ):
                        return reader.value(statement.value, depth + 1)
        return None

    def _item(self, node: ast.Subscript, depth: int) -> Found | None:
        """`PARAMS["batch_size"]` of a dict literal the module or function assigns."""
        if not (isinstance(node.slice, ast.Constant) and isinstance(node.value, ast.Name)):
            return None
        reader, table = self, self.expression(node.value)
        if isinstance(table, ast.Name):  # `from settings import PARAMS`: the table another module assigns
            reader, table = self._imported_assignment(table.id)
            if table is None:
                return None
        if isinstance(table, ast.Call) and call_name(table) == "dict" and not table.args:
            pairs = {keyword.arg: keyword.value for keyword in table.keywords if keyword.arg}
        elif isinstance(table, ast.Dict):
            pairs = {key.value: value for key, value in zip(table.keys, table.values) if isinstance(key, ast.Constant)}
        else:
            return None
        return reader.value(pairs.get(node.slice.value), depth + 1)

    def _imported_assignment(self, name: str) -> tuple[ModuleReader, ast.AST | None]:
        """The expression a name imported from another module of the app is assigned there (at module level)."""
        source = self.imports.get(name)
        if source is None or self.module_of is None:
            return self, None
        dotted, level, original = source
        module = self.module_of(self, dotted, level)
        if module is None or module is self:
            return self, None
        above = module._assigned.get((0, original), ())
        if not above:
            return self, None
        expression = module.expression(max(above, key=lambda statement: statement.lineno).value)
        if isinstance(expression, ast.Name):
            return module._imported_assignment(expression.id)
        return module, expression

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
            # The one value every call that runs passes (its default where a call leaves it out); none where a
            # call passes something unread, though the default is there.
            return self._passed(function, node.id, depth)
        reader, expression = self._imported_assignment(node.id)
        return reader.value(expression, depth + 1) if expression is not None else None

    def _unpacked(self, node: ast.Name, depth: int) -> Found | None:
        """`a, noise, b = helper(...)`: the element of the tuple the module's own `helper` returns."""
        function = self.function_of(node)
        for statement in self._unpacking.get(id(function) if function is not None else 0, ()):
            if not (
                statement.lineno <= node.lineno
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
        if ("passed", key) in self.memo:
            return self.memo["passed", key]
        given = self._component_argument(function, name)
        if given is not None:
            return given
        _RESOLVING.add(key)
        try:
            found = self._passed_by_callers(function, name, depth)
        finally:
            _RESOLVING.discard(key)
        self.memo["passed", key] = found
        return found

    def _component_argument(self, function, name: str) -> Found | None:
        """A constructor argument a job config gives the class (an NVFlare executor's `args`)."""
        owner = self._parents.get(function)
        if function.name != "__init__" or not isinstance(owner, ast.ClassDef):
            return None
        return self.component_args.get(owner.name, {}).get(name)

    def _passed_by_callers(self, function, name: str, depth: int) -> Found | None:
        given = self.caller_arguments(function, name, with_defaults=True)
        if given is None:
            return None
        default = _parameter_default(function, name)
        values = [
            reader.value(expression, depth + 1) if expression is not None else self.value(default, depth + 1)
            for reader, expression in given
        ]
        if not values and default is not None:  # never called where rankaudit sees it: the default
            return self.value(default, depth + 1)
        if values and all(values) and len({repr(v.value) for v in values}) == 1:
            return values[0]
        return None

    def caller_arguments(
        self, function, name: str, with_defaults: bool = False
    ) -> list[tuple[ModuleReader, ast.AST | None]] | None:
        """What each call of `function` in code that runs passes for parameter `name`, with the reader of the
        call's file; None where a call passes it by `*args`/`**kwargs` or leaves it to the default (with
        `with_defaults`, such a call's expression is None)."""
        positional = [arg.arg for arg in [*function.args.posonlyargs, *function.args.args]]
        owner = self._parents.get(function)
        method = isinstance(owner, ast.ClassDef) and not any(
            ast.unparse(decorator) == "staticmethod" for decorator in function.decorator_list
        )
        # A method is called through its object (self.train(x)), a constructor through its class (Client(x)):
        # neither call passes `self`.
        if method:
            positional = positional[1:]
        called = owner.name if method and function.name == "__init__" else function.name
        found = []
        for reader in self.peers:
            # `from task import train as train_fn`: train_fn(...) calls it too.
            aliases = {local for local, (_, _, original) in reader.imports.items() if original == called}
            calls = [call for alias in sorted({called} | aliases) for call in reader.calls_named(alias)]
            for call in calls:
                if not method and _called_on_an_object(reader, call):
                    continue  # `net.train()` is the module's method, not the app's function train()
                if reader.branch(call) is False or reader.decorates(call):
                    continue
                if any(isinstance(arg, ast.Starred) for arg in call.args) or any(k.arg is None for k in call.keywords):
                    return None
                given = next((k.value for k in call.keywords if k.arg == name), None)
                if given is None and name in positional and positional.index(name) < len(call.args):
                    given = call.args[positional.index(name)]
                if given is None and not with_defaults:
                    return None  # a call that leaves it to the default
                found.append((reader, given))
        return found

    def _assignment(self, node: ast.Name) -> ast.Assign | ast.AnnAssign | None:
        """The last plain assignment of `node`'s name above it, in its function (then the functions around it),
        else at module level (a function parameter of that name stops the search: its value is the caller's)."""
        function = self.function_of(node)
        while True:
            scope = id(function) if function is not None else 0
            above = [s for s in self._assigned.get((scope, node.id), ()) if s.lineno <= node.lineno]
            if above:
                return max(above, key=lambda statement: statement.lineno)
            if function is None:
                return None
            if any(arg.arg == node.id for arg in _all_arguments(function)):
                return None
            function = self.function_of(function)

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
        return self._calls

    def names(self) -> list[ast.Name | ast.Attribute]:
        return self._names

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


def _called_on_an_object(reader, call: ast.Call) -> bool:
    """`net.train()`: a call through a local object, not through a module the file imports (`task.train(...)`,
    `from pkg import task` or `import task`)."""
    func = call.func
    if not isinstance(func, ast.Attribute):
        return False
    if not isinstance(func.value, ast.Name):
        return True
    return func.value.id not in reader.module_aliases and func.value.id not in reader.imports
