"""Client and server code read with ast, never imported: loaders, optimizers, epochs, DP and secure aggregation."""

from __future__ import annotations

import ast
import re
from dataclasses import replace
from pathlib import Path

from rankaudit.deploy import reach
from rankaudit.deploy.code_reader import FLOWER_ADAPTIVE, FLOWER_FIXED, POSITIONAL, ModuleReader, is_number
from rankaudit.deploy.found import Found, Mechanism, call_name
from rankaudit.deploy.privacy import NVFLARE_RESULT_FILTERS

_EVALUATION_WORDS = ("test", "val", "eval", "central")  # server-side evaluation data, not a client's


def read_code(
    files: list[Path],
    root: Path,
    config: dict[str, tuple[object, str]],
    script_args: dict[Path, dict[str, Found]] | None = None,
    *,
    entries: list[Path] | None = None,
    component_args: dict[str, dict[str, Found]] | None = None,
    whole: bool = False,
) -> tuple[list[Found], list[Mechanism]]:
    """Every setting found in the code of `files` that the app runs (first find of a key wins, training loaders
    before others) and every privacy mechanism, in file order; a training script reads the options its job
    passes it (`script_args`), a class the constructor arguments a job config gives it (`component_args`). What
    runs: what the client and server app modules (`entries`; else the modules that start a Flower client or
    server) reach; with `whole`, every file runs (an NVFlare job's scripts)."""
    found: list[Found] = []
    mechanisms: list[Mechanism] = []
    script_args = script_args or {}
    readers: list[ModuleReader] = []
    for path in sorted(files, key=lambda path: path.resolve() not in script_args):
        try:
            readers.append(ModuleReader(path, root, config, script_args.get(path.resolve())))
        except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
            continue  # a file that does not parse is the loader's business, not the deployment reader's
    modules = reach.ModuleIndex(readers)
    memo: dict = {}
    for reader in readers:
        reader.peers, reader.memo, reader.module_of = readers, memo, modules.module
        reader.component_args = component_args or {}
    if not whole:
        reach.mark_live(readers, entries, modules)
    single_passes: list[Found] = []
    for reader in readers:
        found += _loaders(reader) + _optimizers(reader) + _epochs(reader) + _rounds(reader)
        mechanisms += _mechanisms(reader)
        single_passes += _single_pass(reader)
    return found + single_passes, mechanisms  # an epoch count read anywhere wins over a loop that looks like one


def _loaders(reader: ModuleReader) -> list[Found]:
    """DataLoader(batch_size=...) of the training data: a loader bound to a name without test/val/eval in it
    (one with shuffle=True first)."""
    ranked = []
    for call in reader.calls():
        if call_name(call) != "DataLoader" or reader.branch(call) is False:
            continue
        bound = reader.assigned_to(call)
        if any(word in bound for word in _EVALUATION_WORDS):
            continue
        size = reader.resolved(call, "batch_size", "batch-size")
        if size is None or not is_number(size.value):
            continue
        shuffled = reader.value(reader.argument(call, "shuffle"))
        ranked.append((0 if shuffled and shuffled.value is True else 1, size))
    return [size for _, size in sorted(ranked, key=lambda pair: pair[0])]


def _optimizers(reader: ModuleReader) -> list[Found]:
    found = []
    calls = [call for call in reader.calls() if call_name(call) in ("SGD", "Adam", "AdamW")]
    live = [(call, reader.branch(call)) for call in calls]
    live = [(call, taken) for call, taken in live if taken is not False]
    undecided = [(call, taken) for call, taken in live if isinstance(taken, str)]
    if undecided and len({call_name(call) for call, _ in live}) > 1:
        # Two optimizers and the condition that picks one is not read: never one's lr with the other's momentum.
        shown = " or ".join(f"{call_name(call)} at {reader.where(call)}" for call, _ in live)
        return [Found("optimizer-choice", f"{shown}, chosen by {undecided[0][1]}", reader.where(live[0][0]))]
    for call, _ in live:
        name = call_name(call)
        kind = "sgd" if name == "SGD" else "adam"
        momentum = reader.resolved(call, "momentum", "momentum") if kind == "sgd" else None
        shown = (
            f"{name}(momentum={momentum.value:g})"
            if momentum and is_number(momentum.value) and momentum.value
            else name
        )
        found.append(Found("optimizer", kind, f"{shown} at {reader.where(call)}", call.lineno))
        lr = reader.resolved(call, "lr", "lr")
        if lr is not None and is_number(lr.value):
            found.append(lr)
        elif reader.argument(call, "lr") is None:  # torch's default: 1e-3 for SGD, Adam and AdamW alike
            found.append(Found("lr", 1e-3, f"{name}'s default lr at {reader.where(call)}", call.lineno))
        if momentum is not None and is_number(momentum.value):
            found.append(momentum)
        elif kind == "sgd" and reader.argument(call, "momentum") is not None:
            # Set by the app, but not to anything read: named, never taken as plain SGD in silence.
            text = ast.unparse(reader.argument(call, "momentum"))
            found.append(Found("momentum-unread", f"`{text}` at {reader.where(call)}", reader.where(call), call.lineno))
    return found


def _epochs(reader: ModuleReader) -> list[Found]:
    """Local epochs: `for _ in range(E)` around a loop over the data in a train function, or a literal
    `epochs=E` / `local_epochs=E` passed to a call, or Lightning's `Trainer(max_epochs=E)` (its max_steps or
    limit_train_batches can only stop it sooner: E epochs is the most it trains)."""
    found = []
    for node in reader.loops:
        if (
            isinstance(node.iter, ast.Call)
            and call_name(node.iter) == "range"
            and len(node.iter.args) == 1
            and any(isinstance(inner, ast.For) for stmt in node.body for inner in ast.walk(stmt))
        ):
            function = reader.function_of(node)
            if reader.branch(node) is False:
                continue
            steps = any(
                isinstance(inner, ast.Call) and call_name(inner) in ("step", "backward") for inner in ast.walk(node)
            )
            if not steps and (function is None or "train" not in function.name.lower()):
                continue  # a loop that steps an optimizer trains, in a function or in a script's body
            count = reader.value(node.iter.args[0])
            if count is not None and isinstance(count.value, int) and not isinstance(count.value, bool):
                found.append(Found("local-epochs", count.value, count.source, count.line))
    for call in reader.calls():
        if call_name(call) in ("make_private_with_epsilon",):
            continue  # its `epochs` is the accountant's horizon, read with the mechanism
        names = ("epochs", "local_epochs", "num_epochs", *(("max_epochs",) if call_name(call) == "Trainer" else ()))
        if not any(keyword.arg in names for keyword in call.keywords):
            continue
        if reader.branch(call) is False:
            continue
        for keyword in call.keywords:
            if keyword.arg in names:
                count = reader.value(keyword.value)
                if count is not None and isinstance(count.value, int) and not isinstance(count.value, bool):
                    found.append(Found("local-epochs", count.value, count.source, count.line))
    return found


def _single_pass(reader: ModuleReader) -> list[Found]:
    """One local epoch: a loop over the data that steps an optimizer, in no other loop (a `while` on
    `flare.is_running()` repeats rounds, not epochs), in a function no file of the app calls from a loop."""
    found = []
    for node in ast.walk(reader.tree):
        if not (isinstance(node, ast.For) and _steps(node)) or _calls_range(node):
            continue
        if _inside_loop(reader, node):
            continue
        function = reader.function_of(node)
        if function is not None and any(
            call_name(call) == function.name and _inside_loop(peer, call)
            for peer in reader.peers
            for call in peer.calls()
        ):
            continue
        found.append(
            Found("local-epochs", 1, f"{reader.where(node)} (one pass over the data, no epoch loop)", node.lineno)
        )
    return found


def _steps(loop: ast.For) -> bool:
    return any(isinstance(inner, ast.Call) and call_name(inner) == "step" for inner in ast.walk(loop))


def _calls_range(loop: ast.For) -> bool:
    return isinstance(loop.iter, ast.Call) and call_name(loop.iter) == "range"


def _inside_loop(reader: ModuleReader, node: ast.AST) -> bool:
    parent = reader._parents.get(node)
    while parent is not None and not isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        if isinstance(parent, (ast.For, ast.AsyncFor, ast.comprehension)):
            return True
        if isinstance(parent, ast.While) and not (
            isinstance(parent.test, ast.Call) and call_name(parent.test) == "is_running"
        ):
            return True
        parent = reader._parents.get(parent)
    return False


def _rounds(reader: ModuleReader) -> list[Found]:
    """Server rounds (ServerConfig(num_rounds=...), strategy.start(num_rounds=...)) and client sampling
    (fraction_fit / fraction_train, min_fit_clients / min_train_nodes)."""
    found = []
    for call in reader.calls():
        name = call_name(call)
        relevant = name in _ROUND_CALLS or any(keyword.arg in _SAMPLING_KEYWORDS for keyword in call.keywords)
        if not relevant or reader.branch(call) is False:
            continue
        if name in ("ServerConfig", "start", "start_simulation", "start_server"):
            rounds = reader.resolved(call, "num_rounds", "server-rounds")
            if rounds is not None and isinstance(rounds.value, int):
                found.append(rounds)
        if name == "start_simulation":
            nodes = reader.resolved(call, "num_clients", "available-clients")
            if nodes is not None and isinstance(nodes.value, int):
                found.append(nodes)
        if name == "ConfigRecord" and call.args and isinstance(call.args[0], ast.Dict):
            found += _sent_config(reader, call.args[0])
        for keyword, key in (
            ("fraction_fit", "fraction"),
            ("fraction_train", "fraction"),
            ("min_fit_clients", "min-clients"),
            ("min_train_nodes", "min-clients"),
        ):
            value = reader.resolved(call, keyword, key)
            if value is not None and is_number(value.value):
                found.append(value)
    return found


_ROUND_CALLS = ("ServerConfig", "start", "start_simulation", "start_server", "ConfigRecord")
_SAMPLING_KEYWORDS = ("fraction_fit", "fraction_train", "min_fit_clients", "min_train_nodes")


# Keys of the config the server sends each round (ConfigRecord({"lr": 0.1})) that the client's training reads.
_SENT_KEYS = {
    "lr": "lr",
    "learning-rate": "lr",
    "learning_rate": "lr",
    "local-epochs": "local-epochs",
    "local_epochs": "local-epochs",
    "epochs": "local-epochs",
    "batch-size": "batch-size",
    "batch_size": "batch-size",
}


def _sent_config(reader: ModuleReader, table: ast.Dict) -> list[Found]:
    found = []
    for key, value in zip(table.keys, table.values):
        if isinstance(key, ast.Constant) and key.value in _SENT_KEYS:
            resolved = reader.value(value)
            if resolved is not None and is_number(resolved.value):
                found.append(
                    Found(
                        _SENT_KEYS[key.value],
                        resolved.value,
                        f"{resolved.source} (ConfigRecord sent to the clients)",
                        resolved.line,
                    )
                )
    return found


_OPACUS_ARGUMENTS = {
    "make_private": ("noise_multiplier", "max_grad_norm", "poisson_sampling"),
    "make_private_with_epsilon": ("target_epsilon", "target_delta", "epochs", "max_grad_norm", "poisson_sampling"),
}


def _mechanisms(reader: ModuleReader) -> list[Mechanism]:
    mechanisms = []
    for call in reader.calls():
        name = call_name(call)
        relevant = name in _MECHANISM_CALLS or (_privacy_wrapper(name) and name not in _KNOWN_NAMES)
        if not relevant or reader.branch(call) is False:
            continue  # code the app does not run, or a branch the configuration read does not take
        where = reader.where(call)
        if name == "PrivacyEngine" and reader.argument(call, "noise_multiplier") is not None:
            # Opacus before 1.0: PrivacyEngine(model, sample_rate=..., noise_multiplier=..., max_grad_norm=...)
            arguments = {key: reader.resolved(call, key, key) for key in _OPACUS_ARGUMENTS["make_private"]}
            mechanisms.append(Mechanism("opacus", name, arguments, where))
        elif name in FLOWER_FIXED or name in FLOWER_ADAPTIVE:
            clip = "clipping_norm" if name in FLOWER_FIXED else "initial_clipping_norm"
            arguments = {
                "noise_multiplier": reader.resolved(call, "noise_multiplier", "noise"),
                "clipping_norm": reader.resolved(call, clip, "clip"),
                "num_sampled_clients": reader.resolved(call, "num_sampled_clients", "sampled-clients"),
            }
            if name in FLOWER_ADAPTIVE and arguments["clipping_norm"] is None and reader.argument(call, clip) is None:
                arguments["clipping_norm"] = Found("clip", 0.1, f"{name}'s default initial_clipping_norm")
            mechanisms.append(Mechanism("flower-central", name, arguments, where))
        elif name == "LocalDpMod":
            arguments = {key: reader.resolved(call, key, key) for key in POSITIONAL["LocalDpMod"]}
            mechanisms.append(Mechanism("local-dp", name, arguments, where))
        elif name in _OPACUS_ARGUMENTS:
            arguments = {key: reader.resolved(call, key, key) for key in _OPACUS_ARGUMENTS[name]}
            kind = "opacus" if name == "make_private" else "opacus-epsilon"
            mechanisms.append(Mechanism(kind, name, arguments, where))
        elif name == "SecAggPlusWorkflow" or name == "SecAggWorkflow":
            mechanisms.append(Mechanism("secagg", name, {}, where))
        elif name in NVFLARE_RESULT_FILTERS:  # job.to(PercentilePrivacy(...), site, filter_type=TASK_RESULT)
            mechanisms.append(Mechanism("result-filter", name, {}, where))
        elif _privacy_wrapper(name) and name not in _KNOWN_NAMES:
            if _holds_mechanism(reader, name):
                continue  # the app's own client class (DPCifarClient) around a mechanism read on its own
            noise_by = "client" if name.endswith("Mod") or name.endswith("_mod") or _a_client(name) else "server"
            if "ServerSide" in name or "ClientSide" in name or "Strategy" in name:
                noise_by = "server"
            mechanisms.append(Mechanism("unaccounted", name, {"noise_by": Found("noise-by", noise_by, where)}, where))
        elif name == "ExcludeVars":
            mechanisms.append(
                Mechanism(
                    "exclude-vars", name, {"exclude_vars": reader.resolved(call, "exclude_vars", "withheld")}, where
                )
            )
    mechanisms += _fl4health_dp(reader) + _local_layers(reader)
    for node in reader.names():
        name = node.id if isinstance(node, ast.Name) else node.attr
        if name in ("secaggplus_mod", "secagg_mod") and not isinstance(reader._parents.get(node), ast.alias):
            mechanisms.append(Mechanism("secagg", name, {}, reader.where(node)))
            break
    for index, mechanism in enumerate(mechanisms):
        call = next((c for c in reader.calls() if reader.where(c) == mechanism.source), None)
        taken = reader.branch(call, configured_only=True) if call is not None else True
        if isinstance(taken, str):
            mechanisms[index] = replace(mechanism, condition=taken)
    return mechanisms


def _local_layers(reader: ModuleReader) -> list[Mechanism]:
    """FedBN and the like: a client's get_parameters that sends the state dict without the keys holding a word
    (`[v for name, v in model.state_dict().items() if "bn" not in name]`): those layers stay on the client. Only
    for a client class the app runs (a config's `_target_` names it, the code builds it, or it is the one client
    class that defines get_parameters); else the condition says which classes the choice is between."""
    found = []
    senders = {
        node.name: node
        for peer in reader.peers
        for node in ast.walk(peer.tree)
        if isinstance(node, ast.ClassDef)
        and any(isinstance(item, ast.FunctionDef) and item.name == "get_parameters" for item in node.body)
    }
    for node in ast.walk(reader.tree):
        if not (isinstance(node, ast.FunctionDef) and node.name == "get_parameters"):
            continue
        owner = reader._enclosing(node, ast.ClassDef)
        for comprehension in ast.walk(node):
            if not isinstance(comprehension, (ast.ListComp, ast.GeneratorExp)):
                continue
            loop = comprehension.generators[0]
            part = _SENT_PART.search(ast.unparse(loop.iter))
            if part is not None and part.group(1) in _WHOLE_MODEL:
                part = None  # `self.model.state_dict()`: the whole model is sent
            if part is not None and not loop.ifs and owner is not None:
                # FedPer/FedRep: `model.body.state_dict()` alone is sent; the rest of the model stays local.
                runs = _runs(reader, owner.name, senders)
                if runs is not False:
                    found.append(
                        Mechanism(
                            "sent-part",
                            f"{owner.name}.get_parameters",
                            {"part": Found("sent", part.group(1), reader.where(comprehension))},
                            reader.where(comprehension),
                            None if runs else _undecided(senders),
                        )
                    )
                continue
            if "state_dict" not in ast.unparse(loop.iter) or not isinstance(loop.target, ast.Tuple):
                continue
            key = loop.target.elts[0]
            words = [
                test.left.value
                for test in loop.ifs
                if isinstance(test, ast.Compare)
                and len(test.ops) == 1
                and isinstance(test.ops[0], ast.NotIn)
                and isinstance(test.left, ast.Constant)
                and isinstance(test.left.value, str)
                and ast.unparse(test.comparators[0]) == ast.unparse(key)
            ]
            if not words or owner is None:
                continue
            runs = _runs(reader, owner.name, senders)
            if runs is False:
                continue
            condition = None
            if runs is None:
                condition = _undecided(senders)
            found.append(
                Mechanism(
                    "local-layers",
                    f"{owner.name}.get_parameters",
                    {"words": Found("withheld", words, reader.where(comprehension))},
                    reader.where(comprehension),
                    condition,
                )
            )
    return found


# A get_parameters that sends one submodule's state dict: `self.model_manager.model.body.state_dict().values()`.
_SENT_PART = re.compile(r"\.(\w+)\.state_dict\(\)(\.(values|items)\(\))?$")


# Names a client gives the model itself (`self.model_manager.model.state_dict()` sends all of it).
_WHOLE_MODEL = frozenset({"model", "_model", "net", "network", "module", "base_model"})


def _undecided(senders: dict) -> str:
    return "the client class is " + " or ".join(sorted(senders)) + ", chosen when the app runs"


def _runs(reader: ModuleReader, name: str, senders: dict) -> bool | None:
    """Whether client class `name` is the one the app runs: the one a config's `_target_` names among the client
    classes, else one the code builds, else the only client class that sends parameters; None: not decided."""
    targets = {
        str(value).rsplit(".", 1)[-1]
        for key, (value, _) in reader.config.items()
        if key.rsplit(".", 1)[-1] == "_target_"
    }
    if targets & set(senders):
        return name in targets
    built = {call_name(call) for peer in reader.peers for call in peer.calls()} & set(senders)
    # `client_class = FedRepClient` under `if algorithm == ...`: the class the branch the config takes picks.
    assigned = [
        (node.value.id, peer.branch(node))
        for peer in reader.peers
        for node in ast.walk(peer.tree)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Name) and node.value.id in senders
    ]
    taken = {assigned_name for assigned_name, runs in assigned if runs is True}
    if taken:
        return name in taken
    if any(isinstance(runs, str) for _, runs in assigned):  # a condition rankaudit does not read decides
        return None if any(n == name and isinstance(runs, str) for n, runs in assigned) else False
    if built:
        return name in built
    return True if len(senders) == 1 else None


# FL4Health's instance-level DP clients: Opacus DP-SGD on each client (sample level, Poisson batches), its noise
# multiplier and clipping bound sent by the server from the run's config (config.yaml).
_FL4HEALTH_DP_CLIENTS = ("InstanceLevelDpClient", "InstanceLevelPrivacyClient")
_FL4HEALTH_KEYS = {
    "noise_multiplier": ("noise_multiplier", "client_noise_multiplier"),
    "max_grad_norm": ("clipping_bound", "client_clipping"),
}


def _fl4health_dp(reader: ModuleReader) -> list[Mechanism]:
    """A client class built on FL4Health's InstanceLevelDpClient: DP-SGD with the config's σ and clipping bound
    (None where the config does not give them: the DP settings then ask for noise and clip)."""
    found = []
    for node in ast.walk(reader.tree):
        if not isinstance(node, ast.ClassDef):
            continue
        base = next((call_name(b) for b in node.bases if call_name(b) in _FL4HEALTH_DP_CLIENTS), None)
        if base is None:
            # Another base that says privacy (FL4Health's DPScaffoldClient, an app's own DP client): named, not
            # counted, never left out.
            other = next(
                (
                    call_name(b)
                    for b in node.bases
                    if _privacy_wrapper(call_name(b)) and call_name(b) not in _KNOWN_NAMES
                ),
                None,
            )
            if other is not None:
                noise_by = "client" if "Client" in other else "server"
                where = reader.where(node)
                found.append(Mechanism("unaccounted", other, {"noise_by": Found("noise-by", noise_by, where)}, where))
            continue
        arguments: dict[str, Found | None] = {}
        for argument, keys in _FL4HEALTH_KEYS.items():
            key = next((key for key in keys if key in reader.config), None)
            if key is None:
                arguments[argument] = None
                continue
            value, source = reader.config[key]
            arguments[argument] = Found(argument, value, f"{source} {key}")
        arguments["poisson_sampling"] = Found("poisson_sampling", True, f"{base} (Opacus with Poisson sampling)")
        found.append(Mechanism("opacus", f"{base} (FL4Health)", arguments, reader.where(node)))
    return found


_MECHANISM_CALLS = (
    "PrivacyEngine",
    *FLOWER_FIXED,
    *FLOWER_ADAPTIVE,
    "LocalDpMod",
    "make_private",
    "make_private_with_epsilon",
    "SecAggPlusWorkflow",
    "SecAggWorkflow",
    "ExcludeVars",
)


def _a_client(name: str) -> bool:
    """A client class (DPCifarClient, DpClient): whatever noise it adds, it adds on the client."""
    return name.endswith("Client") and "ClientSide" not in name


def _holds_mechanism(reader: ModuleReader, name: str) -> bool:
    """Whether `name` is a class of the app whose own code sets up a mechanism rankaudit reads (Opacus' engine)."""
    for peer in reader.peers:
        for definition in peer.definitions(name, top_level=True):
            if isinstance(definition, ast.ClassDef) and any(
                isinstance(node, ast.Call) and call_name(node) in _MECHANISM_CALLS for node in ast.walk(definition)
            ):
                return True
    return False


_KNOWN_NAMES = {
    *_FL4HEALTH_DP_CLIENTS,
    *FLOWER_FIXED,
    *FLOWER_ADAPTIVE,
    "LocalDpMod",
    "PrivacyEngine",
    "make_private",
    "make_private_with_epsilon",
}
_PRIVACY_WORDS = re.compile(r"(Privacy|DifferentialPrivacy|^Dp[A-Z]|DP[A-Z]|^dp_|_dp_|clipping_mod$|Clipping)")


def _privacy_wrapper(name: str) -> bool:
    """A call whose name says it clips or adds noise (a wrapper, mod or engine rankaudit has no rule for)."""
    return bool(_PRIVACY_WORDS.search(name)) and not name.startswith(("get_", "add_"))
