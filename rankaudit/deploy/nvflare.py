"""NVFlare job configs: the ExcludeVars result filter -> the layers a client withholds from what it sends."""

from __future__ import annotations

import json
from pathlib import Path

from rankaudit.deploy.static import Found

_CLIENT_CONFIGS = ("config_fed_client.json",)
_SKIPPED = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist"}


def client_configs(directory: Path) -> list[Path]:
    """NVFlare client job configs under `directory` (config/config_fed_client.json of each app)."""
    return sorted(
        path
        for name in _CLIENT_CONFIGS
        for path in directory.rglob(name)
        if not _SKIPPED & set(path.relative_to(directory).parts)
    )


def is_nvflare_job(directory: Path) -> bool:
    return bool(client_configs(directory))


def excluded_variables(directory: Path) -> list[Found]:
    """Each ExcludeVars filter in a client config: its `exclude_vars` (a list of state-dict keys or layer names;
    a string is NVFlare's regular expression over the keys), with the file it came from."""
    found = []
    for path in client_configs(directory):
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        relative = path.relative_to(directory).as_posix()
        for component in _filters(config):
            where = component.get("path") or component.get("name") or ""
            if where.rsplit(".", 1)[-1] == "ExcludeVars":
                value = (component.get("args") or {}).get("exclude_vars")
                if value:
                    found.append(Found("withheld", value, f"{relative} (ExcludeVars)"))
    return found


def _filters(node) -> list[dict]:
    """Every dict with a `path` or `name` anywhere in a config (task_result_filters, components, ...)."""
    if isinstance(node, list):
        return [item for child in node for item in _filters(child)]
    if isinstance(node, dict):
        own = [node] if isinstance(node.get("path") or node.get("name"), str) else []
        return own + [item for child in node.values() for item in _filters(child)]
    return []
