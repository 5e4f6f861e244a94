"""Counts each traced call: its op family's rule applied to the facts the trace recorded; the entry the rest calls."""

from __future__ import annotations

from torch import nn

from rankaudit.count import ops
from rankaudit.count.op_counting import Counting, Role
from rankaudit.model.meta_device import MetaShortcuts
from rankaudit.trace.records import NodeRecord, TracedModel
from rankaudit.trace.tracer import trace_model


def trace_and_count(
    model: nn.Module, input_shape, *, input_dtype=None, forward_kwargs: dict | None = None
) -> TracedModel:
    """The model traced on meta (rankaudit.trace.tracer.trace_model, asking this step's registry for each call's
    family) and every record counted."""
    traced = trace_model(model, input_shape, ops, input_dtype=input_dtype, forward_kwargs=forward_kwargs)
    return count_calls(traced)


def count_calls(traced: TracedModel) -> TracedModel:
    """Sets each record's Counting, in place, and refines its family where the count shows what it is (x @ W is a
    linear map); returns the same graph. A rule that reads a parametrised weight (weight_norm) computes it on
    meta: MetaShortcuts answers those functions from their shapes."""
    with MetaShortcuts():
        for node_id in traced.order:
            record = traced.record(node_id)
            if record.counting is None:
                record.counting = _counting(record)
    return traced


def _counting(record: NodeRecord) -> Counting:
    if record.atomic is not None:
        return _atomic_counting(record)
    if record.facts is None:  # an input, or a view of an earlier embedding lookup: unknowns start or pass here
        return Counting(Role.TRANSPARENT)
    family = ops.FAMILIES[record.family]
    counting = family.handler(record.facts)
    record.family = ops.refine_family(family, counting).key
    return counting


def _atomic_counting(record: NodeRecord) -> Counting:
    # One caveat per module call, on its first op; every op inside keeps the count (norms and activations keep the
    # size), whatever the single op does (mean, rsqrt). Parameters are reported where they are read.
    atomic = record.atomic
    params = sum(numel for _, numel in record.direct_params)
    caveat = None
    if atomic.first:
        caveat = f"{atomic.module_type} is not modelled by the rank analysis"
        if atomic.module_params:
            caveat += f"; its {atomic.module_params} parameters are not counted"
        caveat += "; counted as transparent (same size in and out)"
    return Counting(Role.TRANSPARENT, reported_params=params, caveat=caveat)
