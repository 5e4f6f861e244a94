"""The single architectural edits of the design review, each a copy of the traced graph to re-count and re-bound."""

from __future__ import annotations

import dataclasses

from torch import nn

from rankaudit.count.calls import trace_and_count
from rankaudit.count.op_counting import Counting, Role
from rankaudit.errors import RankauditError
from rankaudit.result import Result
from rankaudit.trace.records import NodeRecord, TracedModel


def _rebuilt(traced: TracedModel, replaced: dict[str, NodeRecord], dropped: set[str]) -> TracedModel:
    """A copy of the traced graph with some records replaced and some dropped; dead branches are pruned."""
    records = {n: replaced.get(n, traced.records[n]) for n in traced.order if n not in dropped}
    alive, frontier = set(), [n for n in traced.output_ids if n in records]
    while frontier:
        node = frontier.pop()
        if node not in alive:
            alive.add(node)
            frontier.extend(i for i in records[node].inputs if i in records)
    order = [n for n in traced.order if n in alive]
    successors: dict[str, list[str]] = {}
    for node in order:
        for source in dict.fromkeys(records[node].inputs):
            successors.setdefault(source, []).append(node)
    return TracedModel(
        {n: records[n] for n in order},
        successors,
        order,
        traced.input_id,
        [n for n in traced.output_ids if n in alive],
        traced.tracer,
        traced.fallback_reason,
        traced.parameters,
    )


def _params_of(record: NodeRecord) -> int:
    return record.counting.weights + record.counting.frozen_params + record.counting.reported_params


def cut_skips(traced: TracedModel, base: Result) -> list[tuple[str, str, TracedModel, int]]:
    edits = []
    for block in base.blocks:
        add = traced.record(block.merge)
        main_input = next(i for i in add.inputs if i != block.shortcut_input)
        shortcut = set()
        if block.shortcut_input != block.fork:
            shortcut = (
                (traced.ancestors(block.shortcut_input) | {block.shortcut_input})
                - traced.ancestors(block.fork)
                - {block.fork}
            )
        passthrough = dataclasses.replace(add, inputs=[main_input], counting=Counting(Role.TRANSPARENT))
        removed = sum(_params_of(traced.record(n)) for n in shortcut)
        detail = (
            "remove the identity skip"
            if not shortcut
            else f"remove the skip and its projection ({', '.join(block.shortcut_layers)})"
        )
        edits.append((block.name, detail, _rebuilt(traced, {block.merge: passthrough}, shortcut), -removed))
    return edits


def _produces_output(traced: TracedModel, node_id: str) -> bool:
    """True when no weighted layer stands between this node and a model output."""
    frontier, seen = [node_id], set()
    while frontier:
        node = frontier.pop()
        if node in traced.output_ids:
            return True
        for successor in traced.successors.get(node, ()):
            record = traced.record(successor)
            if successor not in seen and not (record.counting.role is Role.LAYER and record.counting.weights):
                seen.add(successor)
                frontier.append(successor)
    return False


def _narrowed(traced: TracedModel, node_id: str, width: int) -> tuple[TracedModel, int] | str:
    """The graph with one layer's output channels cut to `width`, and Δ params; or why it cannot be done."""
    layer = traced.record(node_id)
    old = layer.counting.out_features
    scale = width / old
    replaced = {
        node_id: dataclasses.replace(
            layer,
            output_numel=layer.output_numel * width // old,
            counting=dataclasses.replace(
                layer.counting,
                weights=layer.counting.weights * width // old,
                bias_params=layer.counting.bias_params * width // old,
                out_features=width,
            ),
        )
    }
    delta = replaced[node_id].counting.weights - layer.counting.weights
    frontier = list(traced.successors.get(node_id, ()))
    while frontier:
        node = frontier.pop()
        if node in replaced:
            continue
        record = traced.record(node)
        role = record.counting.role
        if role is Role.LAYER and record.counting.weights:
            # The consumer loses input channels: its weights shrink, its bias and output stay.
            kernel = record.counting.weights - record.counting.bias_params
            weights = round(kernel * scale) + record.counting.bias_params
            replaced[node] = dataclasses.replace(record, counting=dataclasses.replace(record.counting, weights=weights))
            delta += weights - record.counting.weights
            continue
        if role in (Role.ADD, Role.CAT):
            return f"its output meets another path at {record.name} ({record.op})"
        if node in traced.output_ids:
            return "its channels reach the model's output"
        if record.output_numel * width % old:
            return f"{record.name} ({record.op}) does not keep whole channels"
        replaced[node] = dataclasses.replace(record, output_numel=record.output_numel * width // old)
        frontier.extend(traced.successors.get(node, ()))
    return _rebuilt(traced, replaced, set()), delta


def narrow_edits(traced: TracedModel, base: Result, skipped: list[str]) -> list[tuple[str, str, TracedModel, int]]:
    edits = []
    rows = {row.node: row for row in base.layers}
    for node_id in traced.order:
        record = traced.record(node_id)
        counting = record.counting
        row = rows.get(node_id)
        if row is None or counting.role is not Role.LAYER or not counting.weights or not counting.out_features:
            continue
        if _produces_output(traced, node_id):
            continue  # the logits: their width is the number of classes
        channels = counting.out_features
        per_channel = counting.weights / channels
        positions = record.output_numel // channels
        # Locally deficient (method.md: counting without V): B|x| - c·w_c - B·c·P > 0, so c < B|x| / (w_c + B·P).
        limit = row.inputs / (per_channel + base.batch_size * positions)
        width = min(channels - 1, int(limit) - (1 if limit == int(limit) else 0))
        if row.inputs - row.weights - row.outputs > 0 or width < 1:
            continue  # already deficient, or even one channel is over-determined
        narrowed = _narrowed(traced, node_id, width)
        if isinstance(narrowed, str):
            skipped.append(f"narrow {record.name}: {narrowed}")
            continue
        edits.append((record.name, f"{_width_name(record.op)} {channels} -> {width}", *narrowed))
    return edits


def _width_name(op: str) -> str:
    """What the user's constructor calls the width a narrow edit cuts: a convolution's channels, else its features."""
    return "out_channels" if "conv" in op.lower() else "out_features"


def narrowed_width(detail: str) -> int:
    """The width a narrow edit's detail ("out_channels 16 -> 5") cuts the layer to."""
    return int(detail.rsplit("->", 1)[1])


def narrow_readers(traced: TracedModel, layer: str) -> list[str]:
    """The weighted layers that read the channels of `layer` (a record's name), through the ops between that keep
    whole channels: the layers a narrowed design's readers lose inputs of."""
    node_id = next(n for n in traced.order if traced.record(n).name == layer)
    readers, seen, frontier = [], set(), list(traced.successors.get(node_id, ()))
    while frontier:
        node = frontier.pop()
        if node in seen:
            continue
        seen.add(node)
        record = traced.record(node)
        if record.counting.role is Role.LAYER and record.counting.weights:
            readers.append(record.name)
            continue
        frontier.extend(traced.successors.get(node, ()))
    return readers


def remove_bias_edits(traced: TracedModel) -> list[tuple[str, str, TracedModel, int]]:
    edits = []
    for node_id in traced.order:
        record = traced.record(node_id)
        bias = record.counting.bias_params
        if record.counting.role is Role.LAYER and bias:
            counting = dataclasses.replace(record.counting, weights=record.counting.weights - bias, bias_params=0)
            edits.append(
                (
                    record.name,
                    f"bias=False ({bias} parameters)",
                    _rebuilt(traced, {node_id: dataclasses.replace(record, counting=counting)}, set()),
                    -bias,
                )
            )
    return edits


def changed_stride(old: tuple[int, ...]) -> tuple[int, ...]:
    """The stride edit: a strided conv made unstrided, an unstrided one strided by 2."""
    return tuple(1 for _ in old) if max(old) > 1 else tuple(2 for _ in old)


def stride_edits(module: nn.Module, input_shape, skipped: list[str]) -> list[tuple[str, str, TracedModel, int]]:
    """Stride changes move every later shape, so these few are re-traced on meta rather than re-counted."""
    edits = []
    for name, conv in module.named_modules():
        if not isinstance(conv, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            continue
        old = conv.stride
        new = changed_stride(old)
        conv.stride = new
        try:
            edited = trace_and_count(module, input_shape)
        except RankauditError:
            skipped.append(f"stride {name} {old} -> {new}: a later layer needs the old shape")
            continue
        finally:
            conv.stride = old
        edits.append((name, f"stride {'x'.join(map(str, old))} -> {'x'.join(map(str, new))}", edited, 0))
    return edits
