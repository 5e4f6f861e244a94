"""The guard as a Flower mod, with real flwr Messages: a real ClientApp with the mod, driven by Flower's own FedAvg
strategy through an in-process Grid (the simulation engine needs Ray, which CI does not install; the grid below
only hands each Message to the ClientApp and returns its reply, as the simulation's transport does)."""

from __future__ import annotations

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
