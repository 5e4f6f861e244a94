"""The traced graph as layer records (NodeRecord, TracedModel) and the builder that adds one record per call.

The records hold what the trace saw: each call's facts, its op family's key and its operands. Counting them is the
count step's job (rankaudit.count.calls): the trace asks the op registry only which family a call belongs to, for the
family's key and output-shape formula, through the `OpTable` its caller hands it."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.fx as fx
from torch import nn

from rankaudit.trace.inputs import ROLE_DATA, ROLE_TOKENS, InputSpec


@dataclass
class OpFacts:
    """What the tracer knows about one call, with graph values already resolved to (meta) tensors."""

    op: str  # display name: "Conv2d", "conv2d", "relu", "add"
    module: nn.Module | None  # the leaf module for module calls
    args: tuple  # positional arguments, values resolved
    kwargs: dict  # keyword arguments, values resolved
    traced_inputs: list[torch.Size]  # shapes of the operands that depend on the model's input
    output_shape: torch.Size | None  # None when the call returns no single tensor
    output_numel: int
    params: list[nn.Parameter] = field(default_factory=list)  # parameters the call reads, directly or folded in
    # Where each traced operand sits among the arguments: its index, or its keyword (traced_inputs' order).
    traced_positions: tuple[int | str, ...] = ()
    called: str = ""  # the function, method or aten op called (`op` may name the module that holds it)

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        if len(self.args) > index:
            return self.args[index]
        return self.kwargs.get(name, default)

    @property
    def trainable(self) -> int:
        return sum(p.numel() for p in self.params if p.requires_grad)

    @property
    def frozen(self) -> int:
        return sum(p.numel() for p in self.params if not p.requires_grad)

    def trainable_bias(self, position: int = 2) -> int:
        bias = self.module.bias if self.module is not None else self.arg(position, "bias")
        return bias.numel() if isinstance(bias, torch.Tensor) and bias.requires_grad else 0

    @property
    def input_numel(self) -> int:
        return math.prod(self.traced_inputs[0]) if self.traced_inputs else 0


class OpFamilyKey(Protocol):
    """What the trace reads of an op family: its key, and its output-shape formula (None: run the op on meta)."""

    key: str
    shape: Any


class OpTable(Protocol):
    """What the trace asks of the op registry: a call's family, and whether a module is one norm or activation
    (a leaf, whose ops inside are not layers of their own). The count step's registry is one."""

    def family_of(self, kind: str, target: Any) -> OpFamilyKey: ...

    def atomic_kind(self, module: nn.Module) -> str | None: ...


@dataclass(frozen=True)
class AtomicCall:
    """One op of a norm or activation module that export decomposed (LlamaRMSNorm's pow, mean, rsqrt, mul): the
    module's class, its parameter count, and whether this op is the first of the module's call."""

    module_type: str
    module_params: int
    first: bool


@dataclass
class NodeRecord:
    """One traced call that depends on the model's input."""

    id: str  # the graph node's unique name
    name: str  # module qualified name (layer2.0.conv1) or fx node name (add_1)
    op: str  # display: Conv2d, relu, add
    family: str  # the ops registry family key (the count step refines it: x @ W is a linear map)
    counting: Any  # the count step's Counting; None until rankaudit.count.calls counted the record
    output_numel: int  # per sample: traced with batch size 1
    output_shape: tuple[int, ...] | None
    inputs: list[str]  # ids of the traced operands, in argument order
    source: str | None = None  # file:line of the call in the model's code
    # (qualified parameter name, trainable numel) of every parameter that reaches this op other than through
    # another traced op: a module call's own parameters, and parameters among a function's arguments or behind
    # untraced get_attr/expand/reshape chains (cls_token.expand(B, -1, -1) read by a cat). Frozen ones: numel 0.
    direct_params: list[tuple[str, int]] = field(default_factory=list)
    facts: OpFacts | None = None  # what the count step counts; None for inputs and views of them
    atomic: AtomicCall | None = None  # set where the op is part of a decomposed norm or activation module

    @property
    def shown_name(self) -> str:
        """The name a user can find in their model: a module call is its qualified name and class
        (`transformer.drop (Dropout)`); a function call is the op and the code line that makes it (`add at
        net.py:42`), not the graph's internal node name (`add_1`)."""
        if self.op[:1].isupper():  # module calls display their class (Conv2d); functions their op (add, select)
            return self.name if self.op in self.name else f"{self.name} ({self.op})"
        return f"{self.op} at {self.source}" if self.source else self.name


@dataclass
class TokenEmbedding:
    """An embedding lookup of the token ids: the continuous unknowns start at its output."""

    record: str  # the input record it produces
    name: str  # the module (transformer.wte) or the op
    weight: str  # the table's qualified parameter name
    vocab_size: int
    dim: int
    trainable: bool
    token_input: str  # the forward() input whose ids it reads
    tied_with: list[str] = field(default_factory=list)  # other traced ops reading the same table (a tied head)


@dataclass
class TracedModel:
    records: dict[str, NodeRecord]  # node id -> record, for every traced call that depends on the input
    successors: dict[str, list[str]]  # node id -> the records that read its output: edges follow the data
    order: list[str]  # execution order (a topological order)
    input_id: str  # the primary source of unknowns: the input tensor, or its token embedding
    output_ids: list[str]  # the tensor the loss reads: the logits (first output, or one named logits)
    tracer: str  # "torch.fx" or "torch.export"
    fallback_reason: str | None  # why torch.fx was not used
    parameters: int  # all parameters of the model, trainable or not
    # Every record where unknowns start, input_id first: float inputs and token embeddings. Records with no
    # inputs that are not listed here (none today) would carry no unknowns.
    input_ids: list[str] = field(default_factory=list)
    inputs: list[InputSpec] = field(default_factory=list)
    token_embeddings: list[TokenEmbedding] = field(default_factory=list)
    call_notes: list[str] = field(default_factory=list)  # how forward() was called: use_cache=False, ...
    input_starts: dict[str, str] = field(default_factory=dict)  # forward() input -> the record its unknowns start at
    # BatchNorm calls that normalise with the batch's statistics even in eval mode (track_running_stats=False)
    eval_batch_statistics: set[str] = field(default_factory=set)

    def __post_init__(self):
        if not self.input_ids:
            self.input_ids = [self.input_id]

    def record(self, node_id: str) -> NodeRecord:
        return self.records[node_id]

    def ancestors(self, node_id: str) -> set[str]:
        """Every record upstream of node_id (not itself)."""
        return self._reach(node_id, lambda n: self.records[n].inputs)

    def descendants(self, node_id: str) -> set[str]:
        return self._reach(node_id, lambda n: self.successors.get(n, ()))

    def _reach(self, start: str, neighbours) -> set[str]:
        seen, frontier = set(), [start]
        while frontier:
            for neighbour in neighbours(frontier.pop()):
                if neighbour not in seen:
                    seen.add(neighbour)
                    frontier.append(neighbour)
        return seen

    @functools.cached_property
    def graph(self):
        """The same graph as a networkx DiGraph with a "record" attribute per node.

        Built on first use: the counting walks the dicts above, so a plain analysis never pays for importing
        networkx (about 0.14 s, a tenth of a whole run).
        """
        import networkx as nx

        graph = nx.DiGraph()
        for node_id in self.order:
            graph.add_node(node_id, record=self.records[node_id])
        graph.add_edges_from((source, target) for source, targets in self.successors.items() for target in targets)
        return graph


def tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


# Families whose output is a rearrangement of their input's entries: token ids stay token ids through them.
_ID_PRESERVING = {"reshape", "slice", "cat", "stack"}


class ParameterAttribution:
    """Names the parameters that reach a call without passing through another traced op."""

    def __init__(self, parameters_at, traced: set[str]):
        # node -> [(qualified name, parameter)] that the node itself holds (get_attr in fx, placeholders in export)
        self.parameters_at = parameters_at
        # The builder's own set, shared: the walk stops at traced ops, whose parameters are counted at them.
        self.traced = traced

    def direct_params(self, node: fx.Node, own: list[tuple[str, nn.Parameter]] = ()) -> list[tuple[str, int]]:
        """Parameters reaching `node` without passing through a traced op: `own` first, then the untraced chains."""
        found = {name: param for name, param in self.parameters(node, own)}
        return [(name, param.numel() if param.requires_grad else 0) for name, param in found.items()]

    def parameters(self, node: fx.Node, own=()) -> list[tuple[str, nn.Parameter]]:
        """The same parameters as (qualified name, parameter), whether trainable or not."""
        found = {name: param for name, param in own}
        seen, frontier = set(), list(node.all_input_nodes)
        while frontier:
            current = frontier.pop(0)
            if current.name in seen or current.name in self.traced:
                continue
            seen.add(current.name)
            for name, param in self.parameters_at(current):
                found.setdefault(name, param)
            frontier.extend(current.all_input_nodes)
        return list(found.items())


class TokenIdTracker:
    """Follows token ids and masks through the ops that read nothing else, to the embedding lookups of the ids."""

    def __init__(self):
        # Nodes computed from integer or mask inputs alone: no unknowns. Value: the token input whose ids the
        # node still holds (through views and slices), else None (a mask, a comparison, a cumsum of positions).
        self.discrete: dict[str, str | None] = {}
        self.lookups: dict[tuple, str] = {}  # (table, token input, shape) -> the input record of the first lookup

    def add_placeholder(self, node: fx.Node, spec: InputSpec):
        """A forward() input of token ids (held under its token input's name) or a mask (held as None)."""
        self.discrete[node.name] = (spec.same_as or spec.name) if spec.role == ROLE_TOKENS else None

    def follow(self, node: fx.Node, family: OpFamilyKey, value: Any) -> str | None:
        """The token input whose ids `node` embeds, when it is an embedding lookup of them (its output starts the
        unknowns); otherwise None, after noting whether its output still holds ids or only a mask."""
        discrete_args = [a for a in node.all_input_nodes if a.name in self.discrete]
        if not discrete_args:
            return None
        tokens = [self.discrete[a.name] for a in discrete_args if self.discrete[a.name] is not None]
        if family.key == "embedding" and tokens and isinstance(value, torch.Tensor) and value.is_floating_point():
            return tokens[0]
        if family.key in _ID_PRESERVING and tokens:
            self.discrete[node.name] = tokens[0]
        else:
            self.discrete[node.name] = None
        return None


class RecordBuilder:
    """Collects NodeRecords and their edges, whichever tracer produced the calls; it records, the count step counts."""

    def __init__(self, op_table: OpTable, parameters_at=lambda node: ()):
        self.op_table = op_table
        self.records: dict[str, NodeRecord] = {}
        self.successors: dict[str, list[str]] = {}
        self.order: list[str] = []
        self.traced: set[str] = set()
        self.names_used: dict[str, int] = {}
        self.input_id: str | None = None
        self.input_ids: list[str] = []
        self.output_ids: list[str] = []
        self.attribution = ParameterAttribution(parameters_at, self.traced)
        self.token_ids = TokenIdTracker()
        self.token_embeddings: list[TokenEmbedding] = []
        self.atomic_calls_seen: set[str] = set()
        self.input_starts: dict[str, str] = {}

    def unique_name(self, name: str) -> str:
        count = self.names_used.get(name, 0) + 1
        self.names_used[name] = count
        return name if count == 1 else f"{name}#{count}"

    def add_input(
        self,
        node_id: str,
        value: torch.Tensor,
        name: str = "input",
        op: str = "input",
        source: str | None = None,
        direct: list[tuple[str, int]] | None = None,
    ):
        shape = tuple(value.shape)
        record = NodeRecord(
            node_id,
            self.unique_name(name) if name != "input" else name,
            op,
            "input",
            None,
            math.prod(shape),
            shape,
            [],
            source,
            direct or [],
        )
        self._add(record)
        self.input_ids.append(node_id)
        if self.input_id is None:
            self.input_id = node_id

    def add_placeholder(self, node: fx.Node, value: Any, spec: InputSpec | None):
        """A forward() input: float data starts the unknowns here; ids and masks are followed, not counted."""
        if spec is None or not isinstance(value, torch.Tensor):
            return
        if spec.role == ROLE_DATA:
            self.add_input(node.name, value)
            self.input_starts[spec.name] = node.name
        else:
            self.token_ids.add_placeholder(node, spec)

    def _add_token_embedding(
        self,
        node: fx.Node,
        name: str,
        display: str,
        value: torch.Tensor,
        own_params,
        token_input: str,
        source: str | None,
    ):
        """An embedding lookup of token ids: an input record, or a view of an earlier lookup of the same ids."""
        tables = [(n, p) for n, p in self.attribution.parameters(node, own_params) if p.dim() == 2]
        direct = self.attribution.direct_params(node, own_params)
        table_name, table = tables[0] if tables else (name, None)
        key = (table_name, token_input, tuple(value.shape))
        if key in self.token_ids.lookups:
            # The same table looked up with the same ids (a decoder fed the encoder's ids): the same tensor, so
            # the same unknowns; a view of the first lookup, whose table gets both gradients.
            record = NodeRecord(
                node.name,
                self.unique_name(name),
                display,
                "embedding",
                None,
                value.numel(),
                tuple(value.shape),
                [self.token_ids.lookups[key]],
                source,
                direct,
            )
            self._add(record)
            return
        self.add_input(node.name, value, name=name, op=display, source=source, direct=direct)
        self.token_ids.lookups[key] = node.name
        self.input_starts.setdefault(token_input, node.name)
        if table is not None:
            self.token_embeddings.append(
                TokenEmbedding(
                    node.name,
                    self.records[node.name].name,
                    table_name,
                    table.shape[0],
                    table.shape[1],
                    table.requires_grad,
                    token_input,
                )
            )

    def add_call(
        self,
        node: fx.Node,
        kind: str,
        target: Any,
        display: str,
        name: str,
        module: nn.Module | None,
        args: tuple,
        kwargs: dict,
        value: Any,
        params: list[nn.Parameter],
        source: str | None,
        own_params: list[tuple[str, nn.Parameter]] = (),
        atomic: tuple[str, str, nn.Module] | None = None,
    ):
        """One call. `atomic`: (call key, qualified name, module) when the op is part of a norm or activation
        module that export decomposed (LlamaRMSNorm's pow, mean, rsqrt, mul): counted as that one module."""
        family = self.op_table.family_of("module", atomic[2]) if atomic else self.op_table.family_of(kind, target)
        traced_args = [a for a in node.all_input_nodes if a.name in self.traced]
        if not traced_args:
            # Depends on constants, parameters, ids or masks only: not part of the unknowns' flow, unless it is
            # the embedding lookup where token ids become unknowns.
            token_input = self.token_ids.follow(node, family, value)
            if token_input is not None:
                self._add_token_embedding(node, name, display, value, own_params, token_input, source)
            return
        tensors = tensors_in(value)
        if not tensors:
            self.traced.add(node.name)  # e.g. x.size(0): traced, but no tensor to count
            return
        if not any(a.name in self.records for a in traced_args):
            # Reads only the input's shape, e.g. cls_token.expand(x.shape[0], -1, -1): its values do not depend
            # on the input, so it carries no unknowns and is no row (method.md: counting).
            return
        operands = _traced_operands(node, args, kwargs, self.traced)
        operand_shapes = [torch.Size(value.shape) for _, _, value in operands]
        if isinstance(value, torch.Tensor):
            output_shape, output_numel = tuple(value.shape), value.numel()
        else:
            output_shape, output_numel = None, sum(t.numel() for t in tensors)
        facts = OpFacts(
            display,
            module,
            args,
            kwargs,
            operand_shapes,
            torch.Size(output_shape) if output_shape is not None else None,
            output_numel,
            # Every parameter that reaches the call, bare or through untraced ops on parameters (self.w * mask,
            # self.w.t(), self.A @ self.B): those ops are folded into this call, whose weights they are.
            [param for _, param in self.attribution.parameters(node, own_params)] or params,
            tuple(position for position, _, _ in operands),
            target if isinstance(target, str) else getattr(target, "__name__", type(target).__name__),
        )
        direct = self.attribution.direct_params(node, own_params)
        atomic_call = None
        if atomic:
            call_key, name, atomic_module = atomic
            display = type(atomic_module).__name__
            # The module's caveat goes on its first op that reaches the records; every op inside is counted as it.
            first = call_key not in self.atomic_calls_seen
            self.atomic_calls_seen.add(call_key)
            atomic_call = AtomicCall(display, sum(p.numel() for p in atomic_module.parameters()), first)
        # In argument order, a repeated operand as often as it is read: s * s is a product, unlike s + s.
        inputs = [name for _, name, _ in operands if name in self.records]
        inputs += [a.name for a in traced_args if a.name in self.records and a.name not in inputs]
        record = NodeRecord(
            node.name,
            self.unique_name(name),
            display,
            family.key,
            None,
            output_numel,
            output_shape,
            inputs,
            source,
            direct,
            facts,
            atomic_call,
        )
        self._add(record)

    def _add(self, record: NodeRecord):
        self.records[record.id] = record
        for source_id in dict.fromkeys(record.inputs):  # x + x reads x once as far as edges go
            self.successors.setdefault(source_id, []).append(record.id)
        self.order.append(record.id)
        self.traced.add(record.id)


def _traced_operands(node: fx.Node, args: tuple, kwargs: dict, traced: set[str]) -> list[tuple[int | str, str, Any]]:
    """(position, node name, resolved tensor) of each operand that comes from a traced node, in argument order and
    as often as it appears; the position is the argument's index, or its keyword, where the operand sits."""
    found: list[tuple[int | str, str, Any]] = []

    def visit(position, raw, resolved):
        if isinstance(raw, fx.Node):
            if raw.name in traced and isinstance(resolved, torch.Tensor):
                found.append((position, raw.name, resolved))
        elif isinstance(raw, (tuple, list)) and isinstance(resolved, (tuple, list)):
            for r, v in zip(raw, resolved):
                visit(position, r, v)
        elif isinstance(raw, dict) and isinstance(resolved, dict):
            for key in raw:
                visit(position, raw[key], resolved.get(key))

    for index, (raw, resolved) in enumerate(zip(node.args, args)):
        visit(index, raw, resolved)
    for key, raw in node.kwargs.items():
        visit(key, raw, kwargs.get(key))
    return found


def parameters_in(values: Any) -> list[nn.Parameter]:
    return [t for t in tensors_in(values) if isinstance(t, nn.Parameter)]
