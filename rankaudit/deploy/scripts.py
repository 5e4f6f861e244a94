"""A training script's command line: argparse's defaults, and the arguments a job passes it (read, never run)."""

from __future__ import annotations

import ast
import shlex

from rankaudit.deploy.found import Found, call_name


def option_name(flag: str) -> str:
    """`--batch-size` / `--batch_size` -> `batch_size`, the attribute argparse gives it."""
    return flag.lstrip("-").replace("-", "_")


def argparse_defaults(reader) -> dict[str, Found]:
    """Each `parser.add_argument("--name", default=...)` of the file: the option's name -> its default, read."""
    reader.options = {}  # a default is a literal; it never reads another option
    reader.option_names = {}  # every spelling of an option (-b, --batch-size) -> its attribute name
    found: dict[str, Found] = {}
    for call in reader.calls():
        if call_name(call) != "add_argument":
            continue
        flags = [arg.value for arg in call.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
        long_flags = [flag for flag in flags if flag.startswith("--")] or flags
        keywords = {keyword.arg: keyword.value for keyword in call.keywords if keyword.arg}
        destination = keywords.get("dest")
        if isinstance(destination, ast.Constant) and isinstance(destination.value, str):
            name = destination.value
        elif long_flags:
            name = option_name(long_flags[0])
        else:
            continue
        reader.option_names.update({option_name(flag): name for flag in flags})
        action = keywords.get("action")
        shown = long_flags[0] if long_flags else name
        if "default" in keywords:
            value = reader.value(keywords["default"])
            if value is not None:
                found[name] = Found(
                    name, value.value, f"{reader.where(call)} ({shown}'s argparse default)", call.lineno
                )
        elif isinstance(action, ast.Constant) and action.value in ("store_true", "store_false"):
            found[name] = Found(
                name, action.value == "store_false", f"{reader.where(call)} ({shown}, not passed)", call.lineno
            )
    return found


RUN_TIME = "\x00run-time\x00"  # a word whose value the job computes when it runs


def _typed(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def tokens(reader, node: ast.AST | None) -> list[tuple[str, str]] | None:
    """The words of a script-arguments expression with where each was read: a string literal, an f-string, a
    name assigned one, or pieces joined with `+` (hello-lightning's `f"--batch_size {b} ..." + ("..." if c else
    "")`); None where it is not static. A part of an f-string known only at run time (a data path the job
    computes) is the word RUN_TIME, so the words around it are still read."""
    if node is None:
        return None
    node = reader.expression(node)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [(word, reader.where(node)) for word in shlex.split(node.value)]
    parts = _parts(reader, node)
    if parts is None:
        return None
    words: list[tuple[str, str]] = []
    glued = False  # a part that continues the previous word ("--lr={lr}")
    for text, source, value in parts:
        pieces = text.split() or ([""] if value else [])
        if glued and words and pieces and not text[:1].isspace():
            word, _ = words.pop()
            pieces = [word + pieces[0], *pieces[1:]]
        words += [(piece, source) for piece in pieces]
        glued = bool(text) and not text[-1:].isspace()
    return words


def _parts(reader, node: ast.AST) -> list[tuple[str, str, bool]] | None:
    """The text pieces of a string expression, each (text, where it was read, whether it is a value put in)."""
    node = reader.expression(node)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [(node.value, reader.where(node), False)]
    if isinstance(node, ast.JoinedStr):
        parts = []
        for part in node.values:
            if isinstance(part, ast.FormattedValue):
                value = reader.value(part.value)
                parts.append(
                    (RUN_TIME, reader.where(part), True) if value is None else (str(value.value), value.source, True)
                )
            elif isinstance(part, ast.Constant):
                parts.append((str(part.value), reader.where(part), False))
            else:
                return None
        return parts
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _parts(reader, node.left), _parts(reader, node.right)
        return None if left is None or right is None else left + right
    if isinstance(node, ast.IfExp):
        test = reader.value(node.test)
        if test is not None and isinstance(test.value, (bool, int, float, str)) and test.value is not None:
            return _parts(reader, node.body if test.value else node.orelse)
        branches = [_parts(reader, node.body), _parts(reader, node.orelse)]
        if None in branches:
            return None
        # Either branch may run: each option either one names is known only at run time, never one branch's.
        named = [word.split("=")[0] for branch in branches for text, _, _ in branch for word in text.split()]
        options = [word for word in dict.fromkeys(named) if word.startswith("-")]
        return [(" " + " ".join(f"{option} {RUN_TIME}" for option in options) + " ", reader.where(node), False)]
    return None


def passed_options(words: list[tuple[str, str]], where: str) -> dict[str, Found]:
    """`--batch_size 16 --epochs=2 --flag` -> {batch_size: 16, epochs: 2, flag: True}, each with its source."""
    options: dict[str, Found] = {}
    index = 0
    while index < len(words):
        word, source = words[index]
        index += 1
        if not word.startswith("-") or word in ("-", "--"):
            continue
        if "=" in word:
            flag, text = word.split("=", 1)
        elif index < len(words) and not words[index][0].startswith("--"):
            flag, (text, source) = word, words[index]
            index += 1
        else:
            flag, text = word, None
        name = option_name(flag)
        if text is not None and RUN_TIME in text:
            # Passed, with a value the job computes when it runs: not the script's default, and not read.
            options[name] = Found(name, None, f"{source} ({where} {flag}, a value known only at run time)", 0)
            continue
        value = True if text is None else _typed(text)
        options[name] = Found(name, value, f"{source} ({where} {flag} {text if text is not None else ''})".rstrip(), 0)
    return options


def string_options(text: str, source: str) -> dict[str, Found]:
    """Script arguments written in a config file: every word read from `source`."""
    try:
        words = shlex.split(text)
    except ValueError:
        return {}
    return passed_options([(word, source) for word in words], "passes")
