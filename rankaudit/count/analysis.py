"""The counting rules (method.md: counting): chain, residual, merges, batch size -> Result (rows, RA-i, critical layer)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rankaudit.count.op_counting import Role
from rankaudit.result import Architecture, ArchitectureNode, Caveat, LayerRow, ResidualBlock, Result
from rankaudit.trace.records import TracedModel


@dataclass
class _Merge:
    """A residual `add` as method.md: counting reads it."""

    block: ResidualBlock
    first_layer: str | None  # main-path layer reading x1: the shortcut's |W| is added to it
    last_layer: str | None  # main-path layer nearest the add: W_last
    shortcut_ids: list[str] = field(default_factory=list)
    main_ids: list[str] = field(default_factory=list)


def _common_prefix(names: list[str]) -> str:
    parts = [name.split("#")[0].split(".") for name in names]
    prefix = []
    for components in zip(*parts):
        if len(set(components)) != 1:
            break
        prefix.append(components[0])
    # A layer's own name is not a block name: keep the enclosing module's.
    if parts and len(prefix) == min(len(p) for p in parts):
        prefix = prefix[:-1]
    return ".".join(prefix)


def _find_merges(traced: TracedModel) -> tuple[dict[str, _Merge], list[Caveat]]:
    position = {node: i for i, node in enumerate(traced.order)}
    is_layer = {n: traced.record(n).counting.role is Role.LAYER for n in traced.order}
    merges: dict[str, _Merge] = {}
    caveats: list[Caveat] = []
    for node_id in traced.order:
        record = traced.record(node_id)
        if record.counting.role is not Role.ADD or len(record.inputs) < 2:
            continue
        left, right = record.inputs[0], record.inputs[1]
        left_ancestors = traced.ancestors(left) | {left}
        right_ancestors = traced.ancestors(right) | {right}
        common = left_ancestors & right_ancestors
        if not common:
            continue
        fork = max(common, key=position.__getitem__)
        after_fork = traced.descendants(fork)
        fork_and_before = traced.ancestors(fork) | {fork}

        def path(side_ancestors, fork_and_before=fork_and_before, after_fork=after_fork):
            return sorted((side_ancestors - fork_and_before) & after_fork, key=position.__getitem__)

        sides = [path(left_ancestors), path(right_ancestors)]
        layers = [[n for n in side if is_layer[n]] for side in sides]
        if not layers[0] and not layers[1]:
            continue  # e.g. x + relu(x): nothing to fold, the add keeps the count
        # The side with fewer layers is the shortcut; on a tie the second operand, as in `out += identity`.
        shortcut_index = 0 if len(layers[0]) < len(layers[1]) else 1
        main, shortcut = layers[1 - shortcut_index], layers[shortcut_index]
        kind = {0: "identity", 1: "projection"}.get(len(shortcut), "approximate")
        main_set = set(main)
        firsts = [n for n in main if not (traced.ancestors(n) & main_set)]
        names = [traced.record(n).name for n in main + shortcut]
        block = ResidualBlock(
            _common_prefix(names) or record.name,
            node_id,
            fork,
            [traced.record(n).name for n in main],
            [traced.record(n).name for n in shortcut],
            kind,
            shortcut_input=record.inputs[shortcut_index],
        )
        merges[node_id] = _Merge(block, firsts[0] if firsts else None, main[-1] if main else None, shortcut, main)
        if kind == "approximate":
            caveats.append(
                Caveat(
                    "RA103",
                    record.name,
                    record.op,
                    f"add of two multi-layer paths ({len(main)} and {len(shortcut)} layers): the "
                    "shorter plays the shortcut and its weights are folded into the longer path's "
                    "first layer; an approximation",
                    record.source,
                )
            )
    return merges, caveats


def _architecture(
    traced: TracedModel, merges: dict[str, _Merge], shortcut_layers: set[str], block_of: dict[str, str]
) -> Architecture:
    """Contract transparent ops away: inputs, layers, merges and outputs remain, wired as the data flows."""
    kept: dict[str, ArchitectureNode] = {}
    for node_id in traced.order:
        record = traced.record(node_id)
        role = record.counting.role
        if node_id == traced.input_id:
            kind = "input"
        elif role is Role.LAYER:
            kind = "projection" if node_id in shortcut_layers else "layer"
        elif role is Role.ADD and node_id in merges:
            kind = "add"
        elif role is Role.CAT:
            kind = "cat"
        else:
            continue
        block = merges[node_id].block.name if node_id in merges else block_of.get(node_id)
        kept[node_id] = ArchitectureNode(node_id, record.name, record.op, kind, block)
    for output_id in traced.output_ids:
        if output_id not in kept:
            record = traced.record(output_id)
            kept[output_id] = ArchitectureNode(output_id, "output", record.op, "output")
    sources: dict[str, set[str]] = {}  # nearest kept ancestors of every node
    edges: list[tuple[str, str]] = []
    for node_id in traced.order:
        upstream = set()
        for parent in traced.record(node_id).inputs:
            upstream |= {parent} if parent in kept else sources.get(parent, set())
        if node_id in kept:
            edges.extend((source, node_id) for source in sorted(upstream))
            sources[node_id] = {node_id}
        else:
            sources[node_id] = upstream
    return Architecture(list(kept.values()), edges)


def gate_operands(traced: TracedModel, node_id: str) -> set[str]:
    """Operands of a product of data tensors that only scale the other one (an SE gate, attention weights).

    The data operand has the product's shape; the others are broadcast or contracted into it. A product of
    equal shapes (GLU-style gating) names no gate: either operand may be the data.
    """
    record = traced.record(node_id)
    operands = list(dict.fromkeys(record.inputs))
    if len(operands) < 2 or record.counting.role in (Role.ADD, Role.CAT) or record.output_shape is None:
        return set()
    if record.counting.gates is not None:
        return {operands[i] for i in record.counting.gates if i < len(operands)}
    shaped = {o: traced.record(o).output_shape for o in operands}
    data = [o for o, shape in shaped.items() if shape == record.output_shape]
    return {o for o in operands if o not in data} if data else set()


def _data_path(traced: TracedModel) -> set[str]:
    """Records that reach an output other than only through a gate operand (method.md: counting: the rest are side)."""
    reaches: set[str] = set(traced.output_ids)
    for node_id in reversed(traced.order):
        if node_id in reaches:
            continue
        for consumer in traced.successors.get(node_id, ()):
            if consumer in reaches and node_id not in gate_operands(traced, consumer):
                reaches.add(node_id)
                break
    return reaches


def analyze(
    traced: TracedModel,
    batch_size: int = 1,
    *,
    model: str = "",
    model_name: str = "",
    input_shape: tuple[int, ...] = (),
) -> Result:
    """Count every layer as the counting says and find the network's RA-i (method.md: counting) and critical layer."""
    merges, caveats = _find_merges(traced)
    folded_into: dict[str, list[str]] = {}
    shortcut_layers: set[str] = set()
    block_of: dict[str, str] = {}
    for merge in merges.values():
        shortcut_layers.update(merge.shortcut_ids)
        if merge.first_layer is not None and merge.shortcut_ids:
            folded_into.setdefault(merge.first_layer, []).extend(merge.shortcut_ids)
        for layer_id in merge.main_ids:
            block_of.setdefault(layer_id, merge.block.name)  # innermost block first: merges run in order

    B = batch_size
    # method.md: counting: V(t) is the sum of s_ℓ over the *set* of layers upstream of t, each counted once however many
    # paths reach it (summing the operands' V at every merge counts shared history twice per merge).
    terms: dict[str, frozenset] = {}
    term_value: dict[str, int] = {}

    def virtual_of(node: str | None) -> int:
        return sum(term_value[t] for t in terms.get(node, ()))

    on_data_path = _data_path(traced)
    unknowns: dict[str, int] = {}
    own_weights: dict[str, int] = {}
    rows: list[LayerRow] = []
    calls_seen: set[str] = set()
    for node_id in traced.order:
        record = traced.record(node_id)
        counting = record.counting
        primary = record.inputs[0] if record.inputs else None
        if node_id == traced.input_id:
            terms[node_id], unknowns[node_id] = frozenset(), record.output_numel
            continue
        if counting.caveat:
            caveats.append(Caveat("RA101", record.name, record.op, counting.caveat, record.source))
        base_name = record.name.split("#")[0]
        if "#" in record.name and base_name not in calls_seen and counting.weights:
            calls_seen.add(base_name)
            caveats.append(
                Caveat(
                    "RA104",
                    base_name,
                    record.op,
                    f"{base_name} is called more than once; each call is a row with the module's "
                    "full |W|, though the shared gradient is the sum over the calls",
                    record.source,
                )
            )
        if counting.frozen_params:
            caveats.append(
                Caveat(
                    "RA105",
                    record.name,
                    record.op,
                    f"{counting.frozen_params} frozen parameters (requires_grad=False) share no "
                    "gradient and are not counted",
                    record.source,
                )
            )
        gates = gate_operands(traced, node_id)
        upstream = frozenset().union(*(terms.get(i, frozenset()) for i in record.inputs if i not in gates))
        if counting.role is Role.LAYER:
            own_weights[node_id] = counting.weights
            x = unknowns.get(primary, 0)
            z = record.output_numel
            v_in = virtual_of(primary)
            if node_id in shortcut_layers:
                # A shortcut projection is only observed summed with the main path: no row of its own.
                terms[node_id], unknowns[node_id] = terms.get(primary, frozenset()), z
                continue
            folded = folded_into.get(node_id, [])
            weights = counting.weights + sum(traced.record(s).counting.weights for s in folded)
            ra = B * x - weights - B * z - v_in
            term_value[node_id] = max(B * z - B * x, 0) - max(B * x - B * z - weights, 0)
            terms[node_id] = upstream | {node_id}
            unknowns[node_id] = z
            dense = counting.dense_candidate and counting.out_features is not None and B <= counting.out_features
            rows.append(
                LayerRow(
                    record.name,
                    record.op,
                    B * x,
                    weights,
                    B * z,
                    v_in,
                    ra,
                    dense,
                    block=block_of.get(node_id),
                    folded=[traced.record(s).name for s in folded],
                    own_weights=counting.weights,
                    reported_params=counting.reported_params,
                    frozen_params=counting.frozen_params,
                    node=node_id,
                    source=record.source,
                    side=node_id not in on_data_path,
                )
            )
        elif counting.role is Role.ADD and node_id in merges:
            merge = merges[node_id]
            x1, f = unknowns[merge.block.fork], record.output_numel
            w_last = own_weights.get(merge.last_layer, 0) if merge.last_layer else 0
            w_proj = sum(own_weights.get(s, 0) for s in merge.shortcut_ids)
            # Appendix D: the skip carries x1 forward, so only a deficient block as a whole passes a deficit on;
            # the block's term replaces those of the layers inside it.
            block_term = f"block:{node_id}"
            term_value[block_term] = max(B * f - B * x1, 0) - max(B * x1 - B * f - w_last - w_proj, 0)
            terms[node_id] = terms[merge.block.fork] | {block_term}
            unknowns[node_id] = f
        elif counting.role is Role.CAT:
            terms[node_id] = upstream
            unknowns[node_id] = sum(unknowns.get(i, 0) for i in record.inputs)
        else:  # transparent, or an add with nothing to fold
            terms[node_id] = upstream
            passes = counting.passes_unknowns and counting.role is Role.TRANSPARENT and primary in unknowns
            unknowns[node_id] = unknowns[primary] if passes else record.output_numel

    candidates = [row for row in rows if not row.dense and not row.side]
    ra_i, critical_layer = None, None
    if candidates:
        critical = max(candidates, key=lambda row: row.ra_i)  # max() keeps the first: nearest the input
        critical.critical = True
        ra_i, critical_layer = critical.ra_i, critical.name
    return Result(
        model=model,
        model_name=model_name,
        input_shape=tuple(input_shape),
        batch_size=B,
        tracer=traced.tracer,
        parameters=traced.parameters,
        layers=rows,
        blocks=[m.block for m in merges.values()],
        caveats=caveats,
        ra_i=ra_i,
        critical_layer=critical_layer,
        architecture=_architecture(traced, merges, shortcut_layers, block_of),
    )
