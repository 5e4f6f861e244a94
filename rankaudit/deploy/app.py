"""A deployed app (Flower, Opacus, NVFlare) -> one Round with its DP settings and the model spec, each with its source."""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from rankaudit.deploy import flower, model_checks, model_code, nvflare, per_client, static, yamlconf
from rankaudit.deploy.found import Found
from rankaudit.deploy.privacy import DP_TABLE as DP_TABLE
from rankaudit.deploy.privacy import ROUND_TABLE, privacy_settings
from rankaudit.deploy.privacy import noise_for_epsilon as noise_for_epsilon
from rankaudit.deploy.syntax import syntax_of
from rankaudit.deploy.withheld import withheld_layers
from rankaudit.errors import UsageError
from rankaudit.settings.files import read_source
from rankaudit.settings.pyproject import CONVENTIONAL_KEYS, parse_value
from rankaudit.settings.round import ROUND_KEYS

_INTEGERS = ("local-samples", "batch-size", "local-epochs", "clients", "server-rounds", "available-clients")
# Round settings whose default is shown with its source when the app states none (the others stay silent: one
# client, no momentum, one available client are what the app says by stating nothing).
_SHOWN_DEFAULTS = {"batch-size": 1, "local-epochs": 1, "lr": 0.1, "optimizer": "sgd"}
_FLOWER_MIN_CLIENTS = 2  # FedAvg's min_fit_clients / min_train_nodes default


@dataclass(frozen=True)
class Overrides:
    """What the command line says; None or empty where it says nothing."""

    round: dict[str, object] = field(default_factory=dict)  # Round field -> value (flags given)
    dp: dict[str, object] = field(default_factory=dict)  # OPTION_RULES key -> value (flags given)
    run_config: str | None = None  # --run-config "k=v k2=v2"
    model_args: tuple[str, ...] = ()  # --model-arg KEY=VALUE
    input_shape_given: bool = False


@dataclass
class Deployment:
    """The one value the deployment reader hands on: the round (with DP), the model, and where each came from."""

    kind: str  # flower | nvflare
    root: Path
    model: str  # PATH:NAME, PATH absolute
    round: object  # round.Round, its dp set
    model_args: dict[str, object] = field(default_factory=dict)
    withheld_layers: list[str] | None = None
    settings: list[tuple[str, str, str]] = field(default_factory=list)  # (setting, value, source)
    notes: list[str] = field(default_factory=list)


def read_deployment(path: Path, overrides: Overrides | None = None) -> Deployment:
    """Read the app in directory `path`: [tool.flwr.app] (and --run-config), the code, [tool.rankaudit.*];
    flags win over [tool.rankaudit.*], which wins over what is read."""
    from rankaudit.settings.pyproject import load_settings
    from rankaudit.settings.round import build_round

    overrides = overrides or Overrides()
    directory = path.resolve()
    job, yaml_notes = None, []
    if flower.is_flower_app(directory):
        app = flower.read_app(directory, overrides.run_config)
        kind, config = "flower", app.config
    elif nvflare.is_nvflare_job(directory):
        app, kind, config, yaml_notes = None, "nvflare", *_yaml(directory)
        job = nvflare.read_job(directory)
    elif flower.uses_flower(_python_files(directory)):
        app, kind, config, yaml_notes = None, "flower", *_yaml(directory)  # script style, Hydra or YAML config
    else:
        raise UsageError(
            f"'{path}' is a directory but neither a Flower app (pyproject.toml with [tool.flwr.app], or code "
            "that starts a Flower client) nor an NVFlare job (config_fed_client.json, or a job.py with a Recipe "
            "or FedJob)",
            "give a model file (MODEL.py[:NAME]) or the app's directory",
        )
    if app is None and overrides.run_config:
        raise UsageError(
            "--run-config overrides the run config of a Flower app with [tool.flwr.app], which this app has not",
            "drop --run-config; set values in [tool.rankaudit.round] or with the round flags",
        )
    settings = load_settings(directory / "pyproject.toml")
    sources = _Sources()
    sources.notes.extend(yaml_notes)
    files = _code_files(directory, app)
    try:
        model, imported, instantiated = _model(directory, app, settings, job, files, config)
    except UsageError:
        model_checks.pytorch_only(directory, files)
        raise
    model_checks.pytorch_only(directory, [Path(model.rsplit(":", 1)[0] if model.count(":") else model)])
    sources.notes.extend(model_checks.outside_forward_notes(directory, model, files))
    sources.add("model", _relative(directory, model), _model_source(imported, kind, instantiated))
    stated = {*(settings.model_args or {}), *(text.partition("=")[0].strip() for text in overrides.model_args)}
    instantiated, per_client_notes = per_client.deepest(directory, files, config, instantiated, stated)
    sources.notes.extend(per_client_notes)
    model_args = _model_args(settings, overrides, config, sources, instantiated)
    entries = [app.module_file(ref) for ref in (app.clientapp, app.serverapp)] if app is not None else None
    found, mechanisms = static.read_code(
        files,
        directory,
        config,
        job.scripts if job else {},
        entries=[entry for entry in entries if entry is not None] if entries else None,
        component_args=job.components if job else None,
        whole=job is not None,
    )
    found = _config_strategy(config) + found
    if job is not None:
        found = job.found + found
        sources.notes.extend(job.notes)
    read = _read_round(config, found, settings.flower or {}, app)
    values = _merge_round(read, settings, overrides, sources)
    _secure_aggregation(mechanisms, read, values, sources, settings, overrides)
    _clients_read(mechanisms, read, values, sources, encrypted=job is not None and job.encrypted)
    round_ = build_round(values, None)  # validated: a UsageError names the setting
    sampled = _sampled_clients(read, [])
    with_sampled = {**read, "sampled-clients": sampled} if sampled is not None else read
    dp, notes = privacy_settings(mechanisms, with_sampled, round_, settings, overrides, sources)
    round_ = replace(round_, dp=dp)
    withheld = withheld_layers(directory, mechanisms, settings, sources, model)
    _require(directory, model, settings, overrides, round_, read)
    return Deployment(
        kind=kind,
        root=directory,
        model=model,
        round=round_,
        model_args=model_args,
        withheld_layers=withheld,
        settings=sources.rows,
        notes=notes + sources.notes,
    )


def _yaml(directory: Path) -> tuple[dict[str, tuple[object, str]], list[str]]:
    read = yamlconf.app_yaml(directory)
    return read.entries, read.notes


class _Sources:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []
        self.notes: list[str] = []

    def add(self, setting: str, value, source: str):
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        self.rows.append((setting, shown, source))


# ---- the model -----------------------------------------------------------------------------------------------------


def _model(
    directory: Path, app, settings, job, files, config
) -> tuple[str, list[str], model_code.Instantiation | None]:
    """[tool.rankaudit] model, else the model the job names, else the class a Hydra config's `_target_` names,
    else the one the client's code instantiates among the nn.Module classes (and model factories) the client app's
    module imports from the app."""
    if settings.model:
        path_text, _, name = settings.model.partition(":")
        base = settings.source.parent if settings.source is not None else directory  # relative to its pyproject
        path = base / path_text
        if not path.is_file():
            raise UsageError(
                f"[tool.rankaudit] model = {settings.model!r}: {path} does not exist",
                f'give the model file relative to {base}, e.g. model = "pkg/task.py:Net"',
            )
        return _shown(f"{path}:{name}" if name else str(path)), [], None
    where = f"[tool.rankaudit] of {directory / 'pyproject.toml'}"
    candidates, callables = _candidates(directory, app)
    if job is not None and job.model is not None:
        named, arguments, source = job.model
        module, _, cls = named.rpartition(".")
        matches = [
            spec
            for spec in callables
            if spec.rsplit(":", 1)[1] == cls
            and (not module or Path(spec.rsplit(":", 1)[0]).stem == module.split(".")[-1])
        ]
        if len(matches) > 1 and module:  # `src.net.Net`: the file at src/net.py, not another net.py
            dotted = module.split(".")
            matches = [spec for spec in matches if _module_parts(directory, spec)[-len(dotted) :] == dotted]
        if len(matches) == 1:
            return _shown(matches[0]), [matches[0]], model_code.Instantiation(cls, arguments, source)
    targeted = _config_target(config, callables)
    if targeted is not None:
        return targeted
    client = app.module_file(app.clientapp) if app is not None else None
    trained_in = [client] if client is not None else list(job.scripts) if job is not None and job.scripts else files
    # Read against the app's whole config (a Hydra one too): `if cfg.model_name == "cnn": CNN(...)` takes the
    # branch the config picks, with the arguments that call passes.
    chosen = model_code.instantiated(
        trained_in,
        [spec.rsplit(":", 1)[1] for spec in callables],
        directory,
        config,
        whole=job is not None or client is not None,
    )
    if all(None in made.positional or None in made.arguments.values() for made in chosen):
        # Nothing built with what it is given read (a factory handed the config): the key naming the model decides.
        model_code.refuse_unmatched_model_name(directory, config, files, [s.rsplit(":", 1)[1] for s in callables])
    if len(chosen) == 1:
        made = chosen[0]
        matches = [spec for spec in callables if spec.rsplit(":", 1)[1] == made.name]
        if len(matches) == 1:
            return _shown(matches[0]), [matches[0]], made.with_names(Path(matches[0].rsplit(":", 1)[0]))
    # The code does not say which one is built: a config key that names a class (through a model manager).
    named = _config_model_name(directory, config, files)
    if named is not None:
        return named
    if len(chosen) > 1:
        shown = ", ".join(f"{made.name}() at {made.source}" for made in chosen)
        raise UsageError(
            f"the app builds several models ({shown})",
            f'choose the one that is trained: model = "pkg/task.py:NAME" in {where}',
        )
    if len(candidates) == 1:
        return _shown(candidates[0]), [candidates[0]], None
    if not candidates:
        raise UsageError(
            f"found no nn.Module class in the app that the client app imports ({directory})",
            f'name the model: model = "pkg/task.py:Net" (a class or a factory) in {where}',
        )
    shown = ", ".join(_relative(directory, spec) for spec in candidates)
    raise UsageError(f"the app has several model candidates ({shown})", f'choose one: model = "..." in {where}')


def _config_model_name(directory: Path, config, files: list[Path]):
    """The model a config key names (`model-name = "cnncifar10"`, picked through a model manager in code): the
    one nn.Module class of the app's code whose name is that value, letter case and `-`/`_` aside; None unless
    exactly one class (identical copies aside) is named so."""

    for key, (value, source) in config.items():
        if key.rsplit(".", 1)[-1] not in model_code.MODEL_NAME_KEYS or not isinstance(value, str) or not value.strip():
            continue
        named, seen = [], set()
        for path in files:
            try:
                text = read_source(path)
                classes = model_code.module_classes(syntax_of(path).tree)
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            if text in seen:
                continue
            seen.add(text)
            named += [
                f"{path}:{name}" for name in classes if model_code.plain_name(name) == model_code.plain_name(value)
            ]
        if len(named) == 1:
            name = named[0].rsplit(":", 1)[1]
            made = model_code.Instantiation(name, {}, f"{source} {key} = {value!r}")
            return _shown(named[0]), [named[0]], made
    return None


def _config_target(config, callables: list[str]):
    """The model a YAML config names with Hydra's `_target_: pkg.models.CNN` (what `instantiate(cfg.model)`
    builds), with the node's other keys as its arguments; None unless exactly one class or factory of the app
    is named so."""
    named: dict[str, tuple[str, str, str]] = {}  # spec -> (config node, dotted target, source)
    for key, (target, source) in config.items():
        if key.rsplit(".", 1)[-1] != "_target_" or not isinstance(target, str):
            continue
        module, _, name = target.rpartition(".")
        for spec in callables:
            path, _, defined = spec.rpartition(":")
            if defined == name and (not module or Path(path).stem == module.split(".")[-1]):
                named.setdefault(spec, (key[: -len("_target_")], target, source))
    if len(named) != 1:
        return None
    spec, (node, target, source) = next(iter(named.items()))
    arguments = {
        key[len(node) :]: Found(key[len(node) :], value, f"{where} {key}")
        for key, (value, where) in config.items()
        if key.startswith(node) and "." not in key[len(node) :] and not key[len(node) :].startswith("_")
    }
    made = model_code.Instantiation(spec.rsplit(":", 1)[1], arguments, f"{source} _target_: {target}")
    return _shown(spec), [spec], made


def _module_parts(directory: Path, spec: str) -> list[str]:
    """A model file's dotted module path from the app's folder: job/src/net.py:Net -> ["src", "net"]."""
    path = Path(spec.rsplit(":", 1)[0]).resolve()
    return list(path.relative_to(directory).with_suffix("").parts) if path.is_relative_to(directory) else [path.stem]


def _shown(spec: str) -> str:
    """The model spec with its path relative to the working directory, as the user would type it."""
    path, _, name = spec.rpartition(":") if spec.count(":") else (spec, "", "")
    return os.path.relpath(path) + (f":{name}" if name else "")


def _candidates(directory: Path, app) -> tuple[list[str], list[str]]:
    """The nn.Module classes the client app imports from the app (else its factories named get_model and the
    like), and every class or function it imports: what its training code may instantiate."""
    if app is not None and app.module_file(app.clientapp) is not None:
        client = app.module_file(app.clientapp)
        imports = [(client, None), *model_code.imported_modules(client, app.code_root or directory)]
    else:
        imports = [(path, None) for path in _python_files(directory)]
    candidates: dict[str, None] = {}
    factories: dict[str, None] = {}  # only when no class is a candidate: get_model(...) and the like
    callables: dict[str, None] = {}
    seen: set[str] = set()
    for path, names in imports:
        try:
            text = read_source(path)
            if names is None and text in seen:  # a byte-identical copy (an NVFlare job's per-site custom/): one model
                continue
            seen.add(text)
            tree = syntax_of(path).tree
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue
        for name in model_code.module_classes(tree):
            if names is None or name in names:
                candidates[f"{path}:{name}"] = None
                callables[f"{path}:{name}"] = None
        for name in model_code.model_factories(tree):
            if names is not None and name in names:
                factories[f"{path}:{name}"] = None
        for name in model_code.model_builders(tree):
            if names is None or name in names:
                callables[f"{path}:{name}"] = None
    return list(candidates or factories), list(callables)


def _model_source(imported: list[str], kind: str, instantiated) -> str:
    if not imported:
        return "[tool.rankaudit] model"
    if instantiated is not None:
        return f"{instantiated.name}(...) at {instantiated.source}, the model the app trains"
    return "the one model candidate " + ("the client app imports" if kind == "flower" else "in the job")


def _relative(directory: Path, spec: str) -> str:
    path, _, name = spec.rpartition(":") if spec.count(":") else (spec, "", "")
    path = Path(path).resolve()
    shown = path.relative_to(directory).as_posix() if path.is_relative_to(directory) else str(path)
    return f"{shown}:{name}" if name else shown


def _model_args(settings, overrides: Overrides, config, sources: _Sources, instantiated=None) -> dict[str, object]:
    """The arguments the app builds the model with, then model-args in [tool.rankaudit], then --model-arg
    KEY=VALUE over them; a value naming a run-config key (`num-classes`) takes that key's value."""
    read = instantiated.arguments if instantiated is not None else {}
    given: dict[str, tuple[object, str]] = {
        key: (found.value, found.source) for key, found in read.items() if found is not None
    }
    given.update({key: (value, "[tool.rankaudit] model-args") for key, value in (settings.model_args or {}).items()})
    for text in overrides.model_args:
        key, sep, value = text.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageError(
                f"--model-arg {text!r} is not KEY=VALUE",
                "write e.g. --model-arg num_classes=10 (or num_classes=num-classes, a run-config key)",
            )
        given[key.strip()] = (parse_value(value.strip()), "--model-arg")
    resolved = {}
    for key, (value, source) in given.items():
        if isinstance(value, str) and value in config and source in ("--model-arg", "[tool.rankaudit] model-args"):
            value, where = config[value][0], f"{source}, {config[value][1]} {value}"
        else:
            where = source
        resolved[key] = value
        sources.add(f"model-arg {key}", value, where)
    return resolved


# ---- the round -------------------------------------------------------------------------------------------------


def _code_files(directory: Path, app) -> list[Path]:
    """The app's packages (those of the client and server components), else every Python file of the job."""
    if app is not None:
        packages = {ref.split(":")[0].split(".")[0] for ref in (app.clientapp, app.serverapp) if ref}
        root = app.code_root or directory  # a src layout's packages sit under src/
        files = [
            path
            for package in sorted(packages)
            for path in sorted((root / package).rglob("*.py"))
            if (root / package).is_dir()
        ]
        files += [root / f"{package}.py" for package in sorted(packages) if (root / f"{package}.py").is_file()]
        # Modules of the app the packages import from elsewhere in it (a sibling package of privacy wrappers).
        for path in list(files):
            try:
                imported = model_code.imported_modules(path, root)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            files += [module for module, _ in imported if module not in files]
        if files:
            return files
    return _python_files(directory)


def _python_files(directory: Path) -> list[Path]:
    skipped = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", "tests"}
    return sorted(path for path in directory.rglob("*.py") if not skipped & set(path.relative_to(directory).parts))


def _check_keys(config, setting: str, names, mapped: bool) -> None:
    """A run-config key a round setting is read from must hold a value: one [tool.rankaudit.flower] maps must exist,
    and one that is a table (`local-epochs = {a = 1}`) is no number of epochs."""
    for name in names:
        inside = sorted(key for key in config if key.startswith(f"{name}."))
        if name not in config and inside:
            raise UsageError(
                f"the app's run-config key {name} is a table ({', '.join(inside)}), not the value of {setting}",
                f"give {name} a single value in the app's configuration",
            )
    if mapped and not any(name in config or any(key.rsplit(".", 1)[-1] == name for key in config) for name in names):
        known = ", ".join(sorted(config)) or "none"
        raise UsageError(
            f"[tool.rankaudit.flower] {setting} names the run-config key {names[0]!r}, which the app's "
            f"configuration does not have (keys: {known})",
            f"name one of those keys, or drop {setting} from [tool.rankaudit.flower]",
        )


def _read_round(config, found: list[Found], mapping: dict[str, str], app) -> dict[str, Found]:
    """Each round setting the app states: its run config first (conventional keys, or the key
    [tool.rankaudit.flower] maps), then literals in the code; the federation's nodes as available clients."""
    read: dict[str, Found] = {}
    for setting, keys in CONVENTIONAL_KEYS.items():
        names = (mapping[setting],) if setting in mapping else keys
        _check_keys(config, setting, names, mapped=setting in mapping)
        for name in names:
            # A nested table's key ([tool.flwr.app.config.algorithm] local-epochs -> algorithm.local-epochs).
            nested = [key for key in config if key.rsplit(".", 1)[-1] == name and _fits(setting, config[key][0])]
            # The training split's value of a per-split table (HeteroFL's `batch_size: {train: 10, test: 50}`).
            split = [key for key in config if key.split(".")[-2:] == [name, "train"] and _fits(setting, config[key][0])]
            if name not in config and len(nested) == 1:
                name = nested[0]
            elif name not in config and not nested and len(split) == 1:
                name = split[0]
            if name in config:
                value, source = config[name]
                read[setting] = Found(
                    setting,
                    value,
                    f"{source} {name}={value}" if source == flower.RUN_CONFIG_FLAG else f"{source} {name}",
                )
                break
    for item in found:
        read.setdefault(item.key, item)
    if "momentum" in read and read.get("optimizer", Found("", "sgd", "")).value != "sgd":
        # A run-config momentum key feeds the SGD branch; the Adam the app picks takes none.
        del read["momentum"]
    if "available-clients" not in read and app is not None and app.num_supernodes is not None:
        nodes, source = app.num_supernodes
        read["available-clients"] = Found("available-clients", nodes, source)
    return read


_STRATEGY_KEYS = {
    "fraction_fit": "fraction",
    "fraction_train": "fraction",
    "min_fit_clients": "min-clients",
    "min_train_nodes": "min-clients",
}


def _config_strategy(config) -> list[Found]:
    """A Flower strategy a config builds with Hydra's `_target_: flwr.server.strategy.FedAvg`, or the app's own
    strategy class (DepthFL's `depthfl.strategy.FedDyn`) given FedAvg's sampling keys: its client sampling
    (fraction_fit, min_fit_clients), as the code's own FedAvg(...) call would give it."""
    found = []
    for key, (target, _) in config.items():
        node = key[: -len("_target_")]
        if key.rsplit(".", 1)[-1] != "_target_" or not (
            str(target).startswith("flwr.server.strategy.") or any(node + name in config for name in _STRATEGY_KEYS)
        ):
            continue
        for name, setting in _STRATEGY_KEYS.items():
            if node + name in config:
                value, source = config[node + name]
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    found.append(Found(setting, value, f"{source} {node + name}"))
    return found


def _merge_round(read: dict[str, Found], settings, overrides: Overrides, sources: _Sources) -> dict[str, object]:
    """Round field values: flags, then [tool.rankaudit.round] (and its batch-size), then what was read."""
    table = dict(settings.round or {})
    if settings.batch_size is not None:
        table.setdefault("batch_size", settings.batch_size)
    nodes = read.get("available-clients")
    if settings.dataset_size is not None and "local-samples" not in read and nodes is not None:
        # The smallest partition of an even split: fewer samples per client is the weaker case.
        read = {
            **read,
            "local-samples": Found(
                "local-samples",
                settings.dataset_size // nodes.value,
                f"dataset-size {settings.dataset_size} ({ROUND_TABLE}) over "
                f"{nodes.value} nodes ({nodes.source}), the smallest partition",
            ),
        }
    choice = read.get("optimizer-choice")
    if choice is not None and overrides.round.get("optimizer") is None and table.get("optimizer") is None:
        raise UsageError(
            f"the optimizer is chosen when the app runs: {choice.value}",
            f"set that key in the app's configuration, or optimizer, lr and momentum in {ROUND_TABLE}",
        )
    unread = read.get("momentum-unread")
    if unread is not None and "momentum" not in read and overrides.round.get("momentum") is None:
        if table.get("momentum") is None and read.get("optimizer", Found("", "sgd", "")).value == "sgd":
            sources.notes.append(
                f"the SGD momentum is set to {unread.value}, which is not read: the round is judged with momentum 0; "
                f"set momentum in {ROUND_TABLE} (or --momentum) to the app's value"
            )
    values: dict[str, object] = {}
    unread: list[str] = []
    for setting, name in ROUND_KEYS.items():
        if overrides.round.get(name) is not None:
            value, source = overrides.round[name], f"--{setting}"
        elif table.get(name) is not None:
            value, source = table[name], ROUND_TABLE
        elif setting in read and setting != "available-clients":  # nodes count only with secure aggregation
            value, source = read[setting].value, read[setting].source
            value = _typed(setting, value, source)
        elif setting in _VERDICT_SETTINGS:
            unread.append(setting)
            continue
        elif setting in _SHOWN_DEFAULTS:  # every setting the round uses has a source, a default too
            # Not read is not "not in the app": the app may set it where rankaudit cannot read it. These ones the
            # bound does not depend on (the verifiers' training does).
            sources.add(setting, _SHOWN_DEFAULTS[setting], f"not read from the app; set {setting} in {ROUND_TABLE}")
            continue
        else:
            continue
        values[name] = value
        sources.add(setting, value, source)
    if unread:
        many = len(unread) > 1
        raise UsageError(
            f"{' and '.join(unread)} {'are' if many else 'is'} not read from the app, and the bound depends on "
            f"{'them' if many else 'it'}: no value is safe to assume (more local steps and more server rounds "
            "expose more, and DP composes over the rounds; a larger batch couples more samples through its "
            "statistics)",
            "set "
            + " and ".join(f"{setting} = {_LETTER[setting]}" for setting in unread)
            + f" in {ROUND_TABLE} (or "
            + ", ".join(f"--{setting} {_LETTER[setting]}" for setting in unread)
            + ")",
        )
    return values


# Round settings the bound depends on: never a default in their place (local-samples: _require). The server
# rounds too: each round adds its equations to a sample's bound, and DP composes over them; one round assumed where
# the app runs several would understate both.
_VERDICT_SETTINGS = ("batch-size", "local-epochs", "server-rounds")
_LETTER = {"batch-size": "B", "local-epochs": "E", "server-rounds": "R"}


def _fits(setting: str, value) -> bool:
    """Whether a nested table's value can be the setting (a placeholder "" in another tool's table cannot)."""
    if setting in _INTEGERS or setting in ("lr", "momentum", "fraction", "min-clients"):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return True


def _typed(setting: str, value, source: str):
    """A value read from the app, in the Round field's type; a one-line error naming where it was read."""
    if setting in _INTEGERS:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageError(
                f"{setting} read from {source} is {value!r}, not an integer",
                f"set {setting} in {ROUND_TABLE} (it wins over the app's value)",
            )
    elif setting in ("lr", "momentum"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageError(
                f"{setting} read from {source} is {value!r}, not a number",
                f"set {setting} in {ROUND_TABLE} (it wins over the app's value)",
            )
        value = float(value)
    return value


def _sampled_clients(read: dict[str, Found], mechanisms) -> Found | None:
    """Clients sampled per round: the DP strategy's num_sampled_clients, else max(⌊fraction · nodes⌋, the
    strategy's minimum) as Flower's FedAvg samples them."""
    for mechanism in mechanisms:
        stated = mechanism.arguments.get("num_sampled_clients")
        if mechanism.kind == "flower-central" and stated is not None and isinstance(stated.value, int):
            return stated
    nodes = read.get("available-clients")
    minimum = read.get("min-clients")
    if nodes is None and minimum is not None and "fraction" not in read:
        return minimum  # NVFlare's controllers send each round's task to min_clients clients
    if nodes is None:
        return None
    fraction = read.get("fraction")
    share = int(nodes.value * fraction.value) if fraction is not None else nodes.value
    least = int(minimum.value) if minimum is not None else _FLOWER_MIN_CLIENTS
    sampled = min(max(share, least), nodes.value)
    parts = [nodes.source] + ([fraction.source] if fraction else []) + ([minimum.source] if minimum else [])
    parts = list(dict.fromkeys(parts))
    return Found("clients", sampled, "max(⌊fraction · nodes⌋, min clients) from " + ", ".join(parts))


def _clients_read(mechanisms, read, values, sources: _Sources, *, encrypted: bool = False) -> None:
    """Without secure aggregation the server sees each client's update alone, so the round is one client's:
    the nodes and the clients sampled per round are still shown as read. With encrypted updates (homomorphic
    encryption) the encryption's own note says how the round is judged: one note, not two that disagree."""
    if "clients" in values:
        return
    nodes, sampled = read.get("available-clients"), _sampled_clients(read, mechanisms)
    if nodes is not None:
        sources.add("nodes", nodes.value, nodes.source)
    if sampled is not None:
        sources.add("clients per round", sampled.value, sampled.source)
    if sampled is not None and not encrypted:
        sources.notes.append(
            f"{sampled.value} clients train each round; without secure aggregation the server sees each "
            "client's update alone, so the round is judged for one client"
        )


def _secure_aggregation(mechanisms, read, values, sources: _Sources, settings, overrides: Overrides):
    """SecAgg+ found: the server sees the sum over the clients sampled per round (C), drawn from the nodes."""
    secagg = next((m for m in mechanisms if m.kind == "secagg"), None)
    if secagg is None:
        return
    sources.add("secure-aggregation", secagg.name, secagg.source)
    if "clients" not in values:
        sampled = _sampled_clients(read, mechanisms)
        if sampled is None:
            sources.notes.append(
                "secure aggregation is on, but the clients per round are not stated: the round is "
                f"judged for one client; set clients = C in {ROUND_TABLE}"
            )
        else:
            values["clients"] = sampled.value
            sources.add("clients", sampled.value, sampled.source)
    nodes = read.get("available-clients")
    if "available_clients" not in values and nodes is not None and values.get("clients", 1) <= nodes.value:
        values["available_clients"] = nodes.value
        sources.add("available-clients", nodes.value, nodes.source)


# ---- what must be given --------------------------------------------------------------------------------------------


def _require(directory: Path, model: str, settings, overrides: Overrides, round_, read):
    """What the app cannot say: the input shape and the samples per client, all in one line naming where."""
    pyproject = directory / "pyproject.toml"
    missing, fixes = [], []
    if settings.input_shape is None and not overrides.input_shape_given and not _declares_input_shape(model):
        missing.append(f"the input shape of {_relative(directory, model)}")
        fixes.append('input-shape = "C,H,W" in [tool.rankaudit] (or --input-shape)')
    if round_.local_samples is None:
        missing.append("the samples each client trains on per round")
        fixes.append(
            f"local-samples = N in {ROUND_TABLE} (or --local-samples N; or dataset-size = D there with the "
            "federation's options.num-supernodes)"
        )
    if missing:
        raise UsageError(
            " and ".join(missing) + (" are" if len(missing) > 1 else " is") + " not stated in the app",
            "set " + "; and ".join(fixes) + f" of {pyproject}",
        )


def _declares_input_shape(model: str) -> bool:
    path = Path(model.rsplit(":", 1)[0] if model.count(":") else model)
    try:
        tree = ast.parse(read_source(path))
    except (UsageError, SyntaxError, ValueError, RecursionError, MemoryError):
        return False
    return any(
        isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(target, ast.Name) and target.id == "INPUT_SHAPE"
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
        for node in tree.body
    )
