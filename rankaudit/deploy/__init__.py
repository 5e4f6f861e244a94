"""A deployed app (Flower, Opacus, NVFlare) -> one Round with its DP settings and the model spec, each with its source."""

from __future__ import annotations

import ast
import math
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from rankaudit.deploy import flower, nvflare, static
from rankaudit.deploy.static import Found
from rankaudit.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# Round settings and the run-config keys apps conventionally give them ([tool.rankaudit.flower] adds others).
CONVENTIONAL_KEYS = {
    "local-epochs": ("local-epochs", "local_epochs", "epochs"),
    "batch-size": ("batch-size", "batch_size"),
    "lr": ("lr", "learning-rate", "learning_rate"),
    "momentum": ("momentum",),
    "server-rounds": ("num-server-rounds", "num_server_rounds", "num-rounds"),
    "fraction": ("fraction-train", "fraction-fit"),
    "local-samples": (),
    "available-clients": (),
}
_ROUND_FIELDS = {
    "local-samples": "local_samples",
    "batch-size": "batch_size",
    "local-epochs": "local_epochs",
    "lr": "lr",
    "optimizer": "optimizer",
    "momentum": "momentum",
    "clients": "clients",
    "server-rounds": "server_rounds",
    "available-clients": "available_clients",
    "bn-mode": "bn_mode",
}
_INTEGERS = ("local-samples", "batch-size", "local-epochs", "clients", "server-rounds", "available-clients")
# Round settings whose default is shown with its source when the app states none (the others stay silent: one
# client, no momentum, one available client are what the app says by stating nothing).
_SHOWN_DEFAULTS = {"batch-size": 1, "local-epochs": 1, "lr": 0.1, "optimizer": "sgd", "server-rounds": 1}
ROUND_TABLE = "[tool.rankaudit.round]"
DP_TABLE = "[tool.rankaudit.dp]"
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
    from rankaudit.config import load_settings
    from rankaudit.round import build_round

    overrides = overrides or Overrides()
    directory = path.resolve()
    if flower.is_flower_app(directory):
        app = flower.read_app(directory, overrides.run_config)
        kind, config = "flower", app.config
    elif nvflare.is_nvflare_job(directory):
        app, kind, config = None, "nvflare", {}
        if overrides.run_config:
            raise UsageError(
                "--run-config overrides a Flower app's run config, and this is an NVFlare job", "drop --run-config"
            )
    else:
        raise UsageError(
            f"'{path}' is a directory but neither a Flower app (pyproject.toml with [tool.flwr.app]) "
            "nor an NVFlare job (config_fed_client.json)",
            "give a model file (MODEL.py[:NAME]) or the app's directory",
        )
    settings = load_settings(directory / "pyproject.toml")
    sources = _Sources()
    model, imported = _model(directory, app, settings)
    sources.add("model", _relative(directory, model), _model_source(imported, kind))
    model_args = _model_args(settings, overrides, config, sources)
    files = _code_files(directory, app)
    found, mechanisms = static.read_code(files, directory, config)
    read = _read_round(config, found, settings.flower or {}, app)
    values = _merge_round(read, settings, overrides, sources)
    _secure_aggregation(mechanisms, read, values, sources, settings, overrides)
    round_ = build_round(values, None)  # validated: a UsageError names the setting
    dp, notes = _privacy(mechanisms, read, round_, settings, overrides, sources)
    round_ = replace(round_, dp=dp)
    withheld = _withheld(directory, mechanisms, settings, sources)
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


class _Sources:
    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []
        self.notes: list[str] = []

    def add(self, setting: str, value, source: str):
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        self.rows.append((setting, shown, source))


# ---- the model -----------------------------------------------------------------------------------------------------


def _model(directory: Path, app, settings) -> tuple[str, list[str]]:
    """[tool.rankaudit] model, else the one nn.Module class the client app's module imports from the app."""
    if settings.model:
        path_text, _, name = settings.model.partition(":")
        base = settings.source.parent if settings.source is not None else directory  # relative to its pyproject
        path = base / path_text
        if not path.is_file():
            raise UsageError(
                f"[tool.rankaudit] model = {settings.model!r}: {path} does not exist",
                f'give the model file relative to {base}, e.g. model = "pkg/task.py:Net"',
            )
        return _shown(f"{path}:{name}" if name else str(path)), []
    candidates = _candidates(directory, app)
    if len(candidates) == 1:
        return _shown(candidates[0]), [candidates[0]]
    where = f"[tool.rankaudit] of {directory / 'pyproject.toml'}"
    if not candidates:
        raise UsageError(
            f"found no nn.Module class in the app that the client app imports ({directory})",
            f'name the model: model = "pkg/task.py:Net" (a class or a factory) in {where}',
        )
    shown = ", ".join(_relative(directory, spec) for spec in candidates)
    raise UsageError(f"the app has several model candidates ({shown})", f'choose one: model = "..." in {where}')


def _shown(spec: str) -> str:
    """The model spec with its path relative to the working directory, as the user would type it."""
    path, _, name = spec.rpartition(":") if spec.count(":") else (spec, "", "")
    return os.path.relpath(path) + (f":{name}" if name else "")


def _candidates(directory: Path, app) -> list[str]:
    if app is not None and app.module_file(app.clientapp) is not None:
        client = app.module_file(app.clientapp)
        imports = [(client, None), *static.imported_modules(client, directory)]
    else:
        imports = [(path, None) for path in _python_files(directory)]
    candidates: dict[str, None] = {}
    factories: dict[str, None] = {}  # only when no class is a candidate: get_model(...) and the like
    for path, names in imports:
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for name in static.module_classes(tree):
            if names is None or name in names:
                candidates[f"{path}:{name}"] = None
        for name in static.model_factories(tree):
            if names is not None and name in names:
                factories[f"{path}:{name}"] = None
    return list(candidates or factories)


def _model_source(imported: list[str], kind: str) -> str:
    if not imported:
        return "[tool.rankaudit] model"
    return "the one model candidate " + ("the client app imports" if kind == "flower" else "in the job")


def _relative(directory: Path, spec: str) -> str:
    path, _, name = spec.rpartition(":") if spec.count(":") else (spec, "", "")
    path = Path(path).resolve()
    shown = path.relative_to(directory).as_posix() if path.is_relative_to(directory) else str(path)
    return f"{shown}:{name}" if name else shown


def parse_value(text: str) -> object:
    """One value as Flower's run config writes it (123, 0.1, true, "text"); a bare word stays a string."""
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError:
        return text


def _model_args(settings, overrides: Overrides, config, sources: _Sources) -> dict[str, object]:
    """model-args in [tool.rankaudit], then --model-arg KEY=VALUE over them; a value naming a run-config key
    (`num-classes`) takes that key's value."""
    given: dict[str, tuple[object, str]] = {
        key: (value, "[tool.rankaudit] model-args") for key, value in (settings.model_args or {}).items()
    }
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
        if isinstance(value, str) and value in config:
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
        files = [
            path
            for package in sorted(packages)
            for path in sorted((directory / package).rglob("*.py"))
            if (directory / package).is_dir()
        ]
        files += [
            directory / f"{package}.py" for package in sorted(packages) if (directory / f"{package}.py").is_file()
        ]
        if files:
            return files
    return _python_files(directory)


def _python_files(directory: Path) -> list[Path]:
    skipped = {".git", ".venv", "venv", "node_modules", "__pycache__", "build", "dist", "tests"}
    return sorted(path for path in directory.rglob("*.py") if not skipped & set(path.relative_to(directory).parts))


def _read_round(config, found: list[Found], mapping: dict[str, str], app) -> dict[str, Found]:
    """Each round setting the app states: its run config first (conventional keys, or the key
    [tool.rankaudit.flower] maps), then literals in the code; the federation's nodes as available clients."""
    read: dict[str, Found] = {}
    for setting, keys in CONVENTIONAL_KEYS.items():
        names = (mapping[setting],) if setting in mapping else keys
        for name in names:
            if name in config:
                value, source = config[name]
                read[setting] = Found(
                    setting, value, f"{source} {name}" if source == flower.APP_CONFIG else f"{source} {name}={value}"
                )
                break
    for item in found:
        read.setdefault(item.key, item)
    if "available-clients" not in read and app is not None and app.num_supernodes is not None:
        nodes, source = app.num_supernodes
        read["available-clients"] = Found("available-clients", nodes, source)
    return read


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
    values: dict[str, object] = {}
    for setting, name in _ROUND_FIELDS.items():
        if overrides.round.get(name) is not None:
            value, source = overrides.round[name], f"--{setting}"
        elif table.get(name) is not None:
            value, source = table[name], ROUND_TABLE
        elif setting in read and setting != "available-clients":  # nodes count only with secure aggregation
            value, source = read[setting].value, read[setting].source
            value = _typed(setting, value, source)
        elif setting in _SHOWN_DEFAULTS:  # every setting the round uses has a source, a default too
            sources.add(setting, _SHOWN_DEFAULTS[setting], "default, not in the app")
            continue
        else:
            continue
        values[name] = value
        sources.add(setting, value, source)
    return values


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
    if nodes is None:
        return None
    fraction = read.get("fraction")
    minimum = read.get("min-clients")
    share = int(nodes.value * fraction.value) if fraction is not None else nodes.value
    least = int(minimum.value) if minimum is not None else _FLOWER_MIN_CLIENTS
    sampled = min(max(share, least), nodes.value)
    parts = [nodes.source] + ([fraction.source] if fraction else []) + ([minimum.source] if minimum else [])
    return Found("clients", sampled, "max(⌊fraction · nodes⌋, min clients) from " + ", ".join(parts))


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


# ---- privacy ---------------------------------------------------------------------------------------------------


def _privacy(mechanisms, read, round_, settings, overrides: Overrides, sources: _Sources):
    """The DP mechanism of the code (if any) as [tool.rankaudit.dp] keys; the config and the flags over it."""
    from rankaudit.dp import OPTION_RULES, check_option, settings_from
    from rankaudit.round import dp_for_round

    found: dict[str, tuple[object, str]] = {}
    notes: list[str] = []
    dp_mechanisms = [m for m in mechanisms if m.kind not in ("secagg", "exclude-vars")]
    if len({m.kind for m in dp_mechanisms}) > 1:
        notes.append(
            "several DP mechanisms in the code ("
            + ", ".join(f"{m.name} at {m.source}" for m in dp_mechanisms)
            + f"); the first is used: set the others' settings in {DP_TABLE} to judge them"
        )
    if dp_mechanisms:
        mechanism = dp_mechanisms[0]
        reader = {
            "flower-central": _flower_central,
            "local-dp": _local_dp,
            "opacus": _opacus,
            "opacus-epsilon": _opacus,
        }[mechanism.kind]
        try:
            found, more = reader(mechanism, read, round_)
        except _Unread as unread:
            given = {**(settings.dp or {}), **overrides.dp}
            if "noise" not in given or unread.key not in given:
                raise UsageError(
                    f"{mechanism.name} at {mechanism.source}: its {unread.name} is not a literal or a "
                    "run-config value rankaudit can read",
                    f"set noise = σ and clip = C in {DP_TABLE} of the app's pyproject.toml (or --dp-noise, --dp-clip)",
                ) from None
            found, more = _unread_mechanism(mechanism, round_)
        notes += more
    merged: dict[str, tuple[object, str]] = dict(found)
    for key, value in (settings.dp or {}).items():
        merged[key] = (value, DP_TABLE)
    for key, value in overrides.dp.items():
        prefix = "dp-" if key in ("noise", "clip", "sample-rate", "steps", "delta", "level") else ""
        merged[key] = (value, f"--{prefix}{key}")
    options, given = {}, {}
    for key, (value, source) in merged.items():
        options[key] = check_option(key, value, source if source.startswith("[") else None)
        sources.add(f"dp {key}", options[key], source)
        if key in ("sample-rate", "steps"):
            given[OPTION_RULES[key][0]] = source
    settings = dp_for_round(round_, settings_from(options), given)
    if settings is not None:
        for key, field in (("sample-rate", "sample_rate"), ("steps", "steps")):
            if field not in given:
                sources.add(f"dp {key}", getattr(settings, field), getattr(settings, f"{field}_source"))
    return settings, notes


class _Unread(Exception):
    """A mechanism's argument rankaudit cannot read; fatal only when [tool.rankaudit.dp] or a flag does not give
    the value instead."""

    def __init__(self, mechanism, name: str, key: str):
        super().__init__(name)
        self.mechanism, self.name, self.key = mechanism, name, key


def _need(mechanism, name: str, key: str = "noise"):
    found = mechanism.arguments.get(name)
    if found is None or isinstance(found.value, (str, list, bool)):
        raise _Unread(mechanism, name, key)
    return found


def _unread_mechanism(mechanism, round_):
    """A mechanism whose σ or clip the config gives: who adds the noise and its level, from the mechanism alone."""
    where = f"{mechanism.name} at {mechanism.source}"
    # q and T not named here follow the round (round.dp_for_round, the one place that derives them).
    if mechanism.kind == "flower-central":
        return {
            "level": ("client", where),
            "noise-by": ("server", f"{mechanism.name} adds the noise on the server"),
        }, []
    if mechanism.kind == "local-dp":
        return {
            "level": ("client", where),
            "noise-by": ("client", f"{where} adds the noise on the client"),
            "sample-rate": (1.0, f"{where}: the server knows which client sent each update"),
        }, []
    return {"level": ("sample", where), "noise-by": ("client", f"{where}: DP-SGD on the client")}, []


def _flower_central(mechanism, read, round_):
    """Flower's central DP: clipped updates, Gaussian noise added by the SERVER to the aggregate. Client level;
    q = sampled / available clients, T = server rounds."""
    noise, clip = _need(mechanism, "noise_multiplier"), _need(mechanism, "clipping_norm", "clip")
    found = {
        "noise": (float(noise.value), noise.source),
        "clip": (float(clip.value), clip.source),
        "level": ("client", f"{mechanism.name} at {mechanism.source}"),
        "noise-by": ("server", f"{mechanism.name} adds the noise on the server"),
    }
    notes = []
    if "Adaptive" in mechanism.name:
        notes.append(f"{mechanism.name}: the clip norm adapts during training; the bound does not depend on it")
    sampled = mechanism.arguments.get("num_sampled_clients")
    nodes = read.get("available-clients")
    if sampled is not None and nodes is not None and isinstance(sampled.value, int) and sampled.value <= nodes.value:
        found["sample-rate"] = (
            sampled.value / nodes.value,
            f"num_sampled_clients {sampled.value} ({sampled.source}) / {nodes.value} nodes ({nodes.source})",
        )
    else:
        notes.append(
            "client-level q = 1: the number of nodes the server samples from is not stated; set "
            f"available-clients in {ROUND_TABLE} or options.num-supernodes of the federation"
        )
    return found, notes


def _local_dp(mechanism, read, round_):
    """Flower's LocalDpMod: each client clips its update to `clipping_norm` and adds Gaussian noise of standard
    deviation sensitivity·√(2 ln(1.25/δ))/ε itself. The server knows who sent what: no sampling amplification
    against it (q = 1); T = server rounds."""
    clip, sensitivity = _need(mechanism, "clipping_norm", "clip"), _need(mechanism, "sensitivity")
    epsilon, delta = _need(mechanism, "epsilon"), _need(mechanism, "delta")
    if not (epsilon.value > 0 and 0 < delta.value < 1 and clip.value > 0):
        raise UsageError(
            f"LocalDpMod at {mechanism.source}: epsilon {epsilon.value!r}, delta {delta.value!r} and "
            f"clipping_norm {clip.value!r} give no Gaussian noise rankaudit can bound",
            f"set noise = σ and clip in {DP_TABLE}",
        )
    std = sensitivity.value * math.sqrt(2 * math.log(1.25 / delta.value)) / epsilon.value
    where = f"LocalDpMod at {mechanism.source}"
    return {
        "noise": (std / clip.value, f"{where}: sensitivity·√(2 ln(1.25/δ))/ε / clipping_norm"),
        "clip": (float(clip.value), clip.source),
        "level": ("client", where),
        "noise-by": ("client", f"{where} adds the noise on the client"),
        "sample-rate": (1.0, f"{where}: the server knows which client sent each update"),
    }, []


def _opacus(mechanism, read, round_):
    """Opacus DP-SGD on the client: sample level, q = B/N, T = E·⌈N/B⌉ per round × rounds."""
    clip = _need(mechanism, "max_grad_norm", "clip")
    where = f"{mechanism.name} at {mechanism.source}"
    notes = []
    found = {
        "clip": (float(clip.value), clip.source),
        "level": ("sample", where),
        "noise-by": ("client", f"{where}: DP-SGD on the client"),
    }  # q = B/N and T follow the round
    poisson = mechanism.arguments.get("poisson_sampling")
    if poisson is not None and poisson.value is False:
        notes.append(
            f"{where}: poisson_sampling=False; the bound assumes Poisson sampling at q = B/N, as Opacus' "
            "own accountant does, which shuffled batches do not strictly give"
        )
    if mechanism.kind == "opacus":
        noise = _need(mechanism, "noise_multiplier")
        found["noise"] = (float(noise.value), noise.source)
        return found, notes
    target, delta, epochs = (_need(mechanism, name) for name in ("target_epsilon", "target_delta", "epochs"))
    horizon = int(epochs.value) * round_.steps_per_epoch
    from rankaudit.round import round_sampling

    sigma = noise_for_epsilon(float(target.value), float(delta.value), round_sampling(round_, "sample")[0], horizon)
    found["noise"] = (
        sigma,
        (
            f"σ for ε {target.value:g} at δ {delta.value:g} over {epochs.value} epoch(s) "
            f"({where}), derived with dp-accounting's PLD (Opacus' own accountant may differ "
            "slightly)"
        ),
    )
    return found, notes


def noise_for_epsilon(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The least σ whose subsampled Gaussian reaches `epsilon` at `delta` after `steps` steps at `sample_rate`
    (what make_private_with_epsilon chooses), by bisection on the PLD accountant's ε."""
    from rankaudit.dp import PLDAccountant, SubsampledGaussian

    accountant = PLDAccountant()

    def reached(sigma: float) -> float:
        return accountant.profile(SubsampledGaussian(sigma, sample_rate, steps)).epsilon(delta)

    low, high = 0.3, 1.0
    while reached(high) > epsilon:
        low, high = high, high * 2
        if high > 1e4:
            raise UsageError(
                f"no noise multiplier reaches ε {epsilon:g} at δ {delta:g}", f"set noise = σ in {DP_TABLE}"
            )
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if reached(middle) > epsilon else (low, middle)
        if high - low < 1e-3:
            break
    return round(high, 4)


# ---- withheld layers and what must be given ------------------------------------------------------------------------


def _withheld(directory: Path, mechanisms, settings, sources: _Sources) -> list[str] | None:
    """NVFlare's ExcludeVars (a config filter or a call in the code): the listed variables never leave the client."""
    if settings.withheld_layers is not None or settings.shared_layers is not None:
        return None
    found = nvflare.excluded_variables(directory) + [
        m.arguments["exclude_vars"] for m in mechanisms if m.kind == "exclude-vars" and m.arguments.get("exclude_vars")
    ]
    names: list[str] = []
    for item in found:
        if isinstance(item.value, str):
            sources.notes.append(
                f"ExcludeVars in {item.source} is a regular expression ({item.value!r}); "
                "name the withheld layers in withheld-layers of [tool.rankaudit]"
            )
            continue
        names += [name for name in item.value if name not in names]
        sources.add("withheld-layers", ",".join(item.value), item.source)
    return names or None


def _require(directory: Path, model: str, settings, overrides: Overrides, round_, read):
    """What the app cannot say: the input shape and the samples per client. One line naming the key and where."""
    pyproject = directory / "pyproject.toml"
    if settings.input_shape is None and not overrides.input_shape_given and not _declares_input_shape(model):
        raise UsageError(
            f"the input shape of {_relative(directory, model)} is not stated in the app",
            f'set input-shape = "C,H,W" in [tool.rankaudit] of {pyproject} (or pass --input-shape)',
        )
    if round_.local_samples is None:
        raise UsageError(
            "the samples each client trains on per round are not stated in the app",
            f"set local-samples = N in {ROUND_TABLE} of {pyproject} (or pass --local-samples N; or "
            "dataset-size = D there with the federation's options.num-supernodes)",
        )


def _declares_input_shape(model: str) -> bool:
    path = Path(model.rsplit(":", 1)[0] if model.count(":") else model)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return False
    return any(
        isinstance(node, (ast.Assign, ast.AnnAssign))
        and any(
            isinstance(target, ast.Name) and target.id == "INPUT_SHAPE"
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        )
        for node in tree.body
    )
