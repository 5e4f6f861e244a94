"""The guard as a Flower mod: ``ClientApp(mods=[rankaudit_guard(Net, load_samples)])``.

A Flower mod is a callable (message, context, call_next) -> message around the ClientApp's handlers. On a train
message this one keeps the weights the server sent (the message's ArrayRecord), lets the client train (call_next),
and hands the received and trained weights with the client's samples to rankaudit.guard.decide.Guard. A blocked
update goes back as an error reply, which the server's strategy counts as a failure and aggregates nothing from;
a dropped or noised one replaces the reply's ArrayRecord. Every decision is one JSON line in Flower's log (and in
the file the settings name). flwr is imported when the mod is built, never by rankaudit itself.

Settings, later ones winning: the defaults (block), [tool.rankaudit.guard] in the app's pyproject.toml (the working
directory's), the mod's keyword arguments, then the run config's ``rankaudit-guard-*`` keys where they make the guard
stricter (the run config is whoever launches the run's: a key that would weaken the client's own settings is ignored
with a warning line naming it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from rankaudit.errors import RankauditError
from rankaudit.guard.batch import client_samples, error_line
from rankaudit.guard.decide import Guard, log_record
from rankaudit.settings.guard_options import GuardSettings, from_run_config, guard_settings

# The error code a blocked reply carries (Flower's own codes are small integers; this one is the guard's).
BLOCKED_CODE = 4040


def app_settings(directory: Path | None = None) -> GuardSettings:
    """[tool.rankaudit.guard] of the nearest pyproject.toml at or above ``directory`` (default: the working
    directory, where Flower runs an app), else the defaults."""
    from rankaudit.settings.pyproject import load_settings

    settings = load_settings((directory or Path.cwd()) / "pyproject.toml")
    return settings.guard or GuardSettings()


def _array_record(content):
    """(key, record) of the message content's one ArrayRecord."""
    records = list(content.array_records.items())
    if len(records) != 1:
        raise ValueError(
            f"rankaudit_guard: the train message holds {len(records)} ArrayRecords; the guard checks the one model "
            "the client trains (send one ArrayRecord)"
        )
    return records[0]


def _server_round(msg) -> int | None:
    """The round the message belongs to: its group id where the server set one, else the "server-round" that
    Flower's strategies put in the train config."""
    group = str(msg.metadata.group_id)
    if group.isdigit():
        return int(group)
    for record in msg.content.config_records.values():
        value = record.get("server-round")
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


@contextmanager
def watching(guard: Guard, kind: type, received: dict[str, torch.Tensor]):
    """While the train handler runs: the first model of the audited class that runs forward holding exactly the
    received weights (the one the handler trains) is watched (Guard.watch), so that the decision reads each
    sample's vectors and signals from the training steps instead of running the samples again. A handler that
    trains on other samples than ``samples`` returns leaves records that do not cover them, and the decision then
    makes its own pass."""
    guard.watching = None

    def first_forward(module, args):
        if guard.watching is not None or type(module) is not kind or not _holds(module, received):
            return
        watch = guard.watch(module)
        watch.__enter__()
        watch._started(module, args)  # this forward's own step: its hooks were set after the call began
        handles.append(watch)

    handles: list = []
    hook = torch.nn.modules.module.register_module_forward_pre_hook(first_forward)
    try:
        yield
    finally:
        hook.remove()
        for watch in handles:
            watch.__exit__(None, None, None)


def _holds(module: nn.Module, received: dict[str, torch.Tensor]) -> bool:
    """Whether ``module``'s state is exactly the received weights (names, shapes and values)."""
    state = module.state_dict()
    if set(state) != set(received):
        return False
    return all(
        tuple(value.shape) == tuple(received[name].shape)
        and torch.equal(value.detach().cpu().to(received[name].dtype), received[name])
        for name, value in state.items()
    )


def rankaudit_guard(
    model: nn.Module | Callable[[], nn.Module],
    samples: Callable,
    **options,
):
    """A Flower mod that checks each train reply before it leaves the client.

    ``model``: the audited model, or a callable that builds it (its class). ``samples(context)``: the samples the
    train handler trains on this round, as the app has them: a DataLoader (or the quickstart's (trainloader,
    testloader) pair: the first is taken), a dataset, a tensor or array (batch first), (samples, labels), or dict
    batches ({"img": ..., "label": ...}). ``options``: GuardSettings keys (action="drop", log="guard.jsonl", ...)."""
    from logging import ERROR, INFO, WARNING

    from flwr.app import Error, Message, MessageType
    from flwr.common.logger import log

    base = guard_settings(options, base=app_settings(), where="rankaudit_guard's arguments")
    built: dict[str, nn.Module] = {}
    guards: dict[GuardSettings, Guard] = {}  # one per settings in force: the noise generator runs on across rounds
    said: set[str] = set()  # the warnings and notes already in the log: each once per client process

    def say_once(level: int, line: str) -> None:
        if line not in said:
            said.add(line)
            log(level, "rankaudit guard: %s", line)

    def guard_for(settings: GuardSettings) -> Guard:
        if "model" not in built:
            built["model"] = model if isinstance(model, nn.Module) else model()
        if settings not in guards:
            guards[settings] = Guard(built["model"], settings)
            guards[settings].logger = None  # the decision's line goes to Flower's log, below
        return guards[settings]

    def mod(msg: Message, context, call_next) -> Message:
        if not msg.metadata.message_type.startswith(MessageType.TRAIN):
            return call_next(msg, context)
        _, received_record = _array_record(msg.content)
        received = received_record.to_torch_state_dict()
        ignored: list[str] = []
        try:
            guard = guard_for(from_run_config(dict(context.run_config), base=base, ignored=ignored))
        except RankauditError as exc:
            log(ERROR, "rankaudit guard: %s", exc)
            return Message(
                Error(code=BLOCKED_CODE, reason=f"rankaudit guard could not check this update: {exc}"), reply_to=msg
            )
        with watching(guard, type(built["model"]), received):
            reply = call_next(msg, context)
        if reply.has_error():
            return reply
        key, sent_record = _array_record(reply.content)
        sent = sent_record.to_torch_state_dict()
        try:
            x, y, notes = client_samples(samples(context))
            for line in ignored:
                say_once(WARNING, line)
            for line in notes:
                say_once(INFO, line)
            decision, to_send = guard.decide(received, sent, x, y, round_number=_server_round(msg))
        except Exception as exc:  # noqa: BLE001 - the guard cannot check this update: it is not sent, the line says why
            problem = exc if isinstance(exc, RankauditError) else error_line(exc)
            log(ERROR, "rankaudit guard: could not check this update: %s", problem)
            return Message(
                Error(code=BLOCKED_CODE, reason=f"rankaudit guard could not check this update: {problem}"),
                reply_to=msg,
            )
        log(
            INFO if decision.action == "send" else WARNING,
            "rankaudit guard: %s",
            json.dumps(log_record(decision)),
        )
        if decision.action == "block":
            reason = "rankaudit guard blocked this update: " + "; ".join(decision.reasons + decision.notes)
            return Message(Error(code=BLOCKED_CODE, reason=reason), reply_to=msg)
        if decision.action in ("drop", "noise"):
            names = list(sent_record.keys())
            values = list(to_send.values())
            reply.content[key] = type(sent_record)(torch_state_dict={name: value for name, value in zip(names, values)})
        return reply

    return mod
