"""An app's YAML configuration (Hydra's conf/ with defaults lists and `${...}`, or a plain config.yaml), read into
dotted keys, each with its file and line: PyYAML gives the lines, OmegaConf resolves the interpolations."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rankaudit.errors import UsageError
from rankaudit.settings import files

# Where an app keeps its YAML config when no `@hydra.main(config_path=..., config_name=...)` names it.
_CONFIG_NAMES = ("conf/config.yaml", "config/config.yaml", "conf/base.yaml", "config.yaml", "conf/config.yml")
_SKIPPED = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", "tests", "outputs", "multirun"}
_PACKAGE_HEADER = re.compile(r"^#\s*@package\s+(\S+)", re.MULTILINE)
_NESTING = 8  # defaults lists deeper than this are a loop


@dataclass
class YamlConfig:
    """The composed config: dotted key -> (resolved value, 'FILE:LINE'); notes name what was not read."""

    entries: dict[str, tuple[object, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def read_yaml(path: Path) -> dict[str, tuple[object, int]]:
    """Dotted key -> (value, line) of one YAML file, its `${...}` resolved within the file (no defaults list)."""
    data, lines = _load(path)
    plain: dict[str, tuple[object, int]] = {}
    for key, value in files.bounded(_resolved, path, data).items():
        plain[key] = (value, lines.get(key, 0))
    return plain


def app_yaml(directory: Path) -> YamlConfig:
    """The app's YAML config as run-config-like entries: the one `@hydra.main` names (composed over its defaults
    list), else the first of the conventional names (conf/config.yaml, config.yaml, ...)."""
    config = YamlConfig()
    entries = _hydra_entries(directory)
    chosen = None
    if entries:
        distinct = list(dict.fromkeys((folder, name) for folder, name, _ in entries))
        chosen = distinct[0]
        if len(distinct) > 1:
            in_main = [(f, n) for f, n, where in entries if Path(where.split(":")[0]).name == "main.py"]
            chosen = in_main[0] if in_main else chosen
            others = ", ".join(where for f, n, where in entries if (f, n) != chosen)
            config.notes.append(
                f"several Hydra entry points ({others} besides the one used); the config of "
                f"{_relative(directory, chosen[0] / chosen[1])} is read: set the round of another run in "
                "[tool.rankaudit.round]"
            )
    else:
        named = _option_default_config(directory)
        for path in ([named] if named is not None else []) + [directory / name for name in _CONFIG_NAMES]:
            if path.is_file():
                chosen = (path.parent, path.name)
                break
    if chosen is None:
        return config
    folder, name = chosen
    data: dict = {}
    lines: dict[str, str] = {}
    try:
        _compose(directory, folder, folder, name, (), data, lines, _overrides(folder, name), config.notes, 0)
    except files.ParseFailed as error:
        config.notes.append(f"the YAML config {_relative(directory, folder / name)} is not read ({_first(error)})")
        return config
    shown = _relative(directory, folder / name)
    config.entries = {
        key: (value, lines.get(key, shown))
        for key, value in files.bounded(_resolved, folder / name, data).items()
        if value is not None
    }
    return config


def _option_default_config(directory: Path) -> Path | None:
    """The YAML config a script loads through a command-line option's default (FL4Health's
    `parser.add_argument("--config_path", default="examples/fedprox/config.yaml")`, `load_config(args.config_path)`):
    the file the default names under the app folder, or, for a path written from the repository's root, its
    longest tail that exists under the app; None when no such option names one that exists."""
    from rankaudit.deploy.syntax import syntax_of

    root = directory.resolve()
    for path in sorted(directory.rglob("*.py")):
        if _SKIPPED & set(path.relative_to(directory).parts):
            continue
        try:
            calls = syntax_of(path).calls_by_name.get("add_argument", [])
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for call in calls:
            flags = [arg.value for arg in call.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)]
            default = next((k.value for k in call.keywords if k.arg == "default"), None)
            if not any("config" in flag for flag in flags) or not isinstance(default, ast.Constant):
                continue
            if not isinstance(default.value, str) or not default.value.endswith((".yaml", ".yml")):
                continue
            parts = Path(default.value).parts
            for start in range(len(parts)):
                candidate = directory.joinpath(*parts[start:])
                if candidate.is_file() and candidate.resolve().is_relative_to(root):
                    return candidate
    return None


# ---- which config: @hydra.main(config_path=..., config_name=...) -------------------------------------------------


def _hydra_entries(directory: Path) -> list[tuple[Path, str, str]]:
    """(config folder, config file name, 'FILE:LINE' of the decorator) of each `@hydra.main` in the app."""
    found = []
    for path in sorted(directory.rglob("*.py")):
        if _SKIPPED & set(path.relative_to(directory).parts):
            continue
        try:
            text = files.read_source(path)
            if "hydra" not in text:
                continue
            tree = ast.parse(text)
        except (UsageError, SyntaxError, ValueError, RecursionError, MemoryError):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for decorator in node.decorator_list:
                if not isinstance(decorator, ast.Call) or ast.unparse(decorator.func) not in ("hydra.main", "main"):
                    continue
                given = dict(zip(("config_path", "config_name"), decorator.args))
                given.update({keyword.arg: keyword.value for keyword in decorator.keywords if keyword.arg})
                folder, name = given.get("config_path"), given.get("config_name")
                if not (isinstance(folder, ast.Constant) and isinstance(folder.value, str)):
                    continue
                if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
                    continue
                config_folder = (path.parent / folder.value).resolve()
                file_name = name.value if name.value.endswith((".yaml", ".yml")) else name.value + ".yaml"
                if (config_folder / file_name).is_file():
                    where = f"{path.relative_to(directory).as_posix()}:{decorator.lineno}"
                    found.append((config_folder, file_name, where))
    return found


# ---- Hydra's composition: the defaults list, packages, _self_ -------------------------------------------------------


def _overrides(folder: Path, name: str) -> dict[str, object]:
    """`override GROUP: OPTION` entries of the primary config's defaults list: the option chosen for the group
    wherever it is named."""
    try:
        data, _ = _load(folder / name)
    except files.ParseFailed:
        return {}
    chosen = {}
    for item in (data or {}).get("defaults", []) if isinstance(data, dict) else []:
        if isinstance(item, dict) and len(item) == 1:
            key, option = next(iter(item.items()))
            if isinstance(key, str) and key.startswith("override "):
                chosen[key.split(None, 1)[1].lstrip("/").split("@")[0]] = option
    return chosen


def _compose(root, conf, folder, name, package, data, lines, overrides, notes, depth) -> None:
    """Merge config `folder/name` (and its defaults list, in order, `_self_` where it stands, else last) into
    `data` under `package`; `lines` gets each key's 'FILE:LINE'. `conf` is the config root groups live under."""
    if depth > _NESTING:
        notes.append(f"the defaults list of {_relative(root, folder / name)} nests too deep; it is not read further")
        return
    path = folder / name
    relative = _relative(root, path)
    if not files.inside(root, path):
        notes.append(f"{relative} is outside the app's folder; rankaudit does not read it")
        return
    own, own_lines = _load(path)
    header = _PACKAGE_HEADER.search(files.read_text(path)[:1000])
    if header is not None:
        package = () if header.group(1) == "_global_" else tuple(header.group(1).split("."))
    defaults = own.pop("defaults", None) if isinstance(own, dict) else None
    items = list(defaults) if isinstance(defaults, list) else []
    if "_self_" not in items:
        items.append("_self_")
    for item in items:
        if item == "_self_":
            _merge(data, lines, package, own, {key: f"{relative}:{line}" for key, line in own_lines.items()})
            continue
        if isinstance(item, str):  # a config of the same group, merged at the same package
            target = conf / item.lstrip("/") if item.startswith("/") else folder / item
            _include(root, conf, target, package, data, lines, overrides, notes, depth, relative)
            continue
        if not (isinstance(item, dict) and len(item) == 1):
            notes.append(f"a defaults-list entry of {relative} ({item!r}) is not read")
            continue
        key, option = next(iter(item.items()))
        words = str(key).split()
        if words[0] == "override":
            continue  # applied where the group is named (_overrides)
        optional = words[0] == "optional"
        group_text = words[-1]
        group_text, _, placed = group_text.partition("@")
        group = (conf / group_text.lstrip("/")) if group_text.startswith("/") else folder / group_text
        group_key = group.relative_to(conf).as_posix() if group.is_relative_to(conf) else group_text
        option = overrides.get(group_key, option)
        if option is None or group_key.split("/")[0] == "hydra":
            continue  # hydra/launcher, hydra/job_logging: Hydra's own groups, not the app's settings
        group_package = tuple(group_key.split("/"))
        if placed:
            group_package = () if placed == "_global_" else tuple(placed.split("."))
        for chosen in option if isinstance(option, list) else [option]:
            target = group / str(chosen)
            if optional and not _config_file(target).is_file():
                continue
            _include(root, conf, target, group_package, data, lines, overrides, notes, depth, relative)


def _include(root, conf, target: Path, package, data, lines, overrides, notes, depth, named_in: str) -> None:
    path = _config_file(target)
    if not files.inside(root, path):
        notes.append(
            f"{_relative(root, path)}, named in the defaults list of {named_in}, is outside the app's folder; "
            "rankaudit does not read it"
        )
        return
    if not path.is_file():
        notes.append(f"{_relative(root, path)}, named in the defaults list of {named_in}, does not exist")
        return
    _compose(root, conf, path.parent, path.name, package, data, lines, overrides, notes, depth + 1)


def _config_file(target: Path) -> Path:
    return target if target.suffix in (".yaml", ".yml") else target.with_name(target.name + ".yaml")


def _merge(data: dict, lines: dict[str, str], package: tuple, own, own_lines: dict[str, str]) -> None:
    """Merge one file's values into `data` at `package` (maps merge key by key, the later value wins)."""
    if not isinstance(own, dict):
        return
    target = data
    for part in package:
        if not isinstance(target.get(part), dict):
            target[part] = {}
        target = target[part]
    _deep_merge(target, own)
    prefix = ".".join(package) + "." if package else ""
    for key, where in own_lines.items():
        lines[prefix + key] = where


def _deep_merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


# ---- one file: values with PyYAML, lines from its composed nodes -----------------------------------------------------


def _load(path: Path) -> tuple[dict, dict[str, int]]:
    """A YAML file's mapping and the line of each dotted key in it, parsed in a process under the memory and time
    limits, its aliases expanded and its nesting within the caps (files.bounded); a syntax error: ParseFailed."""
    return files.bounded(_parse, path, files.read_text(path), path)


def _parse(text: str, path: Path) -> tuple[dict, dict[str, int]]:
    node = yaml.compose(text, Loader=yaml.SafeLoader)
    if node is None:
        return {}, {}
    _check_expansion(node, path)
    loader = yaml.SafeLoader("")
    data = loader.construct_document(node)
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        _lines(node, "", lines)
    return (data if isinstance(data, dict) else {}), lines


def _check_expansion(root: yaml.Node, path: Path) -> None:
    """The values a YAML document holds with every alias expanded, and its nesting, within files.MAX_NODES and
    files.MAX_DEPTH: a 370-byte alias bomb composes to a few nodes but expands to billions of values."""
    expanded: dict[int, int] = {}
    depth_of: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if not children_done:
            if key in expanded:
                continue
            if any(id(child) in open_nodes for child in children):  # an alias inside its own anchor: endless
                raise files.too_many_values(path)
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in children if id(child) not in expanded)
            continue
        open_nodes.discard(key)
        expanded[key] = 1 + sum(expanded[id(child)] for child in children)
        depth_of[key] = 1 + max((depth_of[id(child)] for child in children), default=0)
        if expanded[key] > files.MAX_NODES:
            raise files.too_many_values(path)
        if depth_of[key] > files.MAX_DEPTH:
            raise files.nests_too_deep(path)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _lines(node: yaml.MappingNode, prefix: str, lines: dict[str, int]) -> None:
    for key, value in node.value:
        if not isinstance(key, yaml.ScalarNode):
            continue
        dotted = prefix + str(key.value)
        lines[dotted] = key.start_mark.line + 1
        if isinstance(value, yaml.MappingNode):
            _lines(value, dotted + ".", lines)


def _resolved(data: dict) -> dict[str, object]:
    """Every leaf of `data` (a scalar or a list) by dotted key, its `${...}` interpolations resolved by OmegaConf;
    a value whose interpolation does not resolve here (a resolver, a key set at run time) is left out."""
    from omegaconf import MISSING, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    leaves = {}
    _leaves(data, "", leaves)
    try:
        config = OmegaConf.create(data)
    except (OmegaConfBaseException, ValueError, TypeError):
        return {key: value for key, value in leaves.items() if not _interpolated(value)}
    resolved = {}
    for key, raw in leaves.items():
        if raw == MISSING:
            continue
        if not _interpolated(raw):
            resolved[key] = raw
            continue
        try:
            value = OmegaConf.select(config, key, throw_on_missing=False)
            if OmegaConf.is_config(value):
                value = OmegaConf.to_container(value, resolve=True)
        except (OmegaConfBaseException, ValueError, TypeError, KeyError):
            continue
        if value is not None:
            resolved[key] = value
    return resolved


def _leaves(node, prefix: str, found: dict) -> None:
    for key, value in node.items():
        dotted = prefix + str(key)
        if isinstance(value, dict):
            _leaves(value, dotted + ".", found)
        else:
            found[dotted] = value


def _interpolated(value) -> bool:
    if isinstance(value, list):
        return any(_interpolated(item) for item in value)
    if isinstance(value, dict):
        return any(_interpolated(item) for item in value.values())
    return isinstance(value, str) and "${" in value


def _relative(root: Path, path: Path) -> str:
    path = path.resolve()
    root = root.resolve()
    return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)


def _first(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
