"""Which of an app's code runs: the functions its client and server entry points reach, read with ast."""

from __future__ import annotations

import ast
from pathlib import Path

# Calls and names that start a Flower client or server: a module that makes one is where the app starts.
_FLOWER_STARTS = {
    "ClientApp",
    "ServerApp",
    "start_client",
    "start_numpy_client",
    "start_server",
    "start_simulation",
    "run_simulation",
    "NumPyClient",
}


def mark_live(readers: list, entries: list[Path] | None, modules: ModuleIndex) -> None:
    """Set each reader's `live` to the function definitions that the app's entry modules reach, and
    `dead_blocks` to the `if __name__ == "__main__":` blocks of modules the app only imports (a centralized
    `main()` beside the federated code). `entries`: the client and server app modules; None finds the modules that
    start a Flower client or server. Where no entry is found every function counts as running."""
    by_path = {reader.path.resolve(): reader for reader in readers}
    if entries is not None:
        starting = [by_path[path.resolve()] for path in entries if path.resolve() in by_path]
    else:
        starting = [reader for reader in readers if _starts_flower(reader)]
    if not starting:
        return
    for reader in readers:
        reader.live = set()
        # A module nothing imports never runs, its module-level code included (a sweep script beside the app).
        reader.dead_blocks = {id(block) for block in _main_blocks(reader.tree)} | {id(reader.tree)}
    pending: list[tuple[object, ast.AST]] = []  # (reader, region) whose references are still to follow
    loaded: set[int] = set()

    def load(reader, entry: bool) -> None:
        if id(reader) in loaded:
            return
        loaded.add(id(reader))
        reader.dead_blocks.discard(id(reader.tree))
        if entry:
            reader.dead_blocks = set()
        pending.append((reader, reader.tree))
        for node in reader.decorated:  # registered with a decorator (@app.train()): called by the framework
            enter(reader, node)

    def enter(reader, definition: ast.AST) -> None:
        if id(definition) in reader.live:
            return
        reader.live.add(id(definition))
        if isinstance(definition, ast.ClassDef):  # a class in use: the framework calls its methods (fit, forward)
            for item in ast.walk(definition):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and id(item) not in reader.live:
                    reader.live.add(id(item))
                    pending.append((reader, item))
        pending.append((reader, definition))

    for reader in starting:
        load(reader, entry=True)
    for value, _ in (starting[0].config or {}).values():  # a YAML config naming the app's code by its path
        if isinstance(value, str):
            for owner, definition in modules.dotted(starting[0], value):
                enter(owner, definition)
    while pending:
        reader, region = pending.pop()
        for node in _region_nodes(region, reader):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for module in modules.imported(reader, node):
                    load(module, entry=False)
                if isinstance(node, ast.ImportFrom):  # a function or class imported by name is one the app uses
                    for alias in node.names:
                        if alias.name == "*":
                            continue  # its names are looked up where they are used (named)
                        for owner, definition in modules.named(reader, alias.asname or alias.name):
                            enter(owner, definition)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                for owner, definition in modules.dotted(reader, node.value):  # Hydra's `_target_: pkg.mod.fn`
                    enter(owner, definition)
            elif isinstance(node, ast.Name):
                for owner, definition in modules.named(reader, node.id):
                    enter(owner, definition)
            elif isinstance(node, ast.Attribute):
                for owner, definition in modules.attribute(reader, node):
                    enter(owner, definition)


def _starts_flower(reader) -> bool:
    return any(reader.calls_named(name) for name in _FLOWER_STARTS) or any(
        isinstance(node, ast.ClassDef) and any(ast.unparse(base).endswith("NumPyClient") for base in node.bases)
        for node in reader.tree.body
    )


def _main_blocks(tree: ast.Module) -> list[ast.If]:
    return [
        node
        for node in tree.body
        if isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and "__name__" in ast.unparse(node.test)
        and "__main__" in ast.unparse(node.test)
    ]


def _region_nodes(region: ast.AST, reader):
    """The nodes of a function body (or a module, or a class) outside the definitions nested in it (each its own
    region) and outside a module's dead `__main__` block."""
    stack = list(ast.iter_child_nodes(region))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            stack.extend(node.decorator_list)  # decorators and defaults run where the definition is
            if not isinstance(node, ast.ClassDef):
                stack.extend(node.args.defaults + [d for d in node.args.kw_defaults if d is not None])
            else:
                stack.extend(node.bases)
            continue
        if id(node) in reader.dead_blocks:
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


class ModuleIndex:
    """The app's modules by import name, and each module's definitions by name."""

    def __init__(self, readers: list):
        self.readers = readers
        self.parts = {id(reader): _module_parts(reader) for reader in readers}
        self.methods: dict[str, list] = {}
        self.by_last: dict[str, list] = {}  # the app's modules by the last part of their name
        for reader in readers:
            if self.parts[id(reader)]:
                self.by_last.setdefault(self.parts[id(reader)][-1], []).append(reader)
        for reader in readers:
            for name, methods in reader.methods.items():
                self.methods.setdefault(name, []).extend((reader, method) for method in methods)

    def module(self, reader, dotted: list[str], level: int):
        """The app's module `dotted` as imported from `reader` (`level` dots for a relative import)."""
        if level:
            own = self.parts[id(reader)]
            package = own if reader.path.name == "__init__.py" else own[:-1]
            dotted = list(package[: len(package) - level + 1]) + dotted
        if not dotted:
            return None
        matches = self.by_last.get(dotted[-1], [])
        matches = [other for other in matches if self.parts[id(other)][-len(dotted) :] == dotted]
        exact = [other for other in matches if self.parts[id(other)] == dotted]
        return (exact or matches or [None])[0]

    def imported(self, reader, node) -> list:
        found = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = self.module(reader, alias.name.split("."), 0)
                found += [module] if module is not None else []
            return found
        dotted = node.module.split(".") if node.module else []
        base = self.module(reader, dotted, node.level)
        found += [base] if base is not None else []
        for alias in node.names:  # `from pkg import task` imports a module
            module = self.module(reader, dotted + [alias.name], node.level)
            found += [module] if module is not None else []
        return found

    def named(self, reader, name: str) -> list:
        """What a bare name refers to: the module's own definitions of it, else the definition it imports."""
        own = reader.definitions(name)
        if own:
            return [(reader, definition) for definition in own]
        source = reader.imports.get(name)
        if source is None:  # `from cifar import *`: whichever of those modules defines it
            stars = [self.module(reader, dotted, level) for dotted, level, _ in reader.star_imports]
            return [(m, found) for m in stars if m is not None for found in m.definitions(name, top_level=True)]
        dotted, level, original = source
        module = self.module(reader, dotted, level)
        if module is None:
            return []
        return [(module, definition) for definition in module.definitions(original, top_level=True)]

    def dotted(self, reader, text: str) -> list:
        """`pkg.client.gen_client_fn` written as a string (Hydra's `_target_`): that definition of the app."""
        parts = text.split(".")
        if len(parts) < 2 or not all(part.isidentifier() for part in parts):
            return []
        module = self.module(reader, parts[:-1], 0)
        return [(module, definition) for definition in module.definitions(parts[-1], top_level=True)] if module else []

    def attribute(self, reader, node: ast.Attribute) -> list:
        """`module.function` of an imported module, else every method of that name (`self.train`, `client.fit`)."""
        if isinstance(node.value, ast.Name) and node.value.id in reader.module_aliases:
            dotted, level = reader.module_aliases[node.value.id]
            module = self.module(reader, dotted, level)
            if module is not None:
                return [(module, definition) for definition in module.definitions(node.attr, top_level=True)]
        return self.methods.get(node.attr, [])


def _module_parts(reader) -> list[str]:
    parts = list(Path(reader.relative).with_suffix("").parts)
    return parts[:-1] if parts and parts[-1] == "__init__" else parts
