"""An NVFlare job (JSON/HOCON configs, Job/Recipe script): rounds, clients, script arguments, model, ExcludeVars."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

from rankaudit.deploy.found import Found
from rankaudit.deploy.privacy import NVFLARE_RESULT_FILTERS, result_filter_note
from rankaudit.errors import UsageError
from rankaudit.settings import files

_CLIENT_CONFIGS = ("config_fed_client.json", "config_fed_client.conf")
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
    """A job folder (config_fed_client.json / .conf) or a job written with the Job/Recipe API (job.py)."""
    return bool(client_configs(directory)) or bool(job_scripts(directory))


def excluded_variables(directory: Path) -> list[Found]:
    """Each ExcludeVars filter in a client config: its `exclude_vars` (a list of state-dict keys or layer names;
    a string is NVFlare's regular expression over the keys), with the file it came from."""
    found = []
    for path in client_configs(directory):
        config = load_config(path)
        if config is None:
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


# ---- the job: its configs (JSON or HOCON) and its Job/Recipe API script, read without NVFlare ------------------------

_JOB_CALLS = ("FedJob", "ScriptRunner", "SimEnv", "PocEnv", "ProdEnv")
_RECIPE_ROUNDS_DEFAULT = 2  # FedAvgRecipe's num_rounds when the job does not pass it (nvflare.recipe)


@dataclass
class NVFlareJob:
    """What an NVFlare job states: round settings, the training script and what it is passed, the model."""

    root: Path
    found: list[Found] = field(default_factory=list)  # server-rounds, min-clients, available-clients
    scripts: dict[Path, dict[str, Found]] = field(default_factory=dict)  # training script -> options passed
    components: dict[str, dict[str, Found]] = field(default_factory=dict)  # class -> its `args` in a client config
    model: tuple[str, dict[str, Found], str] | None = None  # (class or dotted class path, arguments, source)
    notes: list[str] = field(default_factory=list)
    encrypted: bool = False  # the updates are encrypted (FedAvgRecipeWithHE): its note says how the round is judged


def job_scripts(directory: Path) -> list[Path]:
    """Python files of the job that call the Job/Recipe API (job.py and the like)."""
    import ast

    found = []
    for path in sorted(directory.rglob("*.py")):
        if _SKIPPED & set(path.relative_to(directory).parts):
            continue
        try:
            text = files.read_source(path)
        except UsageError:
            continue
        if "Recipe" not in text and "Job(" not in text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        names = {
            node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
        }
        if any(_is_recipe(name) or _is_job(name) for name in names):
            found.append(path)
    return found


def _is_recipe(name: str) -> bool:
    """FedAvgRecipe, FedAvgRecipeWithHE, CyclicRecipe, ...: a Recipe class of NVFlare's Recipe API."""
    return "Recipe" in name and name[:1].isupper()


def _is_job(name: str) -> bool:
    """FedJob, or a job class that builds one with its controller (FedAvgJob, BaseFedJob)."""
    return name.endswith("FedJob") or name in _CONTROLLER_JOBS


_CONTROLLER_JOBS = ("FedAvgJob",)  # nvflare.app_opt.pt.job_config: FedAvg with its controller built in


def config_files(directory: Path, stem: str) -> list[Path]:
    return sorted(
        path
        for suffix in (".json", ".conf")
        for path in directory.rglob(stem + suffix)
        if not _SKIPPED & set(path.relative_to(directory).parts)
    )


def _raw_config(path: Path) -> dict | None:
    """A job config, JSON (json) or HOCON (pyhocon, NVFlare's own reader), as written (its `{name}` placeholders
    unfilled); parsed under the memory and time limits, its nesting and includes bounded (one line naming the file
    where they are not); None where its syntax is not JSON or HOCON."""
    root = _job_root(path)
    text = files.read_text(path)
    try:
        config = files.bounded(_parse_config, path, text, path, root)
    except files.ParseFailed:
        return None
    return config if isinstance(config, dict) else None


def _job_root(path: Path) -> Path:
    """The folder a config's includes must stay in: the job's (the folder above the app's config/ folder)."""
    folder = path.resolve().parent
    return folder.parent.parent if folder.name == "config" else folder


def _parse_config(text: str, path: Path, root: Path):
    config = json.loads(text) if path.suffix == ".json" else _hocon(text, path, root)
    files.check_shape(config, path)
    return config


def _variables(config: dict) -> dict:
    """A config's top-level values that its `{name}` placeholders name."""
    return {key: value for key, value in config.items() if isinstance(value, (str, int, float))}


def component_arguments(config: dict, relative: str) -> dict[str, dict[str, Found]]:
    """Each component's class (the last part of its `path`) -> the constructor arguments its `args` give, with a
    `{name}` placeholder read from the config's own `name` (`"epochs": "{local_rounds}"` with `local_rounds: 1`)."""
    variables = _variables(config)
    found: dict[str, dict[str, Found]] = {}
    for component in _filters(config):
        arguments = component.get("args")
        cls = str(component.get("path") or component.get("name") or "").rsplit(".", 1)[-1]
        if not isinstance(arguments, dict) or not cls:
            continue
        read = found.setdefault(cls, {})
        for key, value in arguments.items():
            if isinstance(value, str) and value.startswith("{") and value.endswith("}") and value[1:-1] in variables:
                name = value[1:-1]
                read[key] = Found(key, variables[name], f"{relative} {name} (passed as {cls}'s {key})")
            elif isinstance(value, (bool, int, float, str)):
                read[key] = Found(key, value, f"{relative} {cls} args {key}")
    return found


def load_config(path: Path) -> dict | None:
    """A job config, JSON or HOCON, with its `{name}` placeholders filled from its own top-level values."""
    config = _raw_config(path)
    if config is None:
        return None
    variables = _variables(config)

    def fill(node):
        if isinstance(node, dict):
            return {key: fill(value) for key, value in node.items()}
        if isinstance(node, list):
            return [fill(item) for item in node]
        if isinstance(node, str) and node.startswith("{") and node.endswith("}") and node[1:-1] in variables:
            return variables[node[1:-1]]
        return node

    return fill(config)


def _hocon(text: str, path: Path, root: Path) -> dict:
    """A HOCON text as plain dicts and lists, its includes and `${...}` substitutions resolved by pyhocon. An include
    is read through files.read_text and only inside `root` (never a URL, never /etc/passwd), at most
    files.MAX_INCLUDES of them (a file that includes itself stops there)."""
    from pyhocon import ConfigFactory

    included = []

    def parse_file(filename, encoding="utf-8", required=True, resolve=True, unresolved_value=None, **_):
        target = Path(filename)
        shown = files.shown_path(target)
        if not files.inside(root, target):
            raise UsageError(
                f"{files.shown_path(path)} includes {shown}, outside the job's folder; rankaudit does not read it",
                "copy what it needs into the job's folder, or remove the include",
            )
        included.append(target)
        if len(included) > files.MAX_INCLUDES:
            raise UsageError(
                f"{files.shown_path(path)} includes over {files.MAX_INCLUDES} files (an include that includes "
                "itself?); rankaudit does not read it",
                "remove the include loop",
            )
        if not target.exists() and not required:
            return []
        given = {} if unresolved_value is None else {"unresolved_value": unresolved_value}
        return ConfigFactory.parse_string(files.read_text(target), str(target.parent), resolve, **given)

    def parse_url(url, *args, **kwargs):
        raise UsageError(
            f"{files.shown_path(path)} includes the URL {files.shown_path(str(url))}; rankaudit reads no URL",
            "copy what it needs into the job's folder, or remove the include",
        )

    originals = {name: vars(ConfigFactory)[name] for name in ("parse_file", "parse_URL")}
    ConfigFactory.parse_file, ConfigFactory.parse_URL = staticmethod(parse_file), staticmethod(parse_url)
    try:
        return ConfigFactory.parse_string(text, str(path.parent)).as_plain_ordered_dict()
    finally:
        for name, method in originals.items():
            setattr(ConfigFactory, name, method)


def read_job(directory: Path) -> NVFlareJob:
    """The job's configs (config_fed_server / config_fed_client, JSON or HOCON) and its Job/Recipe scripts."""
    job = NVFlareJob(root=directory)
    for path in config_files(directory, "config_fed_server"):
        config = load_config(path)
        relative = path.relative_to(directory).as_posix()
        for component in _filters(config or {}):
            arguments = component.get("args") or {}
            for key, setting in (("num_rounds", "server-rounds"), ("min_clients", "min-clients")):
                value = arguments.get(key)
                if isinstance(value, int) and not isinstance(value, bool):
                    job.found.append(Found(setting, value, f"{relative} {key}"))
    for path in config_files(directory, "config_fed_client"):
        config = load_config(path)
        relative = path.relative_to(directory).as_posix()
        for cls, arguments in component_arguments(_raw_config(path) or {}, relative).items():
            job.components.setdefault(cls, {}).update(arguments)
        for component in _filters(config or {}):  # task_result_filters: a privacy filter the client applies
            named = (component.get("path") or component.get("name") or "").rsplit(".", 1)[-1]
            if named in NVFLARE_RESULT_FILTERS:
                job.notes.append(result_filter_note(named, relative))
        for component in _filters(config or {}):
            arguments = component.get("args") or {}
            script = arguments.get("task_script_path") or arguments.get("script")
            if not isinstance(script, str):
                continue
            words = script.split()  # "python3 custom/client.py --epochs 2" (launcher) or "client.py"
            script_file = next((word for word in words if word.endswith(".py")), None)
            target = _locate(directory, path, script_file) if script_file else None
            if target is None:
                continue
            passed = " ".join(words[words.index(script_file) + 1 :])
            passed += " " + str(arguments.get("task_script_args") or "")
            from rankaudit.deploy.scripts import string_options

            job.scripts[target] = string_options(passed, f"{relative} task_script_args")
    for path in job_scripts(directory):
        _read_job_script(directory, path, job)
    rounds = next((item for item in job.found if item.key == "server-rounds"), None)
    if rounds is not None:  # what the client API hands the script as FLModel.total_rounds
        for options in job.scripts.values():
            options.setdefault(
                "total_rounds", Found("total_rounds", rounds.value, f"{rounds.source} (FLModel.total_rounds)")
            )
    return job


def _locate(directory: Path, config: Path, script: str) -> Path | None:
    """A script a config or job names: beside the config's app (custom/), the job file, or in the job."""
    name = Path(script)
    bases = [config.parent, config.parent.parent, config.parent.parent / "custom", directory]
    for base in bases:
        if (base / name).is_file():
            return (base / name).resolve()
    matches = sorted(directory.rglob(name.name))
    return matches[0].resolve() if len(matches) == 1 else None


def _script_path(reader, node, job_file: Path) -> str | None:
    """The training script a job names: a string, or a path built from the job file's own place
    (`os.path.join(os.path.dirname(__file__), "src", "client.py")`, `Path(__file__).parent / "client.py"`)."""
    import ast

    from rankaudit.deploy.found import call_name

    if node is None:
        return None
    node = reader.expression(node)
    if isinstance(node, ast.Name) and node.id == "__file__":
        return str(job_file.resolve())
    if isinstance(node, ast.Call) and call_name(node) in ("dirname", "abspath", "realpath", "Path", "str"):
        inner = _script_path(reader, node.args[0], job_file) if len(node.args) == 1 else None
        if inner is None:
            return None
        return str(Path(inner).parent) if call_name(node) == "dirname" else inner
    if isinstance(node, ast.Call) and call_name(node) == "join" and node.args:
        parts = [_script_path(reader, part, job_file) for part in node.args]
        return str(Path(*parts)) if all(part is not None for part in parts) else None
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _script_path(reader, node.value, job_file)
        return str(Path(inner).parent) if inner is not None else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
        left, right = _script_path(reader, node.left, job_file), _script_path(reader, node.right, job_file)
        return str(Path(left) / right) if left is not None and right is not None else None
    found = reader.value(node)
    return found.value if found is not None and isinstance(found.value, str) else None


def _read_job_script(directory: Path, path: Path, job: NVFlareJob) -> None:
    """FedAvgRecipe(model=..., num_rounds=..., min_clients=..., train_script=..., train_args=...), FedJob with
    ScriptRunner(script=..., script_args=...), a controller's num_rounds / num_clients, SimEnv(num_clients=...)."""
    import ast

    from rankaudit.deploy.code_reader import ModuleReader
    from rankaudit.deploy.found import call_name
    from rankaudit.deploy.scripts import passed_options, tokens

    reader = ModuleReader(path, directory, {})
    for call in reader.calls():
        name = call_name(call)
        recipe = _is_recipe(name)
        if not (recipe or _is_job(name) or name in _JOB_CALLS or reader.argument(call, "num_rounds") is not None):
            continue
        if "WithHE" in name or reader.argument(call, "encrypt_layers") is not None:
            _encrypted(reader, call, name, job)
        rounds = reader.resolved(call, "num_rounds", "server-rounds")
        if rounds is not None and isinstance(rounds.value, int):
            job.found.append(rounds)
        elif recipe and reader.argument(call, "num_rounds") is None and name == "FedAvgRecipe":
            job.found.append(
                Found(
                    "server-rounds", _RECIPE_ROUNDS_DEFAULT, f"NVFlare's FedAvgRecipe default at {reader.where(call)}"
                )
            )
        for keyword, setting in (
            ("min_clients", "min-clients"),
            ("n_clients", "min-clients"),  # FedAvgJob's: the clients its controller waits for each round
            ("num_clients", "available-clients"),
        ):
            value = reader.resolved(call, keyword, setting)
            if value is not None and isinstance(value.value, int):
                kind = "available-clients" if name in ("SimEnv", "PocEnv", "ProdEnv") else "min-clients"
                job.found.append(Found(kind, value.value, value.source))
        script_keyword, args_keyword = ("train_script", "train_args") if recipe else ("script", "script_args")
        script = _script_path(reader, reader.argument(call, script_keyword), path)
        if script is not None:
            target = _locate(directory, path, script)
            words = tokens(reader, reader.argument(call, args_keyword))
            if target is not None:
                job.scripts[target] = passed_options(words or [], args_keyword) if words is not None else {}
                if words is None and reader.argument(call, args_keyword) is not None:
                    job.notes.append(
                        f"{args_keyword} at {reader.where(call)} is not a string rankaudit can read; the script's "
                        "own argparse defaults are used"
                    )
        # `model=` in the Recipe API, `initial_model=` in the examples written for its first releases.
        model = (
            (reader.argument(call, "model") or reader.argument(call, "initial_model"))
            if recipe or _is_job(name)
            else None
        )
        if isinstance(model, ast.Call):
            arguments = {k.arg: reader.value(k.value) for k in model.keywords if k.arg}
            job.model = (_imported_as(reader, call_name(model)), arguments, reader.where(model))
        elif isinstance(model, ast.Dict):
            table = {k.value: v for k, v in zip(model.keys, model.values) if isinstance(k, ast.Constant)}
            class_path = reader.value(table.get("class_path"))
            given = table.get("args")
            arguments = (
                {k.value: reader.value(v) for k, v in zip(given.keys, given.values) if isinstance(k, ast.Constant)}
                if isinstance(given, ast.Dict)
                else {}
            )
            if class_path is not None and isinstance(class_path.value, str):
                job.model = (class_path.value, arguments, reader.where(model))


def _encrypted(reader, call, name: str, job: NVFlareJob) -> None:
    """Homomorphic encryption of the updates (FedAvgRecipeWithHE): the server sums ciphertexts it cannot read, but
    the clients holding the key decrypt the sum; nothing here says how many updates are summed, so the round stays
    judged for one client's update, the worst case, and the note says how to judge the sum."""
    given = reader.argument(call, "encrypt_layers")
    layers = reader.value(given)
    if given is None:
        which = "every layer"
    elif layers is None:
        which = f"the layers `{ast.unparse(given)}` names (not read; the others are sent in clear)"
    else:
        which = f"the layers {layers.value!r} ({layers.source}); the others are sent in clear"
    job.encrypted = True
    job.notes.append(
        f"{name} at {reader.where(call)} encrypts {which} with homomorphic encryption: the server aggregates without "
        "reading one client's update, the key holders see the sum; the round is judged for one client's update "
        "(the worst case); set clients = C in [tool.rankaudit.round] to judge the sum of C updates"
    )


def _imported_as(reader, name: str) -> str:
    """A class the job names bare, qualified by the module it imports it from (`from src.net import Net` ->
    src.net.Net), so that the model file is the one the job imports, not another of the same name."""
    source = reader.imports.get(name) if "." not in name else None
    if source is None:
        return name
    dotted, level, original = source
    return ".".join([*dotted, original]) if dotted and not level else name
