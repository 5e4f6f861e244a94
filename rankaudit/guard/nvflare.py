"""The guard as an NVFlare filter: ``job.to(RankauditGuardFilter(model="net:Net", samples="data:samples"), site)``.

NVFlare filters are FLComponents with ``process(shareable, fl_ctx) -> Shareable``. Given to a client with the Job
API's ``to()``, the filter registers itself in both of the site's chains: in ``task_data_filters`` it keeps the
weights the server sent (a WEIGHTS DXO); in ``task_result_filters`` it hands the received and the trained weights (a
WEIGHTS DXO, or a WEIGHT_DIFF DXO added to the received ones) with the client's samples to
rankaudit.guard.decide.Guard. Everything it is built from is a string, a number or a dict (the model and the samples
by import path, the settings by key), so that the job's exported config carries all of it.

A blocked result goes on as the weights the server sent (a zero WEIGHT_DIFF), weighted as next to nothing
(NUM_STEPS_CURRENT_ROUND 1e-9) and marked ``rankaudit_guard: block`` in its DXO meta: NVFlare's FedAvg and
ScatterAndGather average it in at no weight beside the other sites' results, and when every site blocks the global
model stays where it was; the run goes on. Nothing of the client's update leaves. A dropped or noised result
replaces the DXO's data. Each decision is one line in NVFlare's log, a block a warning without a traceback.

nvflare is imported when the class is first named (NVFlare's loader does that when it builds the job), never when
rankaudit is imported; without nvflare installed, naming the class says how to install it.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import torch
from torch import nn

from rankaudit.errors import RankauditError, UsageError
from rankaudit.guard.batch import client_samples, error_line
from rankaudit.guard.decide import Guard, log_record
from rankaudit.settings.guard_options import GuardSettings, guard_settings

# The received weights, by the filter's `key`: NVFlare builds one filter object per chain, and the result filter
# needs what the task-data filter saw.
_RECEIVED: dict[str, dict[str, torch.Tensor]] = {}
# A blocked result's aggregation weight: positive (NVFlare reads 0 or less as "not given" and weighs it 1), and so
# small that beside any other site's result it counts for nothing.
BLOCKED_WEIGHT = 1e-9
BLOCKED_MARK = "rankaudit_guard"
TRAIN_TASK = "train"  # the task name of NVFlare's FedAvg and ScatterAndGather


def import_path(value, what: str) -> str:
    """A "package.module:name" string for `value`: the string itself (checked), or where a class or function
    defined at a module's top level can be imported from; anything else (an instance, a lambda, a class of a
    script's __main__) is one line asking for the import path, which the exported job config can carry."""
    if isinstance(value, str):
        module, _, name = value.partition(":")
        if not module or not name:
            raise UsageError(f"RankauditGuardFilter {what} {value!r}", 'give "package.module:name"')
        return value
    module, name = getattr(value, "__module__", None), getattr(value, "__qualname__", "")
    if module and module != "__main__" and name.isidentifier():
        try:
            found = getattr(importlib.import_module(module), name, None)
        except ImportError:
            found = None
        if found is value:
            return f"{module}:{name}"
    raise UsageError(
        f"RankauditGuardFilter {what} is a {type(value).__name__}, which a job's config cannot carry",
        f'name it by import path, e.g. {what}="my_job.net:Net" (a module the job ships or the site has installed)',
    )


def _resolve(path: str, what: str):
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise UsageError(
            f"RankauditGuardFilter {what} {path!r} could not be imported ({exc})",
            "ship that module with the job (beside the client script) or install it on the site",
        ) from None


def _tensors(data: dict) -> dict[str, torch.Tensor]:
    return {str(name): torch.as_tensor(np.asarray(value)) for name, value in data.items()}


def _like(value, original):
    """`value` (a tensor) in the type the framework sent the original in: a NumPy array or a tensor."""
    if isinstance(original, torch.Tensor):
        return value.to(original.dtype)
    return value.numpy().astype(np.asarray(original).dtype, copy=False)


def _build_filter_class():
    from nvflare.apis.dxo import DataKind, from_shareable
    from nvflare.apis.filter import Filter, FilterChainType, FilterContextKey
    from nvflare.apis.fl_constant import FLMetaKey
    from nvflare.job_config.defs import FilterType

    class RankauditGuardFilter(Filter):
        """The client-side guard as an NVFlare filter (docs/guard.md).

        ``model``: "package.module:Name", the audited model's class (or a function that builds it), with
        ``model_args`` its keyword arguments; ``samples``: "package.module:function", a function (fl_ctx) -> the
        samples the client trains on this round, in any form the Flower mod takes (a DataLoader, a dataset, tensors,
        arrays, (samples, labels), dict batches); ``key``: pairs the task-data and task-result filters of one model;
        ``settings``: the guard's settings by key ({"action": "drop", ...}), the other keyword arguments too."""

        def __init__(
            self,
            model: str,
            samples: str,
            key: str = "model",
            model_args: dict | None = None,
            settings: dict | None = None,
            **options,
        ):
            super().__init__()
            # Stored under the arguments' own names: NVFlare's Job API exports a component's arguments from them.
            self.model = import_path(model, "model")
            self.samples = import_path(samples, "samples")
            self.key = str(key)
            self.model_args = dict(model_args or {})
            self.settings = {**(settings or {}), **options}
            self._settings: GuardSettings = guard_settings(self.settings, where="RankauditGuardFilter's settings")
            self._guard: Guard | None = None

        def add_to_fed_job(self, job, ctx, **kwargs):
            """``job.to(filter, "site-1")``: into the site's task-data and task-result chains (the result filter
            needs the weights the task brought), for ``tasks`` (default ["train"]: NVFlare looks a chain up by the
            task's exact name, so "*" would never apply); rankaudit is the site's installed package, not code the
            job ships."""
            tasks = kwargs.get("tasks") or [TRAIN_TASK]
            chains = (
                [kwargs["filter_type"]] if kwargs.get("filter_type") else [FilterType.TASK_DATA, FilterType.TASK_RESULT]
            )
            for chain in chains:
                job.add_filter(obj=self, filter_type=chain, tasks=tasks, ctx=ctx)
            config = getattr(job, "job", None)
            packages = list(getattr(config, "app_packages", None) or [])
            if config is not None and "rankaudit" not in packages:
                config.set_app_packages(packages + ["rankaudit"])

        def _audited(self) -> Guard:
            if self._guard is None:
                model = _resolve(self.model, "model")
                if not isinstance(model, nn.Module):
                    model = model(**self.model_args)
                self._guard = Guard(model, self._settings)
                self._guard.logger = None  # the decision's line goes to NVFlare's log, once
            return self._guard

        def process(self, shareable, fl_ctx):
            try:
                dxo = from_shareable(shareable)
            except ValueError:
                return shareable  # not a DXO: nothing the guard reads
            chain = self.get_prop(FilterContextKey.CHAIN_TYPE, FilterChainType.TASK_RESULT_CHAIN)
            if chain == FilterChainType.TASK_DATA_CHAIN:
                if dxo.data_kind == DataKind.WEIGHTS:
                    _RECEIVED[self.key] = _tensors(dxo.data)
                return shareable
            if dxo.data_kind not in (DataKind.WEIGHTS, DataKind.WEIGHT_DIFF):
                return shareable
            diff = dxo.data_kind == DataKind.WEIGHT_DIFF
            received = _RECEIVED.get(self.key)
            if received is None:
                return self._blocked(
                    dxo,
                    shareable,
                    fl_ctx,
                    None,
                    "the weights this client received were not seen: add the filter with job.to(filter, site), "
                    "which puts it in the task-data chain too (same key)",
                )
            try:
                result = _tensors(dxo.data)
                sent = {name: received[name] + value if diff else value for name, value in result.items()}
                x, y, notes = client_samples(_resolve(self.samples, "samples")(fl_ctx), f"samples {self.samples}")
                current = shareable.get_header("current_round", None)
                decision, to_send = self._audited().decide(
                    received, sent, x, y, round_number=current if isinstance(current, int) else None
                )
            except RankauditError as exc:  # the guard cannot check this result: it is not sent
                return self._blocked(dxo, shareable, fl_ctx, received, f"could not check this update: {exc}")
            except Exception as exc:  # noqa: BLE001 - the job's own code (samples, model) failed: the same, said
                problem = f"could not check this update: {error_line(exc)}"
                return self._blocked(dxo, shareable, fl_ctx, received, problem)
            for note in notes:
                self.log_info(fl_ctx, "rankaudit guard: " + note)
            line = "rankaudit guard: " + json.dumps(log_record(decision))
            if decision.action == "block":
                return self._blocked(dxo, shareable, fl_ctx, received, None, line)
            (self.log_info if decision.action == "send" else self.log_warning)(fl_ctx, line)
            if decision.action in ("drop", "noise"):
                dxo.data = {
                    name: _like(to_send[name] - received[name] if diff else to_send[name], dxo.data[name])
                    for name in result
                }
                return dxo.update_shareable(shareable)
            return shareable

        def _blocked(self, dxo, shareable, fl_ctx, received, problem: str | None, line: str | None = None):
            """The result as the weights the server sent (a zero difference), at next to no aggregation weight,
            marked; one warning line (the decision's, or the problem)."""
            if line is None:
                line = f"rankaudit guard: {problem}; nothing of this update is sent"
                self.log_error(fl_ctx, line, fire_event=False)
            else:
                self.log_warning(fl_ctx, line)
            diff = dxo.data_kind == DataKind.WEIGHT_DIFF
            data = {}
            for name, original in dxo.data.items():
                if diff:
                    data[name] = _like(torch.zeros_like(torch.as_tensor(np.asarray(original))), original)
                elif received is not None and name in received:
                    data[name] = _like(received[name], original)
            if not diff and (received is None or set(data) != set(dxo.data)):
                # Nothing the server sent to send back: an empty result, which FedAvg skips.
                data = {}
            dxo.data = data
            dxo.set_meta_prop(FLMetaKey.NUM_STEPS_CURRENT_ROUND, BLOCKED_WEIGHT)
            dxo.set_meta_prop(BLOCKED_MARK, "block")
            return dxo.update_shareable(shareable)

    return RankauditGuardFilter


_BUILT: dict[str, type] = {}
# The filter class, a subclass of NVFlare's Filter: built by __getattr__ below the first time it is named, so that
# importing this module needs no nvflare (an annotation only: the name stays unbound until then).
RankauditGuardFilter: type


def __getattr__(name: str):
    if name == "RankauditGuardFilter":
        try:
            if name not in _BUILT:
                _BUILT[name] = _build_filter_class()
            return _BUILT[name]
        except ImportError as exc:
            raise ImportError(
                f"RankauditGuardFilter needs NVFlare ({exc}); install it with `pip install nvflare`"
            ) from exc
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
