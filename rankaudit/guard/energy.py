"""The guard's optional check: each sample's visible energy measured at the received weights, within a time budget.

The measurement is --verify rank's (rankaudit.verify.rank.jacobian.measure with the hidden part, and
rankaudit.verify.rank.hidden.shares): the Jacobian of the batch's gradient with respect to its inputs, and the
share of each sample's energy outside what that gradient sees (docs/method.md, "Each sample, not the batch").
It costs about one double-backward pass per sketch row, so it runs only where a timed gradient says it fits, and
then in a forked process held to the budget: killed when it runs past the budget's seconds, or past half the memory
the machine had free when it started (the check is then "not measured", and says why).
"""

from __future__ import annotations

import multiprocessing
import os
import time

import torch
from torch import nn

# A sketch row costs a double backward, about this many gradients; the estimate errs long.
_GRADIENTS_PER_ROW = 3.0
# The measurement's process may grow by at most this share of the memory free when it starts.
MEMORY_SHARE = 0.5


def _free_memory() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _address_space() -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def within(function, seconds: float):
    """("done", function()) in a forked process held to ``seconds`` and to MEMORY_SHARE of the free memory;
    ("over", why) when it ran past either, or where fork is not available."""
    if "fork" not in multiprocessing.get_all_start_methods():
        return "over", "not measured: a hard time limit needs fork, which this platform does not have"
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    free, size = _free_memory(), _address_space()

    def run():
        import resource

        torch.set_num_threads(1)
        if free is not None and size is not None:
            limit = size + int(MEMORY_SHARE * free)
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            sending.send(("done", function()))
        except MemoryError:
            sending.send(("over", f"not measured: it needed more than {MEMORY_SHARE:.0%} of the free memory"))
        except BaseException as exc:  # noqa: BLE001 - the parent reports it as a note, never as a crash
            sending.send(("over", f"not measured: {type(exc).__name__}: {exc}"[:300]))
        finally:
            os._exit(0)

    process = context.Process(target=run, daemon=True)
    process.start()
    try:
        if receiving.poll(seconds):
            return receiving.recv()
        return "over", f"not measured: it ran past the {seconds:g} s budget and was stopped"
    except EOFError:
        return "over", "not measured: its process ended without a result (out of memory?)"
    finally:
        if process.is_alive():
            process.kill()
        process.join()


def _one_gradient_seconds(net: nn.Module, samples: torch.Tensor, labels: torch.Tensor, loss: str) -> float:
    from rankaudit.verify.client import mean_loss

    started = time.perf_counter()
    with torch.enable_grad():
        net.zero_grad(set_to_none=True)
        mean_loss(net(samples), labels, loss).backward()
    net.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def visible_energy(
    net: nn.Module,
    samples: torch.Tensor,
    labels: torch.Tensor,
    shared: list[str],
    *,
    min_hidden: float,
    budget: float,
) -> dict:
    """{measured, seconds, threshold, and: worst_sample, hidden (its hidden share), below (samples hiding less than
    ``min_hidden``), or a note why it was not measured}. ``net`` holds the received weights; ``shared``: the
    parameters the client sends."""
    import copy

    from rankaudit.verify.client import logits_of, loss_name_for
    from rankaudit.verify.rank import hidden
    from rankaudit.verify.rank.jacobian import measure

    started = time.perf_counter()
    if not samples.is_floating_point():
        return {
            "threshold": min_hidden,
            "budget_seconds": budget,
            "measured": False,
            "note": "not measured: the samples are integers (token ids), which have no energy to hide",
            "seconds": 0.0,
        }
    net = copy.deepcopy(net).to(torch.float64)
    for name, parameter in net.named_parameters():
        parameter.requires_grad_(name in shared)
    x = samples.detach().to(torch.float64)
    with torch.no_grad():
        loss = loss_name_for(logits_of(net(x[:1])).numel())
    trainable = dict(net.named_parameters())
    shared_values = sum(trainable[name].numel() for name in shared if name in trainable)
    rows = min(shared_values, x.numel()) + 16
    estimate = _one_gradient_seconds(net, x, labels, loss) * rows * _GRADIENTS_PER_ROW
    base = {"threshold": min_hidden, "budget_seconds": budget}
    if estimate > budget:
        return {
            **base,
            "measured": False,
            "note": f"not measured: about {estimate:.1f} s for {x.numel()} input values, over the {budget:g} s budget",
            "seconds": round(time.perf_counter() - started, 4),
        }

    def measured():
        measurement = measure(net, x, labels, shared, loss=loss, hidden=True, bn_mode="eval")
        if measurement.invisible is None:
            return None
        found = hidden.shares(x.cpu().numpy(), measurement.invisible)
        return [share.hidden_energy for share in found], measurement.rank, measurement.unknowns

    status, value = within(measured, max(budget - (time.perf_counter() - started), 0.0))
    if status != "done" or value is None:
        return {
            **base,
            "measured": False,
            "note": value if status != "done" else "not measured: the sketch's vectors did not fit in memory",
            "seconds": round(time.perf_counter() - started, 4),
        }
    hidden_shares, rank, unknowns = value
    measured = [(i, h) for i, h in enumerate(hidden_shares) if h is not None]
    worst = min(measured, key=lambda pair: pair[1], default=(None, None))
    return {
        **base,
        "measured": True,
        "worst_sample": worst[0],
        "hidden": worst[1],
        "below": [i for i, h in measured if h < min_hidden],
        "rank": rank,
        "unknowns": unknowns,
        "seconds": round(time.perf_counter() - started, 4),
    }
