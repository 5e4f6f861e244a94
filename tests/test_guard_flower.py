"""The guard as a Flower mod, with real flwr Messages: a real ClientApp with the mod, driven by Flower's own FedAvg
strategy through an in-process Grid (the simulation engine needs Ray, which CI does not install; the grid below
only hands each Message to the ClientApp and returns its reply, as the simulation's transport does)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from uuid import uuid4

import pytest
import torch
from torch import nn

flwr = pytest.importorskip("flwr")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp.grid import Grid  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from rankaudit.guard.flower import BLOCKED_CODE, rankaudit_guard  # noqa: E402


@pytest.fixture(autouse=True)
def server_identity():
    """What Flower's ServerApp runtime sets before a strategy runs: the run, node and task the messages come from."""
    before = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = before


class SmallCNN(nn.Module):
    """An ordinary small CNN: two convolutions, global pooling, a ReLU head."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 3, padding=1), nn.ReLU()
        )
        self.hidden = nn.Linear(16, 32)
        self.out = nn.Linear(32, 10)

    def pooled(self, x):
        return self.features(x).mean(dim=(2, 3))

    def forward(self, x):
        return self.out(torch.relu(self.hidden(self.pooled(x))))


SAMPLES, BATCH = 16, 8
generator = torch.Generator().manual_seed(0)
DATA = [
    (torch.rand(SAMPLES, 3, 12, 12, generator=generator), torch.randint(10, (SAMPLES,), generator=generator))
    for _ in range(2)
]


def local_training(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for start in range(0, len(x), BATCH):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[start : start + BATCH]), y[start : start + BATCH]).backward()
        optimizer.step()


def client_app(**options) -> ClientApp:
    app = ClientApp(
        mods=[rankaudit_guard(SmallCNN, lambda context: DATA[context.node_config["partition-id"]], **options)]
    )

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        model = SmallCNN()
        model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
        x, y = DATA[context.node_config["partition-id"]]
        local_training(model, x, y)
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(x)})}
        )
        return Message(content=content, reply_to=msg)

    return app


class InProcessGrid(Grid):
    """Hands each Message to the ClientApp of its node and returns the replies."""

    def __init__(self, app: ClientApp, nodes: int):
        self.app = app
        self.contexts = {
            node + 1: Context(
                run_id=1, node_id=node + 1, node_config={"partition-id": node}, state=RecordDict(), run_config={}
            )
            for node in range(nodes)
        }

    def set_run(self, run) -> None:
        pass

    @property
    def run(self):
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        raise NotImplementedError("send_and_receive delivers directly")

    def pull_messages(self, message_ids):
        raise NotImplementedError("send_and_receive delivers directly")

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for message in messages:
            message.metadata.__dict__["_message_id"] = str(uuid4())
            replies.append(self.app(message, self.contexts[message.metadata.dst_node_id]))
        return replies


class Recording(FedAvg):
    """FedAvg that keeps every train reply it receives."""

    def __init__(self, **kwargs):
        super().__init__(fraction_evaluate=0.0, min_available_nodes=2, min_train_nodes=2, **kwargs)
        self.received: list[Message] = []

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.received += replies
        return super().aggregate_train(server_round, replies)


class Imprinting(Recording):
    """A server that sends crafted weights: the hidden layer becomes an imprint module on the pooled features
    (every row the same direction, the biases thresholds between the clients' samples, the output columns equal),
    so that neighbouring units differ by one sample (Fowl et al., "Robbing the Fed")."""

    def configure_train(self, server_round, arrays, config, grid):
        state = arrays.to_torch_state_dict()
        model = SmallCNN()
        model.load_state_dict(state)
        with torch.no_grad():
            brightness = torch.cat([model.pooled(x).mean(1) for x, _ in DATA]).sort().values
        thresholds = torch.cat([brightness[:1] - 1.0, (brightness[1:] + brightness[:-1]) / 2])[:32]
        state["hidden.weight"] = torch.full((32, 16), 1 / 16)
        state["hidden.bias"] = -thresholds
        state["out.weight"] = torch.randn(10, 1, generator=torch.Generator().manual_seed(1)).expand(10, 32).clone()
        self.crafted = state
        return super().configure_train(server_round, ArrayRecord(state), config, grid)


def _run(strategy, rounds=2, **options):
    torch.manual_seed(0)
    grid = InProcessGrid(client_app(**options), nodes=2)
    return strategy.start(grid=grid, initial_arrays=ArrayRecord(SmallCNN().state_dict()), num_rounds=rounds)


def test_honest_server_every_round_is_sent(caplog):
    strategy = Recording()
    _run(strategy)
    assert len(strategy.received) == 4
    assert all(not reply.has_error() and reply.has_content() for reply in strategy.received)


def test_imprinting_server_receives_nothing_it_can_read():
    # The imprint reads the 16 globally pooled features, which show little of a 3x12x12 image: sent by default,
    # blocked by a deployment that acts on feature readouts.
    strategy = Imprinting()
    _run(strategy, rounds=1, feature_action="block")
    assert len(strategy.received) == 2
    for reply in strategy.received:
        assert reply.has_error() and not reply.has_content()
        assert reply.error.code == BLOCKED_CODE
        assert "the features of samples" in reply.error.reason


def test_drop_sends_the_update_without_the_rows_that_read_samples():
    strategy = Imprinting()
    _run(strategy, rounds=1, feature_action="drop")
    for reply in strategy.received:
        assert not reply.has_error()
        sent = reply.content["arrays"].to_torch_state_dict()
        # Features move between local steps: the layer that read them is not sent, whole (the crafted weights come
        # back as they went out); the rest of the update is.
        assert torch.equal(sent["hidden.weight"], torch.full((32, 16), 1 / 16))
        assert not torch.equal(sent["features.0.bias"], strategy.crafted["features.0.bias"])


def test_the_run_config_overrides_the_mod_arguments():
    app = client_app(feature_action="drop")
    grid = InProcessGrid(app, nodes=2)
    for context in grid.contexts.values():
        context.run_config["rankaudit-guard-feature-action"] = "block"
    strategy = Imprinting()
    torch.manual_seed(0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(SmallCNN().state_dict()), num_rounds=1)
    assert all(reply.has_error() for reply in strategy.received)


def test_a_message_that_is_not_training_passes_untouched():
    app = client_app()

    @app.evaluate()
    def evaluate(msg, context):
        return Message(RecordDict({"metrics": MetricRecord({"accuracy": 0.5})}), reply_to=msg)

    grid = InProcessGrid(app, nodes=1)
    message = Message(
        RecordDict({"arrays": ArrayRecord(SmallCNN().state_dict()), "config": ConfigRecord({})}), 1, "evaluate"
    )
    reply = grid.send_and_receive([message])[0]
    assert not reply.has_error() and reply.content["metrics"]["accuracy"] == 0.5


# ---- samples(context) as Flower apps have them ---------------------------------------------------------------------


class DictItems:
    """A map-style dataset of dict items, as a Hugging Face partition with a transform gives them."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"img": self.x[index], "label": int(self.y[index])}


def load_data(partition_id: int, num_partitions: int):
    """The shape of Flower's quickstart load_data: a train and a test DataLoader of {"img", "label"} batches."""
    from torch.utils.data import DataLoader

    x, y = DATA[partition_id]
    train = DataLoader(DictItems(x, y), batch_size=BATCH)
    test = DataLoader(DictItems(x[:4], y[:4]), batch_size=BATCH)
    return train, test


@pytest.mark.parametrize(
    "form",
    ["quickstart-pair", "dataloader", "tuple-dataloader", "dataset", "dict-dataset", "tensors", "arrays", "dict"],
)
def test_samples_may_be_what_flower_apps_have(form):
    from torch.utils.data import DataLoader, TensorDataset

    from rankaudit.guard.batch import client_samples

    x, y = DATA[0]
    found = {
        "quickstart-pair": lambda: load_data(0, 2),
        "dataloader": lambda: DataLoader(DictItems(x, y), batch_size=5),
        "tuple-dataloader": lambda: DataLoader(TensorDataset(x, y), batch_size=3),
        "dataset": lambda: TensorDataset(x, y),
        "dict-dataset": lambda: DictItems(x, y),
        "tensors": lambda: (x, y),
        "arrays": lambda: (x.numpy(), y.numpy()),
        "dict": lambda: {"img": x, "label": y},
    }[form]()
    samples, labels, notes = client_samples(found)
    assert torch.equal(samples, x) and torch.equal(labels, y)
    assert notes == (
        ["samples(context) returned 2 DataLoaders: the guard took the first, the training one"]
        if form == "quickstart-pair"
        else []
    )
    alone, none, _ = client_samples(x.numpy())
    assert torch.equal(alone, x) and none is None


@pytest.mark.parametrize(
    "found, words",
    [
        ("img", "returned a str"),
        (7, "returned a int"),
        ({"pixels": torch.zeros(2, 3)}, "keys pixels, and none holds the samples"),
        ((x for x in range(3)), "returned a generator"),
        ([], "returned no samples"),
        (torch.zeros(4, 3, dtype=torch.complex64), "the samples are complex"),
        ((torch.zeros(4, 3), torch.zeros(4, 2, dtype=torch.long)), "labels of shape (4, 2)"),
    ],
)
def test_a_wrong_return_is_one_line_naming_what_is_expected(found, words):
    from rankaudit.errors import UsageError
    from rankaudit.guard.batch import client_samples

    with pytest.raises(UsageError) as raised:
        client_samples(found)
    line = str(raised.value)
    assert words in line and "\n" not in line
    assert any(
        words in line
        for words in (
            "DataLoader",
            "img, image or input_ids",
            "this round's samples",
            "real-valued",
            "one integer class label",
        )
    )


def test_the_quickstart_shape_runs_and_a_wrong_return_blocks_with_one_line(caplog):
    def quickstart_samples(context):
        return load_data(context.node_config["partition-id"], 2)

    app = ClientApp(mods=[rankaudit_guard(SmallCNN, quickstart_samples)])
    app.train()(_train)
    strategy = Recording()
    torch.manual_seed(0)
    strategy.start(grid=InProcessGrid(app, nodes=2), initial_arrays=ArrayRecord(SmallCNN().state_dict()), num_rounds=1)
    assert all(not reply.has_error() for reply in strategy.received)
    assert sum("took the first, the training one" in r.getMessage() for r in caplog.records) == 1  # once per process

    caplog.clear()
    app = ClientApp(mods=[rankaudit_guard(SmallCNN, lambda context: "data/partition-0")])
    app.train()(_train)
    strategy = Recording()
    strategy.start(grid=InProcessGrid(app, nodes=2), initial_arrays=ArrayRecord(SmallCNN().state_dict()), num_rounds=1)
    assert all(reply.has_error() and reply.error.code == BLOCKED_CODE for reply in strategy.received)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and all("returned a str" in line and "DataLoader" in line for line in errors)
    assert all("Traceback" not in (r.exc_text or "") for r in caplog.records)


def test_an_error_in_the_apps_own_code_blocks_with_one_line(caplog):
    """A samples function (or a model) that raises its own error while the guard checks: the update is not sent,
    and one ERROR line names the error, without a traceback."""

    def broken_samples(context):
        raise KeyError("partition-id")

    app = ClientApp(mods=[rankaudit_guard(SmallCNN, broken_samples)])
    app.train()(_train)
    strategy = Recording()
    torch.manual_seed(0)
    strategy.start(grid=InProcessGrid(app, nodes=2), initial_arrays=ArrayRecord(SmallCNN().state_dict()), num_rounds=1)
    assert all(reply.has_error() and reply.error.code == BLOCKED_CODE for reply in strategy.received)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and all("could not check this update: KeyError: 'partition-id'" in e for e in errors)
    assert all("Traceback" not in (r.exc_text or "") and not r.exc_info for r in caplog.records)


def _train(msg: Message, context: Context) -> Message:
    model = SmallCNN()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    x, y = DATA[context.node_config["partition-id"]]
    local_training(model, x, y)
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(x)})})
    return Message(content=content, reply_to=msg)


# ---- the run config may only make the guard stricter -------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, base",
    [
        ("action", "drop", {}),
        ("action", "noise", {}),
        ("action", "noise", {"action": "drop"}),
        ("min-psnr", 60.0, {}),
        ("feature-action", "send", {"feature_action": "block"}),
        ("check-features", False, {}),
        ("energy-budget", 1.0, {"energy_budget": 30.0}),
        ("min-hidden", 0.0, {"energy_budget": 30.0}),
        ("noise-scale", 0.001, {"action": "noise"}),
        ("log", "/tmp/anywhere.jsonl", {}),
        ("seed", 0, {"action": "noise"}),
    ],
)
def test_a_run_config_key_that_weakens_the_guard_is_ignored_with_a_line(key, value, base):
    from rankaudit.settings.guard_options import GuardSettings, from_run_config, guard_settings

    client = guard_settings(base)
    ignored: list[str] = []
    chosen = from_run_config({f"rankaudit-guard-{key}": value, "lr": 0.1}, base=client, ignored=ignored)
    assert chosen == client and chosen != GuardSettings(**{**client.__dict__, key.replace("-", "_"): value})
    assert len(ignored) == 1
    assert f"rankaudit-guard-{key}" in ignored[0] and "ignored" in ignored[0] and "pyproject.toml" in ignored[0]


@pytest.mark.parametrize(
    "key, value, base",
    [
        ("action", "block", {"action": "drop"}),
        ("action", "drop", {"action": "noise"}),
        ("min-psnr", 20.0, {}),
        ("feature-action", "block", {}),
        ("check-features", True, {"check_features": False}),
        ("energy-budget", 20.0, {}),
        ("min-hidden", 0.2, {}),
        ("noise-scale", 3.0, {"action": "noise"}),
    ],
)
def test_a_run_config_key_that_tightens_the_guard_is_taken(key, value, base):
    from rankaudit.settings.guard_options import from_run_config, guard_settings

    ignored: list[str] = []
    chosen = from_run_config({f"rankaudit-guard-{key}": value}, base=guard_settings(base), ignored=ignored)
    assert getattr(chosen, key.replace("-", "_")) == value and ignored == []


def test_the_rule_table_covers_every_setting_or_refuses_it():
    """Every setting is either ordered in the table or never taken from a run config; the table's names are the
    settings' own."""
    from dataclasses import fields

    from rankaudit.settings.guard_options import STRICTER, GuardSettings, _stricter_or_equal

    names = {field.name for field in fields(GuardSettings)}
    assert set(STRICTER) <= names
    assert not _stricter_or_equal("log", "x", None) and not _stricter_or_equal("a_later_setting", 1, 0)
    assert _stricter_or_equal("min_psnr", 20.0, 30.0) and not _stricter_or_equal("min_psnr", 40.0, 30.0)
    assert _stricter_or_equal("feature_action", "block", "drop") and not _stricter_or_equal(
        "feature_action", "send", "drop"
    )


def test_a_launcher_cannot_turn_the_guard_into_drop_or_aim_its_log(tmp_path, caplog):
    # The imprint reads pooled features, which show little of a sample: a strict client blocks such readouts too.
    app = client_app(feature_action="block")
    grid = InProcessGrid(app, nodes=2)
    aimed = tmp_path / "aimed.jsonl"
    for context in grid.contexts.values():
        context.run_config.update({"rankaudit-guard-action": "drop", "rankaudit-guard-log": str(aimed)})
    strategy = Imprinting()
    torch.manual_seed(0)
    strategy.start(grid=grid, initial_arrays=ArrayRecord(SmallCNN().state_dict()), num_rounds=1)
    assert all(reply.has_error() and reply.error.code == BLOCKED_CODE for reply in strategy.received)
    assert not aimed.exists()
    warnings = [r.getMessage() for r in caplog.records if "would weaken" in r.getMessage()]
    assert len(warnings) == 2  # one per key, once per client process (the two nodes share this one)
    assert any("rankaudit-guard-action" in line for line in warnings)
    assert any("rankaudit-guard-log" in line for line in warnings)


# ---- examples/flower_guard: the quickstart app with the guard ------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "flower_guard"


@pytest.fixture
def example_app(monkeypatch):
    pytest.importorskip(
        "sklearn", reason="the example's data are scikit-learn's sample photos: pip install scikit-learn"
    )
    monkeypatch.syspath_prepend(str(EXAMPLE))
    monkeypatch.chdir(EXAMPLE)  # Flower runs an app in its folder: the guard reads its pyproject.toml there
    for name in [name for name in sys.modules if name.startswith("flower_guard")]:
        monkeypatch.delitem(sys.modules, name)
    from flower_guard import client_app, server_app

    return client_app.app, server_app.app


def test_the_example_app_runs_its_rounds_with_one_guard_line_per_client_round(example_app, caplog):
    """The example's own ServerApp (Flower's FedAvg) and ClientApp (the quickstart's training, the guard mod), the
    grid handing each message over as the simulation does: every client-round gets one decision line, and a blocked
    update reaches FedAvg as a failure, never as an abort."""
    client, server = example_app
    grid = InProcessGrid(client, nodes=2)
    run_config = {"num-server-rounds": 1, "fraction-train": 1.0, "local-epochs": 1, "lr": 0.01}
    for context in grid.contexts.values():
        context.node_config["num-partitions"] = 2
        context.run_config.update(run_config)
    server(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("rankaudit guard: {")]
    decisions = [json.loads(line.split(": ", 1)[1]) for line in lines]
    assert [d["round"] for d in decisions] == [1, 1]
    assert all(d["samples"] == 64 and d["action"] in ("send", "block") for d in decisions)
    finished = [r.getMessage() for r in caplog.records if "aggregate_train: Received" in r.getMessage()]
    assert len(finished) == 1


def test_a_log_that_is_a_pipe_is_refused_when_the_mod_is_built(tmp_path):
    import os

    from rankaudit.errors import UsageError

    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(UsageError, match="named pipe"):
        rankaudit_guard(SmallCNN, lambda context: DATA[0], log=str(tmp_path / "pipe"))


def test_the_mod_watches_the_training_it_checks(monkeypatch):
    """The decision reads its tables from the handler's own training steps (the model of the audited class that
    starts from the received weights), and decides as it does from its own pass."""
    from rankaudit.guard.watch import Watch

    covered = []
    tables = Watch.tables
    monkeypatch.setattr(Watch, "tables", lambda self, samples: covered.append(tables(self, samples)) or covered[-1])
    strategy = Recording()
    _run(strategy)
    assert len(covered) == 4 and all(found is not None for found in covered)
    assert all(not reply.has_error() for reply in strategy.received)
    guarded = Imprinting()
    _run(guarded, rounds=1, feature_action="block")
    assert len(covered) == 6 and all(found is not None for found in covered)
    assert all(reply.has_error() and reply.error.code == BLOCKED_CODE for reply in guarded.received)


def _stop_processes_of(home: Path) -> None:
    """End the processes `flwr run` left behind for this FLWR_HOME (its local SuperLink runs detached), found by
    their environment; none elsewhere."""
    import os
    import signal

    marker = f"FLWR_HOME={home}".encode()
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if marker in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGTERM)
        except (OSError, ValueError):
            continue


@pytest.mark.slow
def test_flwr_run_simulates_the_example_app_on_ray(tmp_path):
    """`flwr run . --stream` in the example's folder, Flower's own local SuperLink and Ray simulation (two
    SuperNodes, two rounds), the environment's torch and rankaudit (no runtime environment built per run): one
    guard line per client-round, every update sent, and FedAvg aggregates both clients in each round."""
    import os
    import shutil
    import subprocess

    pytest.importorskip("sklearn", reason="the example's data are scikit-learn's sample photos")
    pytest.importorskip("ray", reason="Flower's simulation runs on Ray: pip install 'flwr[simulation]==1.41.*'")
    bin_dir = str(Path(sys.executable).parent)
    flwr_cli = shutil.which("flwr", path=bin_dir)
    if flwr_cli is None or shutil.which("flower-superlink", path=bin_dir) is None:
        pytest.skip("flwr's commands are not installed beside this Python")
    app = tmp_path / "app"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__"))
    home = tmp_path / "flwr-home"
    root = str(Path(__file__).resolve().parents[1])
    env = {
        **os.environ,
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    try:
        done = subprocess.run(
            [flwr_cli, "run", ".", "--stream"], cwd=app, env=env, capture_output=True, text=True, timeout=540
        )
    finally:
        _stop_processes_of(home)
    log = done.stdout + done.stderr
    decisions = [json.loads(line.split("rankaudit guard: ", 1)[1]) for line in log.splitlines() if "guard: {" in line]
    assert done.returncode == 0, log[-3000:]
    assert sorted(d["round"] for d in decisions) == [1, 1, 2, 2], log[-3000:]
    assert all(d["action"] == "send" and d["samples"] == 64 for d in decisions)
    assert log.count("aggregate_train: Received 2 results and 0 failures") == 2
