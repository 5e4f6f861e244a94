"""`rankaudit guard`: the client's local step(s) run on its batch at the received weights, and the guard's decision
on the update they give.

The batch: a .npz holding ``x`` (the samples, batch first) and ``y`` (one label per sample), or a .npy of samples
with --labels L.npy beside it. The round is the command's round flags over [tool.rankaudit.round]; the local
training is the verifiers' (rankaudit.verify.client.LocalTraining: SGD with momentum or Adam, the batch order
fixed, in float32 as clients train).

The model's code runs only in the worker (train_and_measure): it trains and measures, and hands back plain arrays.
The decision (decide_round) is made in the process that started it, where that code never ran: it reads the batch
and the received weights itself, and forms every readout from them and the update.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rankaudit.errors import UsageError
from rankaudit.guard.batch import as_model_input, check_label_range, load_batch
from rankaudit.guard.measure import Architecture, Measurements, measure, packed, unpacked
from rankaudit.guard.readout import architecture_difference
from rankaudit.result import GuardRun
from rankaudit.settings.guard_options import GuardSettings
from rankaudit.settings.round import Round


def run_guard(
    spec: str, weights: str, data: str, labels: str | None, round_: Round, settings: GuardSettings
) -> GuardRun:
    """The command's run: the local training and the measurements in the model's worker, the decision here."""
    from rankaudit.model import worker

    started = time.perf_counter()
    args = (spec, weights, data, labels, round_, settings)
    local = worker.run(train_and_measure, *args, limited=False, phase="the local training on the --data samples")
    return decide_round(local, *args, since=started)


@dataclass
class LocalRound:
    """What the model's worker hands the deciding process: plain arrays, read without running code."""

    architecture: Architecture  # the audited model's names, shapes and dtypes
    sent: dict[str, tuple] | None  # the weights after the local training, packed (None: not trained)
    measured: Measurements | None  # None: the received weights are not the audited model's
    loss: str
    training_seconds: float
    measure_seconds: float = 0.0  # the guard's measurements, in the worker


def train_and_measure(
    spec: str,
    weights: str,
    data: str,
    labels: str | None,
    round_: Round,
    settings: GuardSettings,
    *,
    model_args: dict | None = None,
) -> LocalRound:
    """In the model's worker: load the model and the received weights, train locally on the batch, and measure
    what the decision needs from the model."""
    from rankaudit.model.load import load_model
    from rankaudit.verify.client import LocalTraining, client_mode, logits_of, loss_name_for
    from rankaudit.verify.model import read_state_dict

    x, y = _batch(data, labels, round_)
    received = read_state_dict(weights)
    loaded = load_model(spec, tuple(x.shape[1:]), device="cpu", model_args=model_args)
    model = loaded.module
    architecture = Architecture.of(model)
    if architecture_difference(architecture, received) is not None:
        return LocalRound(architecture, None, None, "not trained", 0.0)  # blocked before any training
    with torch.no_grad():
        model.load_state_dict(received)
    net = client_mode(model.float(), round_.bn_mode)
    x = as_model_input(net, x, loaded.input_dtype)
    with torch.no_grad():
        classes = logits_of(net(x[:1])).numel()
    loss = loss_name_for(classes)
    if loss == "cross-entropy":
        check_label_range(y, classes)
    labels_for_loss = _labels_for(loss, y)
    # torch.func's first use in a process sets up its transforms (seconds on a small machine): done on a scalar
    # before the clock starts, so that the training's time is the training's.
    torch.func.grad(lambda t: (t * t).sum())(torch.ones(1))
    trained = time.perf_counter()
    training = LocalTraining(net, round_, loss, [])
    with torch.no_grad():
        final = training.trajectory(x, labels_for_loss)[-1]
    training_seconds = time.perf_counter() - trained
    if not all(bool(torch.isfinite(value).all()) for value in final.values()):
        raise UsageError("the local training diverged at these weights", "lower --lr or --local-epochs")
    sent = {**received, **{name: value.to(received[name].dtype) for name, value in final.items()}}
    measuring = time.perf_counter()
    measured, _ = measure(model, received, sent, x, labels_for_loss, settings, judge_now=True)
    plain = {name: packed(value) for name, value in sent.items()}
    return LocalRound(architecture, plain, measured, loss, training_seconds, time.perf_counter() - measuring)


def _batch(data: str, labels: str | None, round_: Round) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = load_batch(data, labels)
    if round_.samples > len(x):
        raise UsageError(
            f"the round trains on {round_.samples} local samples but --data holds {len(x)}",
            f"lower --local-samples to at most {len(x)}, or give a larger batch",
        )
    return x[: round_.samples], y[: round_.samples]


def _labels_for(loss: str, y: torch.Tensor) -> torch.Tensor:
    return y if loss == "cross-entropy" else torch.where(y > 0, 1, -1)


def decide_round(
    local: LocalRound,
    spec: str,
    weights: str,
    data: str,
    labels: str | None,
    round_: Round,
    settings: GuardSettings,
    *,
    since: float | None = None,
) -> GuardRun:
    """Where no model code ran: read the batch and the received weights again, and decide on the worker's update
    from its measurements (the input layers' readouts from this process's own samples)."""
    from rankaudit.guard.decide import Guard
    from rankaudit.verify.model import read_state_dict

    started = time.perf_counter()
    x, y = _batch(data, labels, round_)
    received = read_state_dict(weights)
    sent = received
    if local.sent is not None:
        sent = {
            name: unpacked(value).to(received[name].dtype) for name, value in local.sent.items() if name in received
        }
        sent = {**received, **sent}
    y = _labels_for(local.loss, y) if local.loss != "not trained" else y
    decision, _ = Guard(None, settings).decide_measured(
        local.architecture, local.measured, received, sent, x, y, started=started
    )
    decision.seconds += local.measure_seconds  # the guard's time: its measurements in the worker, and the decision
    return GuardRun(
        model=spec,
        weights=weights,
        data=data,
        round=round_,
        loss=local.loss,
        decision=decision,
        seconds=time.perf_counter() - (started if since is None else since),
        training_seconds=local.training_seconds,
    )
