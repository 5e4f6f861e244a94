"""[tool.rankaudit] in the nearest pyproject.toml above a model file -> the settings for that file."""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass
from pathlib import Path

from rankaudit.errors import UsageError
from rankaudit.settings import files
from rankaudit.settings.levels import FAIL_ON_CHOICES
from rankaudit.settings.limits import MAX_COUNT, MAX_GIB, MAX_SECONDS, PSNR_TARGET_DB, shown, too_large

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

TOP_KEYS = {
    "fail-on",
    "min-ra",
    "max-recoverable",
    "exposed-below",
    "psnr-target",
    "certificate-quantile",
    "batch-size",
    "shared-layers",
    "withheld-layers",
    "models",
    "dp",
    "round",
    "model",
    "model-args",
    "input-shape",
    "flower",
    "timeout",
    "memory-limit",
    "stand-ins",
    "guard",
}
MODEL_KEYS = {"path", "input-shape", "model-args"}

# Round settings and the run-config keys apps conventionally give them ([tool.rankaudit.flower] adds others).
CONVENTIONAL_KEYS = {
    "local-epochs": ("local-epochs", "local_epochs", "epochs", "num_epochs"),
    "batch-size": ("batch-size", "batch_size"),
    "lr": ("lr", "learning-rate", "learning_rate"),
    "momentum": ("momentum",),
    "server-rounds": ("num-server-rounds", "num_server_rounds", "num-rounds", "num_rounds", "n_server_rounds"),
    "fraction": ("fraction-train", "fraction-fit"),
    "local-samples": (),
    "available-clients": (),
}


@dataclass
class Settings:
    """Values from the configuration; None where the file says nothing (then the CLI default applies)."""

    source: Path | None = None
    fail_on: str | None = None
    min_ra: int | None = None
    max_recoverable: float | None = None
    exposed_below: float | None = None
    psnr_target: float | None = None  # dB: the PSNR ceiling σ is chosen to keep (the Fisher floor)
    certificate_quantile: float | None = None
    batch_size: int | None = None
    shared_layers: list[str] | None = None
    withheld_layers: list[str] | None = None
    input_shape: tuple[int, ...] | None = None
    matched_model: str | None = None  # the [[tool.rankaudit.models]] path glob that applied
    dp: dict | None = None  # [tool.rankaudit.dp], checked, keyed as rankaudit.settings.dp_options.OPTION_RULES
    round: dict[str, object] | None = None  # [tool.rankaudit.round], keyed by Round field (round.build_round)
    # A deployed app's directory (rankaudit.deploy.app): its model, the factory's arguments, and the app's own names
    # for round settings ([tool.rankaudit.flower]: setting -> run-config key).
    model: str | None = None
    model_args: dict[str, object] | None = None
    flower: dict[str, str] | None = None
    dataset_size: int | None = None  # [tool.rankaudit.round] dataset-size: an app's data over its nodes
    timeout: float | None = None  # seconds for each of the model's import, build and trace (supervise.py)
    memory_limit: float | None = None  # GiB the model's process may take (supervise.py)
    stand_ins: list[str] | bool | None = None  # stand-ins: modules to add, or false for none (import_standins)
    guard: object | None = None  # [tool.rankaudit.guard]: the client-side guard's GuardSettings (guard_options.py)

    def in_force(self, name: str, value, on_command_line: bool):
        """The value a run uses: the flag where given on the command line, else this file's, else `value` (the
        flag's default)."""
        configured = getattr(self, name)
        return value if on_command_line or configured is None else configured


def find_pyproject(model_path: Path) -> Path | None:
    """The nearest pyproject.toml with a [tool.rankaudit] table, walking up from the model file (like ruff)."""
    for directory in [model_path.resolve().parent, *model_path.resolve().parent.parents]:
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            tool = read_toml(candidate).get("tool", {})
            if isinstance(tool, dict) and "rankaudit" in tool:
                return candidate
    return None


_parsed: dict[tuple, dict] = {}  # each file read once per run: its path, size and change time -> its tables


def read_toml(path: Path) -> dict:
    """A TOML file's tables, or a one-line UsageError naming the file (bad syntax, unreadable). A file read before
    in this run and unchanged since is not parsed again (finding the configuration, reading the settings and the
    app each ask for pyproject.toml); the caller gets its own copy."""
    import copy

    try:
        status = path.stat()
        key = (str(path.resolve()), status.st_size, status.st_mtime_ns, status.st_ino)
    except (OSError, RuntimeError):
        key = None
    if key in _parsed:
        return copy.deepcopy(_parsed[key])
    tables = _parse_toml(path)
    if key is not None:
        _parsed[key] = copy.deepcopy(tables)
    return tables


def _parse_toml(path: Path) -> dict:
    try:
        text = files.read_bytes(path, "TOML file").decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(
            f"{files.shown_path(path)} is not valid TOML: it is not UTF-8 text", "fix or replace that file"
        ) from None
    if _key_depth(text) > files.MAX_DEPTH:
        raise files.nests_too_deep(path)
    try:
        tables = files.bounded(_checked_toml, path, text, path)
    except files.ParseFailed as exc:
        raise UsageError(f"{files.shown_path(path)} is not valid TOML: {exc}", "fix the syntax of that file") from None
    return tables


def _key_depth(text: str) -> int:
    """The most parts a key or table header of a TOML text has: a dotted header of 100,000 parts takes tomllib
    minutes (its work grows with the square of the parts), so it is refused before parsing."""
    deepest = 0
    for line in text.splitlines():
        stripped = line.lstrip()
        key = stripped.split("]", 1)[0] if stripped.startswith("[") else stripped.split("=", 1)[0]
        deepest = max(deepest, key.count(".") + 1)
    return deepest


def _checked_toml(text: str, path: Path) -> dict:
    """The tables of a TOML text, its nesting within what the readers after it walk (a dotted header of 100,000
    parts parses, then defeats every recursive reader)."""
    tables = tomllib.loads(text)
    files.check_shape(tables, path)
    return tables


def parse_value(text: str) -> object:
    """One value as Flower's run config writes it (123, 0.1, true, "text"); a bare word stays a string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _bad(path: Path, key: str, expected: str):
    raise UsageError(f"{path}: [tool.rankaudit] {key} must be {expected}", f"correct `{key}` in {path}")


def _names(path: Path, key: str, value) -> list[str]:
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    _bad(path, key, 'a list of layer names, e.g. ["fc1", "fc2"]')


def _positive_int(path: Path, key: str, value, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        _bad(path, key, "an integer" + (f" >= {minimum}" if minimum is not None else ""))
    if too_large(value):
        _bad(path, key, f"at most {MAX_COUNT:,}, not {shown(value)}")
    return value


def _number(path: Path, key: str, value, low: float, high: float, expected: str, low_included: bool = False) -> float:
    """A number in (low, high] ([low, high] when low_included), else one line naming the key (a 400-digit integer
    included: it never reaches float())."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        _bad(path, key, expected)
    if not (low <= value <= high if low_included else low < value <= high):
        _bad(path, key, f"{expected}, up to {high:,.0f}, not {shown(value)}")
    return float(value)


def _shape(path: Path, key: str, value) -> tuple[int, ...]:
    from rankaudit.settings.model_spec import check_shape_size, parse_input_shape

    if (
        isinstance(value, list)
        and value
        and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in value)
    ):
        return check_shape_size(tuple(value), f"{key} in {path}")
    if isinstance(value, str):
        try:
            return parse_input_shape(value)
        except UsageError:
            pass
    _bad(path, key, "a list of positive integers per sample, e.g. [3, 32, 32]")


def load_settings(model_path: Path) -> Settings:
    pyproject = find_pyproject(model_path)
    if pyproject is None:
        return Settings()
    table = read_toml(pyproject)["tool"]["rankaudit"]
    if not isinstance(table, dict):
        _bad(pyproject, "table", "a table")
    unknown = sorted(set(table) - TOP_KEYS)
    if unknown:
        raise UsageError(
            f"{pyproject}: unknown key {', '.join(unknown)} in [tool.rankaudit]", "use " + ", ".join(sorted(TOP_KEYS))
        )
    settings = Settings(source=pyproject)
    if "fail-on" in table:
        if table["fail-on"] not in FAIL_ON_CHOICES:
            _bad(pyproject, "fail-on", "one of " + ", ".join(FAIL_ON_CHOICES))
        settings.fail_on = table["fail-on"]
    if "min-ra" in table:
        settings.min_ra = _positive_int(pyproject, "min-ra", table["min-ra"])
    if "max-recoverable" in table:
        value = table["max-recoverable"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            _bad(pyproject, "max-recoverable", "a fraction between 0 and 1, e.g. 0.5")
        settings.max_recoverable = float(value)
    if "exposed-below" in table:
        value = table["exposed-below"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            _bad(pyproject, "exposed-below", "a fraction between 0 and 1, e.g. 0.05")
        settings.exposed_below = float(value)
    if "psnr-target" in table:
        value = table["psnr-target"]
        low, high = PSNR_TARGET_DB
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            _bad(pyproject, "psnr-target", f"a PSNR in dB from {low:g} to {high:g}, e.g. 20")
        settings.psnr_target = float(value)
    if "certificate-quantile" in table:
        value = table["certificate-quantile"]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
            _bad(pyproject, "certificate-quantile", "a fraction strictly between 0 and 1, e.g. 0.9")
        settings.certificate_quantile = float(value)
    if "batch-size" in table:
        settings.batch_size = _positive_int(pyproject, "batch-size", table["batch-size"], minimum=1)
    if "shared-layers" in table:
        settings.shared_layers = _names(pyproject, "shared-layers", table["shared-layers"])
    if "withheld-layers" in table:
        settings.withheld_layers = _names(pyproject, "withheld-layers", table["withheld-layers"])
    if "timeout" in table:
        settings.timeout = _number(
            pyproject, "timeout", table["timeout"], 0, MAX_SECONDS, "a positive number of seconds, e.g. 300"
        )
    if "memory-limit" in table:
        settings.memory_limit = _number(
            pyproject, "memory-limit", table["memory-limit"], 0, MAX_GIB, "a number of GiB, e.g. 8 (0: no limit)", True
        )
    if "stand-ins" in table:
        value = table["stand-ins"]
        if value is not False and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            _bad(pyproject, "stand-ins", 'a list of module names, e.g. ["my_data_lib"], or false for none')
        settings.stand_ins = value
    if "dp" in table:
        settings.dp = _dp_table(pyproject, table["dp"])
    if "guard" in table:
        from rankaudit.settings.guard_options import guard_settings

        if not isinstance(table["guard"], dict):
            _bad(pyproject, "guard", "a table: [tool.rankaudit.guard]")
        settings.guard = guard_settings(table["guard"], where=f"{pyproject} [tool.rankaudit.guard]")
    if "round" in table:
        if isinstance(table["round"], dict) and "dataset-size" in table["round"]:
            table["round"] = dict(table["round"])
            settings.dataset_size = _positive_int(
                pyproject, "round.dataset-size", table["round"].pop("dataset-size"), minimum=1
            )
        settings.round = _round_table(pyproject, table["round"])
        batch = settings.round.pop("batch_size", None)
        if batch is not None and settings.batch_size not in (None, batch):
            raise UsageError(
                f"{pyproject}: batch-size is {settings.batch_size} in [tool.rankaudit] but {batch} in "
                "[tool.rankaudit.round]",
                "give batch-size once, in either table",
            )
        settings.batch_size = batch if batch is not None else settings.batch_size
    _deployment_keys(pyproject, table, settings)
    models = table.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        _bad(pyproject, "models", 'an array of tables: [[tool.rankaudit.models]] path = "…" input-shape = […]')
    relative = (
        model_path.resolve().relative_to(pyproject.parent).as_posix()
        if model_path.resolve().is_relative_to(pyproject.parent)
        else model_path.as_posix()
    )
    for entry in models:  # every entry is checked, so a typo surfaces whichever file is analysed
        unknown = sorted(set(entry) - MODEL_KEYS)
        if unknown or "path" not in entry or not isinstance(entry["path"], str):
            _bad(
                pyproject,
                "models",
                "tables with a `path` glob and an `input-shape`"
                + (f" (unknown key {', '.join(unknown)})" if unknown else ""),
            )
        shape = _shape(pyproject, "models.input-shape", entry["input-shape"]) if "input-shape" in entry else None
        arguments = entry.get("model-args")
        if arguments is not None and not (isinstance(arguments, dict) and all(map(str.isidentifier, arguments))):
            _bad(pyproject, "models.model-args", "a table of the model's keyword arguments, e.g. {channels = 16}")
        if settings.matched_model is None and fnmatch.fnmatch(relative, entry["path"]):  # first match wins
            settings.matched_model = entry["path"]
            settings.input_shape = shape if shape is not None else settings.input_shape
            settings.model_args = dict(arguments) if arguments is not None else settings.model_args
    return settings


def _deployment_keys(path: Path, table: dict, settings: Settings) -> None:
    """model, model-args, input-shape and [tool.rankaudit.flower]: what a deployed app's directory needs."""
    if "model" in table:
        if not isinstance(table["model"], str) or not table["model"].strip():
            _bad(path, "model", 'a model file relative to this file, e.g. "pkg/task.py:Net"')
        settings.model = table["model"].strip()
    if "model-args" in table:
        if not isinstance(table["model-args"], dict):
            _bad(
                path,
                "model-args",
                "a table of keyword arguments, e.g. {num_classes = 10} or "
                '{num_classes = "num-classes"} (a run-config key)',
            )
        settings.model_args = dict(table["model-args"])
    if "input-shape" in table:
        settings.input_shape = _shape(path, "input-shape", table["input-shape"])
    if "flower" in table:
        mapping = table["flower"]
        if not isinstance(mapping, dict) or not all(isinstance(v, str) for v in mapping.values()):
            _bad(path, "flower", 'a table naming run-config keys, e.g. [tool.rankaudit.flower] lr = "learning-rate"')
        unknown = sorted(set(mapping) - set(CONVENTIONAL_KEYS))
        if unknown:
            raise UsageError(
                f"{path}: unknown key {', '.join(unknown)} in [tool.rankaudit.flower]",
                "use " + ", ".join(CONVENTIONAL_KEYS),
            )
        settings.flower = dict(mapping)


def _dp_table(path: Path, table) -> dict:
    """[tool.rankaudit.dp]: the DP options under their flag names without --dp- (noise, sample-rate, prior, ...)."""
    from rankaudit.settings.dp_options import OPTION_RULES, check_option

    if not isinstance(table, dict):
        _bad(path, "dp", "a table: [tool.rankaudit.dp] noise = 1.0 ...")
    unknown = sorted(set(table) - set(OPTION_RULES))
    if unknown:
        raise UsageError(
            f"{path}: unknown key {', '.join(unknown)} in [tool.rankaudit.dp]", "use " + ", ".join(OPTION_RULES)
        )
    return {key: check_option(key, value, str(path)) for key, value in table.items()}


# ---- [tool.rankaudit.round]: the federated round (method.md: the round); ranges are checked by round.validate_round ----------


def _round_table(path: Path, table) -> dict[str, object]:
    """[tool.rankaudit.round] -> Round field values, each of the right type (a UsageError names the key)."""
    from rankaudit.settings.round import ROUND_KEYS

    if not isinstance(table, dict):
        raise UsageError(
            f"{path}: [tool.rankaudit] round must be a table",
            "write it as [tool.rankaudit.round] with local-samples, batch-size, local-epochs, ...",
        )
    unknown = sorted(set(table) - set(ROUND_KEYS))
    if unknown:
        raise UsageError(
            f"{path}: unknown key {', '.join(unknown)} in [tool.rankaudit.round]", "use " + ", ".join(ROUND_KEYS)
        )
    values: dict[str, object] = {}
    for key, value in table.items():
        field = ROUND_KEYS[key]
        if key in ("local-samples", "batch-size", "local-epochs", "clients", "server-rounds", "available-clients"):
            values[field] = _positive_int(path, f"round.{key}", value, minimum=1)
        elif key == "optimizer":
            if not isinstance(value, str):
                _bad(path, "round.optimizer", 'a string, e.g. "sgd" or "adam"')
            values[field] = value
        elif key == "bn-mode":
            if not isinstance(value, str):
                _bad(path, "round.bn-mode", 'a string, "train" or "eval"')
            values[field] = value
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or too_large(value):
                _bad(path, f"round.{key}", f"a number of at most {MAX_COUNT:,}, not {shown(value)}")
            values[field] = float(value)
    return values
