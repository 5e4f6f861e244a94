"""The guard as an NVFlare filter: ``rankaudit.guard.nvflare.RankauditGuardFilter`` in a client's filters.

NVFlare filters are FLComponents with ``process(shareable, fl_ctx) -> Shareable``. Registered in the client's
``task_data_filters`` it keeps the weights the server sent (a WEIGHTS DXO); registered in its
``task_result_filters`` (with the same arguments) it hands the received and the trained weights (a WEIGHTS DXO, or a
WEIGHT_DIFF DXO added to the received ones) with the client's samples to rankaudit.guard.decide.Guard. A blocked
result raises NVFlare's ContentBlockedException, so nothing is sent; a dropped or noised one replaces the DXO's data.

nvflare is imported when the class is first named (NVFlare's loader does that when it builds the job), never when
rankaudit is imported; without nvflare installed, naming the class says how to install it.
"""

from __future__ import annotations

import importlib
import json

import numpy as np
import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.guard.decide import Guard, log_record
from rankaudit.settings.guard_options import GuardSettings, guard_settings

# The received weights, by the filter's `key`: NVFlare builds one filter object per chain, and the result filter
# needs what the task-data filter saw.
_RECEIVED: dict[str, dict[str, torch.Tensor]] = {}


def _resolve(value, what: str):
    """A "package.module:name" string imported, or the object itself."""
    if not isinstance(value, str):
        return value
    module, _, name = value.partition(":")
    if not name:
        raise UsageError(f"RankauditGuardFilter {what} {value!r}", 'give "package.module:name"')
    return getattr(importlib.import_module(module), name)


def _tensors(data: dict) -> dict[str, torch.Tensor]:
    return {str(name): torch.as_tensor(np.asarray(value)) for name, value in data.items()}


def _build_filter_class():
    from nvflare.apis.dxo import DataKind, from_shareable
    from nvflare.apis.filter import ContentBlockedException, Filter, FilterChainType, FilterContextKey

    class RankauditGuardFilter(Filter):
        """The client-side guard as an NVFlare filter (docs/guard.md).

        ``model``: the audited model, its class, or "package.module:Name"; ``samples``: a callable (fl_ctx) ->
        samples or (samples, labels), or "package.module:function"; ``key``: pairs the task-data and task-result
        filters of one model; the other keyword arguments are the guard's settings (action, tolerance, log, ...)."""

        def __init__(self, model, samples, key: str = "model", **options):
            super().__init__()
            self.model_source, self.samples_source, self.key = model, samples, key
            self.settings: GuardSettings = guard_settings(options, where="RankauditGuardFilter's arguments")
            self._guard: Guard | None = None

        def _audited(self) -> Guard:
            if self._guard is None:
                model = _resolve(self.model_source, "model")
                model = model if isinstance(model, nn.Module) else model()
                self._guard = Guard(model, self.settings)
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
            if self.key not in _RECEIVED:
                raise ContentBlockedException(
                    "rankaudit guard: the weights this client received were not seen; register "
                    "RankauditGuardFilter in task_data_filters too (same key)"
                )
            received = _RECEIVED[self.key]
            result = _tensors(dxo.data)
            diff = dxo.data_kind == DataKind.WEIGHT_DIFF
            sent = {name: received[name] + value if diff else value for name, value in result.items()}
            found = _resolve(self.samples_source, "samples")(fl_ctx)
            x, y = found if isinstance(found, (tuple, list)) else (found, None)
            y = None if y is None else torch.as_tensor(np.asarray(y))
            current = shareable.get_header("current_round", None)
            decision, to_send = self._audited().decide(
                received,
                sent,
                torch.as_tensor(np.asarray(x)),
                y,
                round_number=current if isinstance(current, int) else None,
            )
            line = "rankaudit guard: " + json.dumps(log_record(decision))
            (self.log_info if decision.action == "send" else self.log_warning)(fl_ctx, line)
            if decision.action == "block":
                raise ContentBlockedException(
                    "rankaudit guard blocked this update: " + "; ".join(decision.reasons + decision.notes)
                )
            if decision.action in ("drop", "noise"):
                dxo.data = {
                    name: (to_send[name] - received[name] if diff else to_send[name]).numpy() for name in result
                }
                return dxo.update_shareable(shareable)
            return shareable

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
