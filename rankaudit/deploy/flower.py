"""A Flower app's pyproject.toml: [tool.flwr.app] components and run config, federations, --run-config overrides."""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rankaudit.errors import UsageError
from rankaudit.settings.files import read_source
from rankaudit.settings.pyproject import read_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Where a run-config value came from, as the report names it.
APP_CONFIG = "[tool.flwr.app.config]"
RUN_CONFIG_FLAG = "--run-config"
# Flower's own pattern for one `key=value` pair of --run-config: a value is quoted or runs to the next space.
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


@dataclass
class FlowerApp:
    """What pyproject.toml says about the app; `config` is the flattened run config, each value with its source."""

    root: Path
    pyproject: Path
    clientapp: str | None = None  # "pkg.client_app:app"
    serverapp: str | None = None
    config: dict[str, tuple[object, str]] = field(default_factory=dict)
    num_supernodes: tuple[int, str] | None = None  # (nodes, source) of the default (or only) federation
    # The folder the components' modules are imported from: the app's own, or its source folder (a src layout).
    code_root: Path | None = None

    def module_file(self, reference: str | None) -> Path | None:
        """`pkg.client_app:app` -> code_root/pkg/client_app.py (or the package's __init__.py), when it exists."""
        if not reference:
            return None
        return _module_file(self.code_root or self.root, reference.split(":", 1)[0])


def _module_file(root: Path, module: str) -> Path | None:
    parts = module.split(".")
    for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
        if candidate.is_file():
            return candidate
    return None


def source_roots(directory: Path, project: dict) -> list[Path]:
    """Where an installed app's packages come from, as its build backend packs them: the app's folder, hatch's
    `packages = ["src/pkg"]` (the package's parent), setuptools' `package-dir = {"" = "src"}`, and the src layout's
    `src/` by convention. Only folders inside the app."""
    tool = project.get("tool", {}) if isinstance(project, dict) else {}
    hatch = tool.get("hatch", {}).get("build", {}).get("targets", {}).get("wheel", {}) if isinstance(tool, dict) else {}
    named = [
        str(Path(package).parent)
        for package in (hatch.get("packages") or [] if isinstance(hatch, dict) else [])
        if isinstance(package, str)
    ]
    setuptools = tool.get("setuptools", {}) if isinstance(tool, dict) else {}
    package_dir = setuptools.get("package-dir", {}) if isinstance(setuptools, dict) else {}
    if isinstance(package_dir, dict) and isinstance(package_dir.get(""), str):
        named.append(package_dir[""])
    roots = [directory]
    for folder in [*named, "src"]:
        candidate = (directory / folder).resolve()
        if candidate.is_dir() and candidate.is_relative_to(directory.resolve()) and candidate not in roots:
            roots.append(candidate)
    return roots


def is_flower_app(directory: Path) -> bool:
    pyproject = directory / "pyproject.toml"
    return pyproject.is_file() and "app" in read_toml(pyproject).get("tool", {}).get("flwr", {})


# What marks Python code as a Flower client or server where pyproject.toml has no [tool.flwr.app]: the older
# script style (start_numpy_client / start_client with a NumPyClient) and apps configured by other means.
_FLOWER_MARKS = (
    "start_numpy_client(",
    "start_client(",
    "NumPyClient",
    "ClientApp(",
    "start_simulation(",
    "start_server(",
)


def uses_flower(files: list[Path]) -> bool:
    for path in files:
        try:
            text = read_source(path)
        except UsageError:
            continue
        if ("flwr" in text or "flower" in text) and any(mark in text for mark in _FLOWER_MARKS):
            return True
    return False


def configuration_nodes() -> tuple[int, str] | None:
    """options.num-supernodes of the default SuperLink connection in the Flower configuration file
    ($FLWR_HOME/config.toml, else ~/.flwr/config.toml), where Flower 1.26 and later keep the federations."""
    import os

    home = Path(os.environ.get("FLWR_HOME") or Path.home() / ".flwr")
    path = home / "config.toml"
    if not path.is_file():
        return None
    try:
        superlink = read_toml(path).get("superlink", {})
    except UsageError:
        return None
    name = superlink.get("default") if isinstance(superlink, dict) else None
    table = superlink.get(name) if isinstance(name, str) else None
    options = table.get("options") if isinstance(table, dict) else None
    nodes = options.get("num-supernodes") if isinstance(options, dict) else None
    if isinstance(nodes, int) and not isinstance(nodes, bool):
        return nodes, f"{path} [superlink.{name}] options.num-supernodes"
    return None


def flatten(table: dict, prefix: str = "") -> dict[str, object]:
    """Nested run-config tables become dotted keys, as Flower flattens them (`a.b = 1`)."""
    flat: dict[str, object] = {}
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            flat.update(flatten(value, name))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            raise UsageError(
                f"run-config value {name} = {value!r} is not a bool, int, float or string",
                "Flower's run config holds only those (and tables of them)",
            )
    return flat


def parse_run_config(text: str | None) -> dict[str, object]:
    """`--run-config "k=v k2=v2"` as `flwr run` parses it: each value is a TOML value (123, 0.1, true, "text");
    or the path of a .toml file of overrides."""
    if not text or not text.strip():
        return {}
    if text.strip().endswith(".toml"):
        path = Path(text.strip()).expanduser()
        if not path.is_file():
            raise UsageError(f"--run-config file {text!r} does not exist", "give the path of a TOML file of overrides")
        return flatten(read_toml(path))
    pairs = _PAIR.findall(text)
    if not pairs:
        raise UsageError(f"--run-config {text!r} holds no key=value pair", 'write e.g. --run-config "local-epochs=3"')
    try:
        return flatten(tomllib.loads("\n".join(f"{key} = {value}" for key, value in pairs)))
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(
            f"--run-config {text!r} is not in Flower's format ({exc})",
            "write space-separated pairs such as 'key1=123 key2=false key3=\"string\"'",
        ) from exc


def read_app(directory: Path, run_config: str | None = None) -> FlowerApp:
    """The app in `directory`: components, run config (with --run-config fused over it, as Flower fuses), nodes."""
    pyproject = directory / "pyproject.toml"
    project = read_toml(pyproject)
    flwr = project.get("tool", {}).get("flwr", {})
    app_table = flwr.get("app", {})
    components, code_root = _components(pyproject, app_table, source_roots(directory.resolve(), project))
    app = FlowerApp(
        root=directory.resolve(),
        pyproject=pyproject,
        clientapp=components.get("clientapp"),
        serverapp=components.get("serverapp"),
        code_root=code_root,
    )
    app.config = {key: (value, APP_CONFIG) for key, value in flatten(app_table.get("config", {})).items()}
    for key, value in parse_run_config(run_config).items():
        if key not in app.config:  # Flower refuses an override of a key the app does not declare
            known = ", ".join(sorted(app.config)) or "none"
            raise UsageError(
                f"--run-config key {key!r} is not in the app's {APP_CONFIG} (keys: {known})",
                "override only keys the app declares, as `flwr run` requires",
            )
        app.config[key] = (value, RUN_CONFIG_FLAG)
    app.num_supernodes = _num_supernodes(flwr.get("federations", {})) or configuration_nodes()
    return app


# Flower's component reference: a dotted module path, a colon, a dotted attribute path (`pkg.client_app:app`).
_REFERENCE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _components(pyproject: Path, app_table, roots: list[Path]) -> tuple[dict[str, str], Path]:
    """[tool.flwr.app.components]: a table whose serverapp and clientapp are references `flwr run` can load, the
    client's module inside the app (it builds the model), and the source root it is found under. Else one line
    naming what is wrong."""
    components = app_table.get("components") if isinstance(app_table, dict) else None
    if not isinstance(components, dict) or not components.get("clientapp"):
        raise UsageError(
            f"{pyproject}: the Flower app has no [tool.flwr.app.components] table with a clientapp",
            'add it as `flwr new` writes it: serverapp = "PKG.server_app:app", clientapp = "PKG.client_app:app"',
        )
    for role in ("serverapp", "clientapp"):
        reference = components.get(role)
        if reference is not None and not (isinstance(reference, str) and _REFERENCE.match(reference)):
            raise UsageError(
                f"{pyproject}: [tool.flwr.app.components] {role} = {reference!r} is not a MODULE:ATTRIBUTE reference",
                f'write it as Flower loads it, e.g. {role} = "PKG.{role[:-3]}_app:app"',
            )
    module = components["clientapp"].split(":", 1)[0]
    found = next((root for root in roots if _module_file(root, module) is not None), None)
    if found is None:
        places = " or ".join(f"{root.relative_to(roots[0]).as_posix()}/" for root in roots[1:])
        raise UsageError(
            f"{pyproject}: [tool.flwr.app.components] clientapp names the module {module}, which is not in the app "
            f"({module.replace('.', '/')}.py does not exist{' there or under ' + places if places else ''})",
            "name the module that defines the ClientApp as it is imported once the app is installed",
        )
    return components, found


def _num_supernodes(federations: dict) -> tuple[int, str] | None:
    """options.num-supernodes of the default federation, else of the only federation that states it."""
    if not isinstance(federations, dict):
        return None
    stated = {
        name: table["options"]["num-supernodes"]
        for name, table in federations.items()
        if isinstance(table, dict)
        and isinstance(table.get("options"), dict)
        and isinstance(table["options"].get("num-supernodes"), int)
    }
    default = federations.get("default")
    name = default if default in stated else (next(iter(stated)) if len(stated) == 1 else None)
    if name is None:
        return None
    return stated[name], f"[tool.flwr.federations.{name}] options.num-supernodes"
