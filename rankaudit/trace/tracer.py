"""fx (fallback torch.export) -> graph of layer records: trace_model, the one entry point of the trace."""

from __future__ import annotations

import torch
from torch import nn

from rankaudit.errors import TraceError
from rankaudit.trace.code_location import first_line, where_raised
from rankaudit.trace.export_trace import trace_with_export
from rankaudit.trace.fx_trace import trace_with_fx
from rankaudit.trace.inputs import (
    ROLE_TOKENS,
    TOKEN_DTYPE_FIX,
    check_inputs_given,
    forward_parameters,
    forward_switches,
    input_specs,
    meta_example,
    wants_token_ids,
)
from rankaudit.trace.records import OpTable, RecordBuilder, TracedModel


def _tied_tables(builder: RecordBuilder):
    for embedding in builder.token_embeddings:
        embedding.tied_with = [
            record.name
            for record in builder.records.values()
            if record.id != embedding.record
            and record.family != "embedding"
            and any(name == embedding.weight for name, _ in record.direct_params)
        ]


def _prune_to_outputs(builder: RecordBuilder):
    """Keep the records the logits depend on: a cache, an auxiliary head or hidden states beside the logits
    receive no gradient from the loss."""
    if not builder.output_ids:
        return
    alive, frontier = set(), list(builder.output_ids)
    while frontier:
        node = frontier.pop()
        if node not in alive and node in builder.records:
            alive.add(node)
            frontier.extend(builder.records[node].inputs)
    builder.order = [n for n in builder.order if n in alive]
    builder.records = {n: builder.records[n] for n in builder.order}
    builder.successors = {
        source: [t for t in targets if t in alive] for source, targets in builder.successors.items() if source in alive
    }
    builder.input_ids = [n for n in builder.input_ids if n in alive]
    if builder.input_id not in alive:
        builder.input_id = builder.input_ids[0] if builder.input_ids else None
    builder.token_embeddings = [e for e in builder.token_embeddings if e.record in alive]
    builder.input_starts = {name: node for name, node in builder.input_starts.items() if node in alive}


def _mixes_cpu_with_meta(error: BaseException) -> bool:
    seen, current = set(), error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        text = str(current)
        if "at least two devices" in text and "meta" in text and "cpu" in text:
            return True
        current = current.__cause__ or current.__context__
    return False


def _export_on_meta(model, specs, examples, switches, op_table):
    """torch.export; when forward() makes a tensor without naming a device (torch.zeros(n, 3) for an RNN's first
    state), that tensor lands on the CPU beside the meta inputs and the op that mixes them fails: export again
    with the meta device as the default, where such a factory makes the tensor it makes on the input's device
    when the model runs. Only then: a forward() that computes Python values with CPU tensors keeps them."""
    try:
        return trace_with_export(model, specs, examples, switches, op_table)
    except TraceError:
        raise
    except Exception as error:
        if not _mixes_cpu_with_meta(error):
            raise
    with torch.device("meta"):
        return trace_with_export(model, specs, examples, switches, op_table)


def trace_model(
    model: nn.Module, input_shape, op_table: OpTable, *, input_dtype=None, forward_kwargs: dict | None = None
) -> TracedModel:
    """Trace with torch.fx; where symbolic tracing fails, with torch.export (non-strict). All on meta. The records
    are not counted yet: rankaudit.count.calls counts them (`op_table` is its registry, asked for families only).

    `input_shape` is one per-sample shape, or a dict of them by forward() parameter name (INPUT_SHAPE);
    `input_dtype` a dtype or a dict of them (INPUT_DTYPE; integer inputs are ids or masks).
    """
    model.eval()  # batch statistics need more than one sample; the counts do not depend on the mode
    specs = input_specs(model, input_shape, input_dtype)
    switches, notes = forward_switches(model, forward_kwargs)
    if any(spec.same_as for spec in specs):
        notes += [f"{spec.name}={spec.same_as}" for spec in specs if spec.same_as]
    parameters, _ = forward_parameters(model)
    given = {spec.name for spec in specs} | set(switches)
    required = [name for name, p in parameters.items() if p.default is p.empty and name not in given]
    check_inputs_given(required, specs)
    examples = {spec.name: meta_example(spec) for spec in specs}
    fallback_reason = None
    try:
        builder, tracer = trace_with_fx(model, specs, examples, switches, op_table), "torch.fx"
    except TraceError:
        raise
    except Exception as fx_error:
        from rankaudit.model.supervise import is_out_of_memory

        if is_out_of_memory(fx_error):  # over the memory limit: the other tracer would take as much (exit 3)
            raise
        fallback_reason = f"torch.fx: {first_line(fx_error)}{where_raised(fx_error)}"
        try:
            builder, tracer = _export_on_meta(model, specs, examples, switches, op_table), "torch.export"
        except TraceError:
            raise
        except Exception as export_error:
            raise TraceError(
                f"could not trace the model. {fallback_reason}; "
                f"torch.export: {first_line(export_error)}{where_raised(export_error)}",
                TOKEN_DTYPE_FIX
                if wants_token_ids(export_error)
                else "remove data-dependent control flow from forward() (branches on tensor values), "
                "or move it into a function marked with torch.fx.wrap",
            ) from export_error
    _prune_to_outputs(builder)
    if builder.input_id is None:
        tokens = [spec.name for spec in specs if spec.role == ROLE_TOKENS]
        if tokens and not builder.token_embeddings:
            raise TraceError(
                f"no embedding reads the token ids {', '.join(tokens)}, so no unknowns start anywhere",
                "feed token ids to an nn.Embedding (or F.embedding), or give the input a float dtype "
                "if it is data (--input-dtype float32)",
            )
        raise TraceError("the model's output does not depend on its input", "give forward() an input it uses")
    _tied_tables(builder)
    parameters = sum(p.numel() for p in model.parameters())
    return TracedModel(
        builder.records,
        builder.successors,
        builder.order,
        builder.input_id,
        builder.output_ids,
        tracer,
        fallback_reason,
        parameters,
        input_ids=list(builder.input_ids),
        inputs=specs,
        token_embeddings=builder.token_embeddings,
        call_notes=notes,
        input_starts=builder.input_starts,
        eval_batch_statistics=_statistics_without_running_values(model, builder.records),
    )


def _statistics_without_running_values(model: nn.Module, records) -> set[str]:
    """The BatchNorm calls that keep no running statistics: they normalise with the batch's own in eval mode too."""
    modules = dict(model.named_modules())
    found = set()
    for node_id, record in records.items():
        module = modules.get(record.name.split("#")[0]) if record.family == "norm" else None
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is None:
            found.add(node_id)
    return found
