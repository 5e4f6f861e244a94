"""An app's YAML configuration (Hydra's conf/config.yaml and the like): nested `key: value` maps, read without
PyYAML into dotted keys, each with its file."""

from __future__ import annotations

import json
from pathlib import Path

_CONFIG_NAMES = ("conf/config.yaml", "config/config.yaml", "conf/base.yaml", "config.yaml", "conf/config.yml")


def _scalar(text: str):
    text = text.strip()
    if not text or text in ("~", "null", "None"):
        return None
    if text[0] in "\"'" and text[-1] == text[0]:
        return text[1:-1]
    lowered = text.lower()
    if lowered in ("true", "yes", "on"):
        return True
    if lowered in ("false", "no", "off"):
        return False
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    if text.startswith("[") and text.endswith("]"):
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return text
    return text


def read_yaml(path: Path) -> dict[str, tuple[object, int]]:
    """Dotted key -> (scalar value, line) for every `key: value` of a block-style YAML file; lists, anchors and
    multi-line strings are left out (a key this reader cannot read is not reported as read)."""
    found: dict[str, tuple[object, int]] = {}
    stack: list[tuple[int, str]] = []  # (indent, key) of the maps above the current line
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split(" #", 1)[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line.strip() or line.strip().startswith("-") or line.strip() in ("---", "..."):
            continue
        indent = len(line) - len(line.lstrip())
        key, separator, rest = line.strip().partition(":")
        if not separator or " " in key.strip():
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        dotted = ".".join([name for _, name in stack] + [key.strip()])
        if rest.strip() and not rest.strip().startswith(("&", "*", "|", ">")):
            found[dotted] = (_scalar(rest), number)
        elif not rest.strip():
            stack.append((indent, key.strip()))
    return found


def app_yaml(directory: Path) -> dict[str, tuple[object, str]]:
    """The app's main YAML config as run-config-like entries: dotted key -> (value, 'conf/config.yaml:LINE')."""
    for name in _CONFIG_NAMES:
        path = directory / name
        if path.is_file():
            try:
                entries = read_yaml(path)
            except (OSError, UnicodeDecodeError):
                return {}
            return {key: (value, f"{name}:{line}") for key, (value, line) in entries.items() if value is not None}
    return {}
