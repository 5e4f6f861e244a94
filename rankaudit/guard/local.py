"""`rankaudit guard`: the client's local step(s) run on its batch at the received weights, and the guard's decision
on the update they give.

The batch: a .npz holding ``x`` (the samples, batch first) and ``y`` (one label per sample), or a .npy of samples
with --labels L.npy beside it. The round is the command's round flags over [tool.rankaudit.round]; the local
training is the verifiers' (rankaudit.verify.client.LocalTraining: SGD with momentum or Adam, the batch order
fixed, in float32 as clients train).
"""

from __future__ import annotations

import time

import torch

from rankaudit.errors import UsageError
from rankaudit.guard.batch import check_label_range, load_batch
from rankaudit.result import GuardRun
from rankaudit.settings.guard_options import GuardSettings
from rankaudit.settings.round import Round


def run_guard(
    spec: str,
    weights: str,
    data: str,
    labels: str | None,
    round_: Round,
    settings: GuardSettings,
    *,
    model_args: dict | None = None,
) -> GuardRun:
    """Load the model and the received weights, train locally on the batch, and decide on the update."""
    from rankaudit.guard.decide import Guard
    from rankaudit.guard.readout import architecture_difference
    from rankaudit.model.load import load_model
    from rankaudit.verify.client import LocalTraining, client_mode, logits_of, loss_name_for
    from rankaudit.verify.model import read_state_dict

    started = time.perf_counter()
    x, y = load_batch(data, labels)
    if round_.samples > len(x):
        raise UsageError(
            f"the round trains on {round_.samples} local samples but --data holds {len(x)}",
            f"lower --local-samples to at most {len(x)}, or give a larger batch",
        )
    x, y = x[: round_.samples], y[: round_.samples]
    received = read_state_dict(weights)
    model = load_model(spec, tuple(x.shape[1:]), device="cpu", model_args=model_args).module
    guard = Guard(model, settings)
    training_seconds = 0.0
    if architecture_difference(model, received) is not None:
        decision, _ = guard.decide(received, received, x, y)  # blocked before any training
        loss = "not trained"
    else:
        with torch.no_grad():
            model.load_state_dict(received)
        net = client_mode(model.float(), round_.bn_mode)
        with torch.no_grad():
            classes = logits_of(net(x[:1])).numel()
        loss = loss_name_for(classes)
        if loss == "cross-entropy":
            check_label_range(y, classes)
        labels_for_loss = y if loss == "cross-entropy" else torch.where(y > 0, 1, -1)
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
        decision, _ = guard.decide(received, sent, x, labels_for_loss)
    return GuardRun(
        model=spec,
        weights=weights,
        data=data,
        round=round_,
        loss=loss,
        decision=decision,
        seconds=time.perf_counter() - started,
        training_seconds=training_seconds,
    )
