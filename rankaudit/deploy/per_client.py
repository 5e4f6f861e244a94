"""Model arguments an app sets per client in code (DepthFL's `model.n_blocks = i // (cfg.num_clients // 4) + 1` on
a copy of the config's model node): the largest value any client gets, with a note, or a one-line stop where the
values are not read."""

from __future__ import annotations

import ast
import operator
from dataclasses import replace
from pathlib import Path

from rankaudit.deploy.code_reader import ModuleReader
from rankaudit.deploy.found import Found
from rankaudit.deploy.model_code import Instantiation
from rankaudit.errors import UsageError

# Loops longer than this are not unrolled: the values stay unread.
_MOST_CLIENTS = 100_000
_OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class _Unread(Exception):
    """An expression that depends on something other than the loop's counter and the app's configuration."""


def deepest(
    directory: Path, files: list[Path], config, made: Instantiation | None, stated: set[str]
) -> tuple[Instantiation | None, list[str]]:
    """The model built from a config node (`model: {_target_: ..., n_blocks: 4}`), with each argument the code
    overrides per client (an assignment to `copy.n_blocks` or `copy["n_blocks"]` where `copy` was taken from
    `cfg.model`) replaced by the largest value it takes over the loop around it: the deepest client's model, the
    worst case, since a shallower one trains a part of its blocks and exits. Arguments the user states (`stated`)
    are left alone; a value that is not read stops in one line naming the argument to state."""
    if made is None or not made.arguments:
        return made, []
    node = _config_node(made)
    if node is None:
        return made, []
    arguments, notes = dict(made.arguments), []
    for path in files:
        try:
            reader = ModuleReader(path, directory, config)
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError, UsageError):
            continue
        for assign, argument in _per_client_assignments(reader, node, set(arguments) - stated):
            where, expression = reader.where(assign), ast.unparse(assign.value)
            values = _values(reader, assign)
            if values is None or not all(isinstance(value, int) and not isinstance(value, bool) for value in values):
                raise UsageError(
                    f"{argument} of the model is set per client at {where} (`{expression}`), which rankaudit does "
                    "not read",
                    f"state the largest value any client trains with: --model-arg {argument}=N (model-args in "
                    "[tool.rankaudit])",
                )
            largest = max(values)
            arguments[argument] = Found(argument, largest, f"{where} (the largest of `{expression}` over the clients)")
            notes.append(
                f"{argument} is set per client at {where} ({min(values)} to {largest} over {len(values)} clients): "
                f"the model with {argument} = {largest} is analysed, the deepest a client trains: the worst case "
                "where a shallower client's model is a part of it (DepthFL's blocks and exits)"
            )
    return replace(made, arguments=arguments), notes


def _config_node(made: Instantiation) -> str | None:
    """The config node the model's arguments were read from (`model` of `conf/config.yaml:12 model.n_blocks`)."""
    for found in made.arguments.values():
        if found is None:
            continue
        dotted = found.source.rsplit(" ", 1)[-1]
        if "." in dotted:
            return dotted.rsplit(".", 1)[0]
    return None


def _per_client_assignments(reader: ModuleReader, node: str, arguments: set[str]):
    """(assignment, argument) where the code sets an argument on a copy of the config node, in code that runs."""
    last = node.rsplit(".", 1)[-1]
    copies: set[str] = set()
    for statement in ast.walk(reader.tree):
        if isinstance(statement, ast.Assign) and any(
            isinstance(part, ast.Attribute) and part.attr == last for part in ast.walk(statement.value)
        ):
            copies |= {target.id for target in statement.targets if isinstance(target, ast.Name)}
    for statement in ast.walk(reader.tree):
        if not isinstance(statement, ast.Assign) or len(statement.targets) != 1:
            continue
        target = statement.targets[0]
        if isinstance(target, ast.Attribute):
            argument = target.attr
        elif isinstance(target, ast.Subscript) and isinstance(target.slice, ast.Constant):
            argument = target.slice.value
        else:
            continue
        if (
            argument in arguments
            and isinstance(target.value, ast.Name)
            and target.value.id in copies
            and reader.branch(statement) is not False
        ):
            yield statement, argument


def _values(reader: ModuleReader, assign: ast.Assign) -> list | None:
    """Every value the assignment takes: once, or once per turn of the `for NAME in range(...)` loops around it."""
    loops: list[tuple[str, range]] = []
    child = assign
    while child in reader._parents:
        parent = reader._parents[child]
        if isinstance(parent, ast.For) and child in parent.body:
            turns = _range(reader, parent)
            if turns is None:
                return None
            loops.append(turns)
        child = parent
    environments: list[dict] = [{}]
    for name, turns in loops:
        environments = [{**environment, name: turn} for environment in environments for turn in turns]
        if len(environments) > _MOST_CLIENTS:
            return None
    try:
        return [_evaluate(reader, assign.value, environment) for environment in environments]
    except (_Unread, ArithmeticError):
        return None


def _range(reader: ModuleReader, loop: ast.For) -> tuple[str, range] | None:
    call = loop.iter
    if not (
        isinstance(loop.target, ast.Name)
        and isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id == "range"
        and 1 <= len(call.args) <= 3
        and not call.keywords
    ):
        return None
    bounds = [reader.value(arg) for arg in call.args]
    if not all(found is not None and isinstance(found.value, int) for found in bounds):
        return None
    turns = range(*[found.value for found in bounds])
    return (loop.target.id, turns) if 0 < len(turns) <= _MOST_CLIENTS else None


def _evaluate(reader: ModuleReader, node: ast.AST, environment: dict):
    """An integer expression of the loop counters and values the reader resolves (the config's `cfg.num_clients`)."""
    if isinstance(node, ast.Name) and node.id in environment:
        return environment[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](
            _evaluate(reader, node.left, environment), _evaluate(reader, node.right, environment)
        )
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "int" and len(node.args) == 1:
        return int(_evaluate(reader, node.args[0], environment))
    found = reader.value(node)
    if found is None or isinstance(found.value, bool) or not isinstance(found.value, (int, float)):
        raise _Unread
    return found.value
