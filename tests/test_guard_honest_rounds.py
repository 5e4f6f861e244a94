"""Honest FedAvg through Flower itself, judged by what the server can read: Flower's ServerApp running Flower's FedAvg
strategy, Flower's ClientApp with the rankaudit_guard mod watching the client's own training, the in-process grid of
tests/test_guard_flower.py handing each message over as the simulation does. Four clients, each with its own photo
crops (scikit-learn's sample photographs), ten rounds, for three models: Flower's quickstart CNN, an MLP and a
ResNet-style block (and the MLP once more on 16 crops per client, where honest updates do show photographs). Every
decision's log line is parsed: an update is sent, or the line names the readouts that read a sample, and each one is
formed here from the update the client trained and must show its sample at 30 dB or more. FedAvg must receive
updates, and the global model move, every round."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from torch import nn

flwr = pytest.importorskip("flwr")
pytest.importorskip("sklearn")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import ServerApp  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402
from test_guard_flower import InProcessGrid, server_identity  # noqa: E402, F401 (the fixture is autouse)
from test_guard_psnr import MLP, THRESHOLD, QuickstartCNN, ResidualBlock, photo_crops, psnr, read_pair  # noqa: E402

from rankaudit.guard.flower import BLOCKED_CODE, rankaudit_guard  # noqa: E402

ROUNDS, CLIENTS, LR = 10, 4, 0.01
# (model, crop side, crops per client, batch): the quickstart's 64 crops in batches of 32; and the MLP again on 16
# crops in batches of 8, where honest fc1 units do isolate single photographs (about half its updates block), so
# that the blocks' own readouts are formed and confirmed here.
MODELS = {
    "cnn": (QuickstartCNN, 32, 64, 32),
    "mlp": (lambda: MLP(3 * 8 * 8, 64), 8, 64, 32),
    "res": (ResidualBlock, 16, 64, 32),
    "mlp-16-crops": (lambda: MLP(3 * 8 * 8, 64), 8, 16, 8),
}

# The readouts a block's reasons spell out (rankaudit.guard.decide): one unit's ratio, or two units combined.
RATIO = re.compile(
    r"^(?P<layer>[\w.]+): unit (?P<i>\d+)'s weight-row update over its bias update is sample (?P<s>\d+) at"
)
PAIR = re.compile(
    r"^(?P<layer>[\w.]+): units (?P<i>\d+) and (?P<j>\d+) combined \(row \d+ - (?P<c>\S+) x row \d+, over the same "
    r"of their biases\) is sample (?P<s>\d+) at"
)
FEATURES_SHOWN = re.compile(r"they show each sample at (?P<db>[\d.]+) dB at most")


def partition(client: int, side: int, crops: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``client``'s own crops in [-1, 1], labelled by brightness decile (a task the models can learn)."""
    x = photo_crops(crops, side, seed=1000 + client)
    y = ((x.mean(dim=(1, 2, 3)) + 1) * 5).long().clamp(0, 9)
    return x, y


class Rounds(FedAvg):
    """Flower's FedAvg, keeping each round's replies and the global model it aggregates."""

    def __init__(self):
        super().__init__(fraction_evaluate=0.0, min_available_nodes=CLIENTS, min_train_nodes=CLIENTS)
        self.replies: dict[int, list[Message]] = {}
        self.globals: dict[int, dict[str, torch.Tensor] | None] = {}

    def aggregate_train(self, server_round, replies):
        replies = list(replies)
        self.replies[server_round] = replies
        arrays, metrics = super().aggregate_train(server_round, replies)
        self.globals[server_round] = None if arrays is None else arrays.to_torch_state_dict()
        return arrays, metrics


def apps(make, side: int, crops: int, batch: int, strategy: Rounds, initial: dict[str, torch.Tensor], updates: dict):
    """(ServerApp, ClientApp, each client's (x, y)): the quickstart's shape for model ``make``; the train handler
    keeps what each client received and trained ({(client, round): (received, trained)}), which the test reads
    blocked updates from."""
    data = {client: partition(client, side, crops) for client in range(CLIENTS)}
    client_app = ClientApp(mods=[rankaudit_guard(make, lambda context: data[context.node_config["partition-id"]])])

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        received = msg.content["arrays"].to_torch_state_dict()
        model = make()
        model.load_state_dict(received)
        x, y = data[context.node_config["partition-id"]]
        optimizer = torch.optim.SGD(model.parameters(), lr=msg.content["config"]["lr"], momentum=0.9)
        for start in range(0, len(x), batch):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[start : start + batch]), y[start : start + batch]).backward()
            optimizer.step()
        trained = {name: value.detach().clone() for name, value in model.state_dict().items()}
        updates[(context.node_config["partition-id"], msg.content["config"]["server-round"])] = (received, trained)
        content = RecordDict(
            {"arrays": ArrayRecord(model.state_dict()), "metrics": MetricRecord({"num-examples": len(x)})}
        )
        return Message(content=content, reply_to=msg)

    server_app = ServerApp()

    @server_app.main()
    def main(grid, context: Context) -> None:
        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(initial),
            train_config=ConfigRecord({"lr": LR}),
            num_rounds=ROUNDS,
        )

    return server_app, client_app, data


def best_pair(received: dict, trained: dict, layer: str, sample: torch.Tensor) -> float:
    """The most a server reads of ``sample`` from two units of ``layer`` combined, at the best scale for each pair
    (it chose the weights and knows its scales): (ΔW_i − c·ΔW_j) / (Δb_i − c·Δb_j) against the sample, whose
    squared error is z'Mz / (z'm)² for z = (1, −c), M the Gram of p_k = ΔW_k − v·Δb_k, m = (Δb_i, Δb_j); least
    at z ∝ M⁻¹m. Every pair is ranked by that least error, and the best few are formed and scored directly, beside
    every unit's own ratio."""
    dw = (trained[f"{layer}.weight"] - received[f"{layer}.weight"]).double().flatten(1)
    db = (trained[f"{layer}.bias"] - received[f"{layer}.bias"]).double()
    v = sample.double().flatten()
    p = dw - db[:, None] * v[None, :]
    gram = p @ p.T
    ii, jj = gram.diagonal()[:, None], gram.diagonal()[None, :]
    determinant = (ii * jj - gram**2).clamp_min(1e-300)
    reach = (db[:, None] ** 2 * jj - 2 * db[:, None] * db[None, :] * gram + db[None, :] ** 2 * ii) / determinant
    reach.fill_diagonal_(-math.inf)  # one unit alone is c = 0 of any pair it is in
    ratios = dw / db[:, None]
    best = max((psnr(row, sample) for row in ratios if bool(torch.isfinite(row).all())), default=-math.inf)
    for flat in reach.flatten().topk(8).indices.tolist():
        i, j = divmod(flat, len(db))
        m = torch.stack([db[i], db[j]])
        z = torch.linalg.lstsq(torch.stack([gram[i, [i, j]], gram[j, [i, j]]]), m[:, None]).solution[:, 0]
        if z[0] != 0:
            best = max(best, -missed(float(-z[1] / z[0]), (received, trained, layer, i, j), sample))
    return best


def missed(scale: float, pair: tuple, sample: torch.Tensor) -> float:
    """Minus the PSNR of a pair's readout at ``scale`` against the sample (what a scale search minimises)."""
    readout = read_pair(*pair, scale)
    return -psnr(readout, sample) if bool(torch.isfinite(readout).all()) else math.inf


def confirmed(line: dict, received: dict, trained: dict, x: torch.Tensor) -> dict[int, float]:
    """{sample: PSNR} of what the server reads of each sample the block names, each readout formed here from the
    float32 update: the ones the reasons spell out (a pair at its printed scale, refined within its three
    significant digits), and, for the samples they leave out, the best pair of units in the layers the line
    names."""
    from scipy.optimize import minimize_scalar

    shown: dict[int, float] = {}

    def keep(sample: int, readout: torch.Tensor) -> None:
        if bool(torch.isfinite(readout).all()):
            shown[sample] = max(shown.get(sample, -math.inf), psnr(readout, x[sample]))

    for reason in line["reasons"]:
        if match := RATIO.match(reason):
            i = int(match["i"])
            keep(int(match["s"]), read_pair(received, trained, match["layer"], i, i))
        elif match := PAIR.match(reason):
            pair = (received, trained, match["layer"], int(match["i"]), int(match["j"]))
            sample, printed = int(match["s"]), float(match["c"])
            width = abs(printed) * 5e-3 + 1e-12
            refined = minimize_scalar(
                missed, args=(pair, x[sample]), bounds=(printed - width, printed + width), method="bounded"
            ).x
            for scale in (printed, float(refined)):
                keep(sample, read_pair(*pair, scale))
    for sample in line["exact_samples"]:
        if sample not in shown:
            # Only a layer that reads the input can show the sample itself: a hidden layer's readout stays unconfirmed.
            for layer in [layer for layer in line["layers"] if trained[f"{layer}.weight"][0].numel() == x[0].numel()]:
                shown[sample] = max(shown.get(sample, -math.inf), best_pair(received, trained, layer, x[sample]))
    return shown


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_honest_fedavg_in_flower_blocks_only_what_the_server_reads(name, caplog):
    make, side, crops, batch = MODELS[name]
    torch.manual_seed(0)
    initial = make().state_dict()
    strategy, updates = Rounds(), {}
    server_app, client_app, data = apps(make, side, crops, batch, strategy, initial, updates)
    grid = InProcessGrid(client_app, nodes=CLIENTS)
    trained_order = []
    handler = grid.app

    def app(message, context):  # which client each decision line belongs to, in the order the grid ran them
        trained_order.append((context.node_config["partition-id"], message.content["config"]["server-round"]))
        return handler(message, context)

    grid.app = app
    caplog.set_level("INFO")
    server_app(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))

    lines = [
        r.getMessage().split(": ", 1)[1] for r in caplog.records if r.getMessage().startswith("rankaudit guard: {")
    ]
    decisions = [json.loads(line) for line in lines]
    assert len(decisions) == len(trained_order) == ROUNDS * CLIENTS
    blocked, feature_db = [], []
    for (client, round_number), line in zip(trained_order, decisions):
        assert line["round"] == round_number and line["samples"] == crops
        feature_db += [float(m["db"]) for reason in line["reasons"] if (m := FEATURES_SHOWN.search(reason))]
        if line["action"] == "send":
            assert line["exact_samples"] == [], line
            continue
        assert line["action"] == "block", line
        received, trained = updates[(client, round_number)]
        shown = confirmed(line, received, trained, data[client][0])
        unconfirmed = {s: shown.get(s) for s in line["exact_samples"] if shown.get(s, -math.inf) < THRESHOLD}
        assert line["exact_samples"] and not unconfirmed, (
            f"{name}, round {round_number}, client {client}: blocked, but the server reads {unconfirmed} "
            f"(dB, None: no readout formed) under {THRESHOLD} dB; reasons: {line['reasons']}"
        )
        blocked.append((round_number, client, line["exact_samples"], min(shown[s] for s in line["exact_samples"])))
    assert all(db < THRESHOLD for db in feature_db)
    if name == "mlp-16-crops":
        assert blocked  # the case is here for its blocks, each confirmed above

    # Every round FedAvg received the sent updates (a block arrives as a failure), and the global model moved in
    # every round where a client sent: in every round for the other models (with 16 crops per client the MLP's first
    # layer isolates photographs in every client's round, each block confirmed above, and the model stays put).
    before = initial
    for round_number in range(1, ROUNDS + 1):
        replies = strategy.replies[round_number]
        sent = [
            line for (_, r), line in zip(trained_order, decisions) if r == round_number and line["action"] == "send"
        ]
        assert (sent or name == "mlp-16-crops") and sum(not reply.has_error() for reply in replies) == len(sent)
        assert all(reply.error.code == BLOCKED_CODE for reply in replies if reply.has_error())
        after = strategy.globals[round_number]
        if sent:
            assert after is not None and any(not torch.equal(after[key], before[key]) for key in before)
            before = after
    print(
        f"\n{name}: {ROUNDS * CLIENTS - len(blocked)} sent, {len(blocked)} blocked {blocked}; "
        f"highest feature PSNR {max(feature_db, default=float('nan')):.1f} dB over {len(feature_db)} feature notes"
    )
