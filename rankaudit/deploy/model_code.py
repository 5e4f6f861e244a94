"""The model in an app's code, read with ast: its nn.Module classes and factories, the modules that import them,
and where the app builds the one it trains."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from rankaudit.deploy.code_reader import ModuleReader
from rankaudit.deploy.found import Found, call_name
from rankaudit.deploy.syntax import syntax_of
from rankaudit.errors import UsageError
from rankaudit.settings.files import read_source

# ---- the model: nn.Module classes the client app's module imports ------------------------------------------------


@dataclass(frozen=True)
class Instantiation:
    """Where the app builds its model: the class or factory called, its keyword arguments as read."""

    name: str
    arguments: dict[str, Found | None]
    source: str
    positional: tuple = ()  # values passed by position, named once the definition is known (with_names)

    def with_names(self, definition: Path) -> Instantiation:
        """The positional values under the parameter names of the class's __init__ or the factory in `definition`."""
        if not self.positional:
            return self
        try:
            tree = ast.parse(read_source(definition))
        except (UsageError, SyntaxError, ValueError, RecursionError, MemoryError):
            return self
        node = next((n for n in tree.body if getattr(n, "name", None) == self.name), None)
        if isinstance(node, ast.ClassDef):
            node = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            skip = 1
        else:
            skip = 0
        if not isinstance(node, ast.FunctionDef):
            return self
        names = [arg.arg for arg in [*node.args.posonlyargs, *node.args.args]][skip:]
        named = dict(zip(names, self.positional))
        return Instantiation(self.name, {**named, **self.arguments}, self.source)


def instantiated(
    files: list[Path], names: list[str], root: Path, config=None, *, entries: list[Path] | None = None, whole=True
) -> list[Instantiation]:
    """The calls of model classes or factories (`names`) in `files`, one per name, in code that runs: what the
    `entries` (else the modules that start a Flower client or server) reach, or every file with `whole`."""
    from rankaudit.deploy import reach

    found: dict[str, Instantiation] = {}
    wanted = set(names)
    readers = []
    for path in files:
        try:
            readers.append(ModuleReader(path, root, config or {}))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
    modules = reach.ModuleIndex(readers)
    for reader in readers:
        reader.peers, reader.module_of = readers, modules.module
    if not whole:
        reach.mark_live(readers, entries, modules)
    inside: dict[str, list[Instantiation]] = {}
    undecided: dict[str, list[str]] = {}
    for reader in readers:
        defined = set(reader.definitions_by_name()) | set(reader.methods)
        for call in reader.calls():
            name = call_name(call) or _looked_up(reader, call, wanted)
            if name not in wanted or name in found or reader.branch(call) is False:
                continue
            function = reader.function_of(call)
            if function is not None and function.name in wanted and function.name in defined:
                # Inside a factory of the same file: the factory is what the app calls, unless it is given what
                # cannot be passed here (the config object); then the model it builds is the one taken.
                taken = reader.branch(call)
                if taken is True:
                    inside.setdefault(function.name, []).append(_made(reader, call, name))
                else:
                    undecided.setdefault(function.name, []).append(f"{name} at {reader.where(call)}, by {taken}")
                continue
            owner = reader._enclosing(call, ast.ClassDef)
            if owner is not None and owner.name in wanted:
                continue  # a layer a model class builds inside itself
            found[name] = _made(reader, call, name)
    for name, made in list(found.items()):
        unread = None in made.positional or None in made.arguments.values()
        if unread and len(inside.get(name, [])) == 1:
            found[name] = inside[name][0]
        elif unread and not inside.get(name) and len(undecided.get(name, [])) > 1:
            raise UsageError(
                f"the model is chosen when the app runs: {made.name}() at {made.source} builds "
                + " or ".join(undecided[name]),
                "state the key that condition reads in the app's configuration, or the model "
                '(model = "FILE.py:NAME") in [tool.rankaudit]',
            )
    return list(found.values())


def _looked_up(reader: ModuleReader, call: ast.Call, wanted: set[str]) -> str:
    """The class a registry lookup calls, `{"cnn": CNN, "mlp": MLP}[cfg.model_name](...)` (or a module-level
    dict of that shape): the entry the key read names; "" where the call is no such lookup. A key that is not read
    stops in one line naming the entries, never the first of them."""
    if not isinstance(call.func, ast.Subscript):
        return ""
    table = call.func.value
    if isinstance(table, ast.Name):
        table = next(
            (
                statement.value
                for statement in reader.tree.body
                if isinstance(statement, ast.Assign)
                and any(isinstance(target, ast.Name) and target.id == table.id for target in statement.targets)
            ),
            None,
        )
    if not isinstance(table, ast.Dict):
        return ""
    entries = {
        key.value: call_name(value)
        for key, value in zip(table.keys, table.values)
        if isinstance(key, ast.Constant) and isinstance(value, (ast.Name, ast.Attribute))
    }
    if not any(name in wanted for name in entries.values()):
        return ""
    key = reader.value(call.func.slice)
    if key is None and reader.branch(call) is not False:
        shown = " or ".join(f"{name} ({key!r})" for key, name in entries.items())
        raise UsageError(
            f"the model is chosen when the app runs: {shown}, looked up by `{ast.unparse(call.func.slice)}` at "
            f"{reader.where(call)}",
            'state that key in the app\'s configuration, or the model (model = "FILE.py:NAME") in [tool.rankaudit]',
        )
    return entries.get(key.value, "") if key is not None else ""


def _made(reader: ModuleReader, call: ast.Call, name: str) -> Instantiation:
    arguments = {keyword.arg: reader.value(keyword.value) for keyword in call.keywords if keyword.arg}
    positional = tuple(reader.value(arg) for arg in call.args if not isinstance(arg, ast.Starred))
    return Instantiation(name, arguments, reader.where(call), positional)


def attribute_layers(model: str, words: list[str]) -> list[tuple[str, str]]:
    """The layers model class `model` (PATH:NAME) assigns in its __init__ (`self.bn1 = nn.BatchNorm2d(...)`) whose
    names hold one of `words`, each with the class it is built with: the state-dict keys under them hold the word
    too. Layers nested deeper are not named (they stay judged as sent, the stronger case for the attacker)."""
    path_text, _, name = model.rpartition(":") if model.count(":") else (model, "", "")
    try:
        tree = ast.parse(read_source(Path(path_text)))
    except (UsageError, SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    owner = next((node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name), None)
    init = next(
        (
            node
            for node in (owner.body if owner else [])
            if isinstance(node, ast.FunctionDef) and node.name == "__init__"
        ),
        None,
    )
    found: list[tuple[str, str]] = []
    for statement in ast.walk(init) if init is not None else []:
        if not isinstance(statement, ast.Assign):
            continue
        for target in statement.targets:
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and any(word in target.attr for word in words)
                and isinstance(statement.value, ast.Call)
                and target.attr not in [name for name, _ in found]
            ):
                found.append((target.attr, call_name(statement.value)))
    return found


def module_classes(tree: ast.Module) -> dict[str, int]:
    """Classes in a module that subclass nn.Module (directly, or through another class of the same module):
    name -> line."""
    bases = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found: dict[str, int] = {}

    def is_module(name: str, seen: frozenset = frozenset()) -> bool:
        node = bases.get(name)
        if node is None or name in seen:
            return False
        for base in node.bases:
            text = ast.unparse(base)
            if (
                text in ("nn.Module", "torch.nn.Module", "Module")
                or text.endswith("LightningModule")
                or is_module(text, seen | {name})
            ):
                return True
        return False

    for name, node in bases.items():
        if is_module(name):
            found[name] = node.lineno
    return found


_FACTORY = re.compile(r"^(get|build|create|make|load|init)_(model|net|network)$")


def model_factories(tree: ast.Module) -> dict[str, int]:
    """Module-level functions whose name says they build a model (get_model, build_net, ...): name -> line."""
    return {
        node.name: node.lineno
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and _FACTORY.match(node.name.lower())
    }


def model_builders(tree: ast.Module) -> set[str]:
    """Module-level functions that may build the model: named so (get_model), named like a class (ResNet18), or
    returning a call of one of the module's nn.Module classes."""
    classes = set(module_classes(tree))
    builders = set(model_factories(tree))
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef):
            continue
        returns = [
            statement.value
            for statement in ast.walk(node)
            if isinstance(statement, ast.Return) and isinstance(statement.value, ast.Call)
        ]
        if node.name[:1].isupper() or any(call_name(value) in classes for value in returns):
            builders.add(node.name)
    return builders


def imported_modules(path: Path, root: Path) -> list[tuple[Path, set[str] | None]]:
    """Files of the app a module imports: (file, the names imported from it, or None for the whole module)."""
    syntax = syntax_of(path)
    package = path.resolve().parent.relative_to(root).parts if path.resolve().is_relative_to(root) else ()
    found: list[tuple[Path, set[str] | None]] = []

    def locate(dotted: list[str]) -> Path | None:
        for candidate in (root.joinpath(*dotted).with_suffix(".py"), root.joinpath(*dotted, "__init__.py")):
            if dotted and candidate.is_file():
                return candidate
        return None

    for node in syntax.import_nodes:
        if isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            dotted = base + (node.module.split(".") if node.module else [])
            module = locate(dotted)
            for alias in node.names:  # `from pkg import task` imports a module, not a name
                submodule = locate(dotted + [alias.name])
                if submodule is not None:
                    found.append((submodule, None))
                elif module is not None:
                    found.append((module, {alias.name}))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                module = locate(alias.name.split("."))
                if module is not None:
                    found.append((module, None))
    return found


# ---- a config key that names the model: `model_name: cnn`, `model-name = "cnncifar10"` --------------------------

# Run-config and Hydra keys that name the model an app builds (FedRep's `model-name = "cnncifar10"`).
MODEL_NAME_KEYS = ("model-name", "model_name", "model-type", "model_type", "model")


def plain_name(text: str) -> str:
    """A name as a model-name key compares it with a class: letter case and `-`/`_` aside."""
    return text.lower().replace("-", "").replace("_", "")


def refuse_unmatched_model_name(directory: Path, config, files: list[Path], models: list[str]) -> None:
    """A config key naming the model (`model_name: resnet`) that no branch or registry entry of the app's code that
    builds a model takes (`if cfg.model_name == "cnn": CNN(...)`, `{"cnn": CNN}[cfg.model_name]`): the app would
    stop or build another model when it runs, so rankaudit stops in one line with the values the code takes.
    Nothing happens where the code does not choose its model by that key."""
    wanted = set(models)
    for key, (value, source) in config.items():
        last = key.rsplit(".", 1)[-1]
        if last not in MODEL_NAME_KEYS or not isinstance(value, str) or not value.strip():
            continue
        choices: dict[str, str] = {}  # the value a branch or an entry takes -> where
        for path in files:
            try:
                tree = syntax_of(path).tree
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError, UsageError):
                continue
            shown = path.relative_to(directory) if path.is_relative_to(directory) else path
            for taken, line in _model_choices(tree, last, wanted):
                choices.setdefault(taken, f"{shown}:{line}")
        if not choices or value in choices:
            continue
        listed = ", ".join(f"{taken!r} ({where})" for taken, where in choices.items())
        raise UsageError(
            f"{key} = {value!r} at {source} names no model the app builds: its code takes {listed}",
            f'set {key} to one of them, or name the model: model = "FILE.py:NAME" in [tool.rankaudit]',
        )


def _model_choices(tree: ast.Module, key: str, models: set[str]):
    """(value, line) for each place the code builds a model by the value of `key`: an `if`/`elif` or a
    conditional expression comparing it with a word (`==`, `in (...)`), a `match` case, a registry dict it looks
    up."""

    def reads_key(node: ast.AST) -> bool:
        if isinstance(node, ast.Attribute):
            return plain_name(node.attr) == plain_name(key)
        if isinstance(node, ast.Name):
            return plain_name(node.id) == plain_name(key)
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            return isinstance(node.slice.value, str) and plain_name(node.slice.value) == plain_name(key)
        return False

    def words(node: ast.AST) -> list[str]:
        items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return [item.value for item in items if isinstance(item, ast.Constant) and isinstance(item.value, str)]

    def builds_model(nodes) -> bool:
        return any(isinstance(n, ast.Call) and call_name(n) in models for node in nodes for n in ast.walk(node))

    tables = {
        target.id: statement.value
        for statement in tree.body
        if isinstance(statement, ast.Assign) and isinstance(statement.value, ast.Dict)
        for target in statement.targets
        if isinstance(target, ast.Name)
    }
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp)):
            builds = builds_model(node.body if isinstance(node, ast.If) else [node.body])
            for test in (t for t in ast.walk(node.test) if isinstance(t, ast.Compare) and builds):
                operands = [test.left, *test.comparators]
                if all(isinstance(op, (ast.Eq, ast.In)) for op in test.ops) and any(map(reads_key, operands)):
                    for operand in operands:
                        yield from ((word, node.lineno) for word in words(operand))
        elif isinstance(node, ast.Match) and reads_key(node.subject):
            for case in node.cases:
                patterns = case.pattern.patterns if isinstance(case.pattern, ast.MatchOr) else [case.pattern]
                for pattern in patterns if builds_model(case.body) else []:
                    if isinstance(pattern, ast.MatchValue):
                        yield from ((word, pattern.lineno) for word in words(pattern.value))
        elif isinstance(node, ast.Subscript) and reads_key(node.slice):
            table = tables.get(node.value.id) if isinstance(node.value, ast.Name) else node.value
            if isinstance(table, ast.Dict):
                for entry, model in zip(table.keys, table.values):
                    if entry is not None and call_name(model) in models:
                        yield from ((word, node.lineno) for word in words(entry))
