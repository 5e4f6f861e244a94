"""fx (fallback torch.export) -> graph of layer records (networkx view on demand), shapes propagated on meta."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import logging
import math
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from rankaudit import ops
from rankaudit.errors import TraceError, UsageError

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OWN_DIR = str(Path(__file__).resolve().parent)


@dataclass
class NodeRecord:
    """One traced call that depends on the model's input."""

    id: str  # the graph node's unique name
    name: str  # module qualified name (layer2.0.conv1) or fx node name (add_1)
    op: str  # display: Conv2d, relu, add
    family: str  # the ops registry family key
    counting: ops.Counting
    output_numel: int  # per sample: traced with batch size 1
    output_shape: tuple[int, ...] | None
    inputs: list[str]  # ids of the traced operands, in argument order
    source: str | None = None  # file:line of the call in the model's code
    # (qualified parameter name, trainable numel) of every parameter that reaches this op other than through
    # another traced op: a module call's own parameters, and parameters among a function's arguments or behind
    # untraced get_attr/expand/reshape chains (cls_token.expand(B, -1, -1) read by a cat). Frozen ones: numel 0.
    direct_params: list[tuple[str, int]] = field(default_factory=list)


# What an input of forward() carries. Token ids are no continuous unknowns: the unknowns start at the
# embedding's output. Masks and other ids (positions, segment types) carry none.
ROLE_DATA, ROLE_TOKENS, ROLE_MASK, ROLE_IDS = "data", "tokens", "mask", "ids"


@dataclass
class InputSpec:
    """One tensor the trace feeds to forward(), per sample (the batch dimension is added)."""

    name: str  # forward()'s parameter name
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str  # data | tokens | mask | ids
    positional: bool = False  # the single unnamed input: passed positionally
    same_as: str | None = None  # fed the same ids as another input (an encoder-decoder's decoder_input_ids)

    @property
    def carries_unknowns(self) -> bool:
        return self.role in (ROLE_DATA, ROLE_TOKENS)


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


def _is_user_file(filename: str) -> bool:
    resolved = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    return not (
        filename.startswith("<")
        or resolved.startswith(_TORCH_DIR)
        or resolved.startswith(_OWN_DIR)
        or "/site-packages/" in resolved
        or "/lib/python" in resolved
    )


def _source_from_stack(stack: str | None) -> str | None:
    """The innermost frame of the model's own code in an fx/export stack trace."""
    if not stack:
        return None
    frames = [(f, int(line)) for f, line in _FRAME.findall(stack) if _is_user_file(f)]
    if not frames:
        return None
    filename, line = frames[-1]
    return f"{_relative(filename)}:{line}"


def _relative(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


def _where(exc: BaseException) -> str:
    """file:line of the model's code that raised, for the one-line error."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if frames:
        return f" (at {_relative(frames[-1].filename)}:{frames[-1].lineno})"
    stack_hit = _source_from_stack(str(exc))
    return f" (at {stack_hit})" if stack_hit else ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."


def _tensors_in(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    fx.node.map_aggregate(value, lambda v: found.append(v) if isinstance(v, torch.Tensor) else None)
    return found


# Families whose output is a rearrangement of their input's entries: token ids stay token ids through them.
_ID_PRESERVING = {"reshape", "slice", "cat", "stack"}


class _GraphBuilder:
    """Collects NodeRecords and their edges, whichever tracer produced the calls."""

    def __init__(self, parameters_at=lambda node: ()):
        # node -> [(qualified name, parameter)] that the node itself holds (get_attr in fx, placeholders in export)
        self.parameters_at = parameters_at
        self.records: dict[str, NodeRecord] = {}
        self.successors: dict[str, list[str]] = {}
        self.order: list[str] = []
        self.traced: set[str] = set()
        self.names_used: dict[str, int] = {}
        self.input_id: str | None = None
        self.input_ids: list[str] = []
        self.output_ids: list[str] = []
        # Nodes computed from integer or mask inputs alone: no unknowns. Value: the token input whose ids the
        # node still holds (through views and slices), else None (a mask, a comparison, a cumsum of positions).
        self.discrete: dict[str, str | None] = {}
        self.embeddings: dict[tuple, str] = {}  # (table, token input, shape) -> the input record
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
            ops.Counting(ops.Role.TRANSPARENT),
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
            self.discrete[node.name] = (spec.same_as or spec.name) if spec.role == ROLE_TOKENS else None

    def direct_params(self, node: fx.Node, own: list[tuple[str, nn.Parameter]] = ()) -> list[tuple[str, int]]:
        """Parameters reaching `node` without passing through a traced op: `own` first, then the untraced chains."""
        found = {name: param for name, param in self._direct_parameters(node, own)}
        return [(name, param.numel() if param.requires_grad else 0) for name, param in found.items()]

    def _direct_parameters(self, node: fx.Node, own=()) -> list[tuple[str, nn.Parameter]]:
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

    def _follow_ids(
        self, node: fx.Node, family: ops.OpFamily, name: str, display: str, value: Any, own_params, source: str | None
    ):
        """An op on ids or masks alone: an embedding of token ids starts the unknowns; others pass ids on."""
        discrete_args = [a for a in node.all_input_nodes if a.name in self.discrete]
        if not discrete_args:
            return
        tokens = [self.discrete[a.name] for a in discrete_args if self.discrete[a.name] is not None]
        if family.key == "embedding" and tokens and isinstance(value, torch.Tensor) and value.is_floating_point():
            self._add_token_embedding(node, name, display, value, own_params, tokens[0], source)
        elif family.key in _ID_PRESERVING and tokens:
            self.discrete[node.name] = tokens[0]
        else:
            self.discrete[node.name] = None

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
        tables = [(n, p) for n, p in self._direct_parameters(node, own_params) if p.dim() == 2]
        direct = self.direct_params(node, own_params)
        table_name, table = tables[0] if tables else (name, None)
        key = (table_name, token_input, tuple(value.shape))
        if key in self.embeddings:
            # The same table looked up with the same ids (a decoder fed the encoder's ids): the same tensor, so
            # the same unknowns; a view of the first lookup, whose table gets both gradients.
            record = NodeRecord(
                node.name,
                self.unique_name(name),
                display,
                "embedding",
                ops.Counting(ops.Role.TRANSPARENT),
                value.numel(),
                tuple(value.shape),
                [self.embeddings[key]],
                source,
                direct,
            )
            self._add(record)
            return
        self.add_input(node.name, value, name=name, op=display, source=source, direct=direct)
        self.embeddings[key] = node.name
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
        family = ops.family_of("module", atomic[2]) if atomic else ops.family_of(kind, target)
        traced_args = [a for a in node.all_input_nodes if a.name in self.traced]
        if not traced_args:
            # Depends on constants, parameters, ids or masks only: not part of the unknowns' flow.
            self._follow_ids(node, family, name, display, value, own_params, source)
            return
        tensors = _tensors_in(value)
        if not tensors:
            self.traced.add(node.name)  # e.g. x.size(0): traced, but no tensor to count
            return
        if not any(a.name in self.records for a in traced_args):
            # Reads only the input's shape, e.g. cls_token.expand(x.shape[0], -1, -1): its values do not depend
            # on the input, so it carries no unknowns and is no row (spec §5).
            return
        operand_shapes = [torch.Size(v.shape) for v in _traced_operand_values(node, args, kwargs, self.traced)]
        if isinstance(value, torch.Tensor):
            output_shape, output_numel = tuple(value.shape), value.numel()
        else:
            output_shape, output_numel = None, sum(t.numel() for t in tensors)
        facts = ops.OpFacts(
            display,
            module,
            args,
            kwargs,
            operand_shapes,
            torch.Size(output_shape) if output_shape is not None else None,
            output_numel,
            params,
        )
        direct = self.direct_params(node, own_params)
        if atomic:
            call_key, name, atomic_module = atomic
            display = type(atomic_module).__name__
            counting = self._atomic_counting(
                call_key, display, direct, sum(p.numel() for p in atomic_module.parameters())
            )
        else:
            counting = family.handler(facts)
            family = ops.refine_family(family, counting)
        inputs = [a.name for a in traced_args if a.name in self.records]
        record = NodeRecord(
            node.name,
            self.unique_name(name),
            display,
            family.key,
            counting,
            output_numel,
            output_shape,
            inputs,
            source,
            direct,
        )
        self._add(record)

    def _atomic_counting(
        self, call_key: str, display: str, direct: list[tuple[str, int]], module_params: int
    ) -> ops.Counting:
        # One caveat per module call, on its first op; every op inside keeps the count (norms and activations
        # keep the size), whatever the single op does (mean, rsqrt). Parameters are reported where they are read.
        params = sum(numel for _, numel in direct)
        first = call_key not in self.atomic_calls_seen
        self.atomic_calls_seen.add(call_key)
        caveat = None
        if first:
            caveat = f"{display} is not modelled by the rank analysis"
            if module_params:
                caveat += f"; its {module_params} parameters are not counted"
            caveat += "; counted as transparent (same size in and out)"
        return ops.Counting(ops.Role.TRANSPARENT, reported_params=params, caveat=caveat)

    def _add(self, record: NodeRecord):
        self.records[record.id] = record
        for source_id in dict.fromkeys(record.inputs):  # x + x reads x once as far as edges go
            self.successors.setdefault(source_id, []).append(record.id)
        self.order.append(record.id)
        self.traced.add(record.id)


def _traced_operand_values(node: fx.Node, args: tuple, kwargs: dict, traced: set[str]) -> list[torch.Tensor]:
    """The resolved tensor values of the operands that come from traced nodes, in argument order."""
    values: list[torch.Tensor] = []

    def visit(raw, resolved):
        if isinstance(raw, fx.Node):
            if raw.name in traced and isinstance(resolved, torch.Tensor):
                values.append(resolved)
        elif isinstance(raw, (tuple, list)) and isinstance(resolved, (tuple, list)):
            for r, v in zip(raw, resolved):
                visit(r, v)
        elif isinstance(raw, dict) and isinstance(resolved, dict):
            for key in raw:
                visit(raw[key], resolved.get(key))

    visit(tuple(node.args), args)
    visit(dict(node.kwargs), kwargs)
    return values


def _parameters_in(values: Any) -> list[nn.Parameter]:
    return [t for t in _tensors_in(values) if isinstance(t, nn.Parameter)]


class _MetaShapeRecorder(fx.Interpreter):
    """Runs a symbolically traced module on meta tensors and records each call's counting facts."""

    def __init__(self, module: fx.GraphModule, builder: _GraphBuilder, specs: dict[str, InputSpec]):
        super().__init__(module)
        self.builder = builder
        self.specs = specs
        self.calls: dict[str, int] = {}
        # A tied parameter has one name however many modules hold it: the first, as named_parameters() gives it.
        self.canonical = {id(p): name for name, p in module.named_parameters()}
        builder.parameters_at = self.parameters_at

    def parameter_name(self, parameter: nn.Parameter, fallback: str) -> str:
        return self.canonical.get(id(parameter), fallback)

    def parameters_at(self, node: fx.Node) -> list[tuple[str, nn.Parameter]]:
        if node.op == "get_attr":
            value = self.fetch_attr(node.target)
            return [(self.parameter_name(value, node.target), value)] if isinstance(value, nn.Parameter) else []
        if node.op == "call_module":
            return [
                (self.parameter_name(p, f"{node.target}.{local}"), p)
                for local, p in self.fetch_attr(node.target).named_parameters()
            ]
        return []

    def _family(self, n: fx.Node) -> tuple[str, Any, ops.OpFamily | None]:
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            return "module", module, ops.family_of("module", module)
        if n.op == "call_function":
            return "function", n.target, ops.family_of("function", n.target)
        if n.op == "call_method":
            return "method", n.target, ops.family_of("method", n.target)
        return n.op, n.target, None

    def _evaluate(self, n: fx.Node, target: Any, family: ops.OpFamily | None) -> Any:
        if family is not None and family.shape is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            shape = family.shape(target, args, kwargs)
            if shape is not None:
                return torch.empty(shape, device="meta")
        return super().run_node(n)

    def run_node(self, n: fx.Node) -> Any:
        kind, target, family = self._family(n)
        try:
            value = self._evaluate(n, target, family)
        except TraceError:
            raise
        except Exception as exc:
            label = n.target if n.op == "call_module" else n.name
            raise TraceError(
                f"shape propagation failed at {label}: {_first_line(exc)}{_where(exc)}",
                _TOKEN_DTYPE_FIX
                if _wants_token_ids(exc)
                else "check the input shape (--input-shape or INPUT_SHAPE) against the model's first layer",
            ) from exc
        if n.op == "placeholder":
            self.builder.add_placeholder(n, value, self.specs.get(n.name))
        elif n.op in ("call_module", "call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            source = n.meta.get("rankaudit_source")
            if n.op == "call_module":
                module = self.fetch_attr(n.target)
                self.builder.add_call(
                    n,
                    "module",
                    module,
                    type(module).__name__,
                    n.target,
                    module,
                    args,
                    kwargs,
                    value,
                    list(module.parameters()),
                    source,
                    [(self.parameter_name(p, f"{n.target}.{local}"), p) for local, p in module.named_parameters()],
                )
            elif n.op == "call_function":
                display = getattr(n.target, "__name__", str(n.target))
                self.builder.add_call(
                    n,
                    "function",
                    n.target,
                    display,
                    n.name,
                    None,
                    args,
                    kwargs,
                    value,
                    _parameters_in((args, kwargs)),
                    source,
                )
            else:
                self.builder.add_call(
                    n,
                    "method",
                    n.target,
                    n.target,
                    n.name,
                    None,
                    args,
                    kwargs,
                    value,
                    _parameters_in((args, kwargs)),
                    source,
                )
        elif n.op == "output":
            self.builder.output_ids = _output_choice(n.args[0] if n.args else None, self.builder.records)
        return value


def _output_choice(structure: Any, records: dict[str, NodeRecord]) -> list[str]:
    """The logits among forward()'s outputs: an entry named `logits` (dict, ModelOutput), else the first
    traced tensor; caches and hidden states beside them carry no loss."""
    leaves: list[tuple[str | None, Any]] = []

    def walk(value, key=None):
        if isinstance(value, fx.Node):
            leaves.append((key, value))
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(v, k)
        elif isinstance(value, (tuple, list)):
            for v in value:
                walk(v, key if len(value) == 1 else None)

    walk(structure)
    traced = [(key, node.name) for key, node in leaves if node.name in records]
    named = [name for key, name in traced if key == "logits"]
    if named:
        return named[:1]
    return [traced[0][1]] if traced else []


class _SourceRecordingTracer(fx.Tracer):
    """torch.fx's tracer, noting for each node the model-code line that created it.

    fx's own record_stack_traces imports much of torch on first use (over a second); a frame walk is enough.
    Norm and activation modules of other libraries (LlamaRMSNorm, NewGELUActivation) are leaves, like torch.nn's.
    """

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and not _is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            node.meta["rankaudit_source"] = f"{_relative(frame.f_code.co_filename)}:{frame.f_lineno}"
        return node

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return super().is_leaf_module(m, module_qualified_name) or ops.atomic_kind(m) is not None


_CONCRETE_SUFFIX = re.compile(r"_\d+$")


def _trace_fx(
    model: nn.Module, specs: list[InputSpec], examples: dict[str, torch.Tensor], switches: dict[str, Any]
) -> _GraphBuilder:
    tracer = _SourceRecordingTracer()
    graph = tracer.trace(model, concrete_args=switches or None)
    module = fx.GraphModule(tracer.root, graph)
    by_name = {spec.name: spec for spec in specs}
    positional = [spec for spec in specs if spec.positional]
    values, placeholder_specs, missing = [], {}, []
    for node in graph.nodes:
        if node.op != "placeholder":
            continue
        target = str(node.target)
        if positional and not values:
            spec = positional[0]
        else:
            spec = by_name.get(target)
        if spec is not None:
            values.append(examples[spec.name])
            placeholder_specs[node.name] = spec
        elif target in switches or _CONCRETE_SUFFIX.sub("", target) in switches:
            values.append(switches.get(target, switches.get(_CONCRETE_SUFFIX.sub("", target))))
        elif node.args:
            values.append(node.args[0])
        elif target.startswith("*"):
            continue
        else:
            missing.append(target)
            values.append(None)
    _check_inputs_given(missing, specs)
    builder = _GraphBuilder()
    _MetaShapeRecorder(module, builder, placeholder_specs).run(*values)
    return builder


def _check_inputs_given(missing: list[str], specs: list[InputSpec]):
    if not missing:
        return
    given = ", ".join(spec.name for spec in specs)
    shapes = ", ".join(f'"{name}": (...)' for name in [s.name for s in specs] + missing)
    raise TraceError(
        f"forward() also needs {', '.join(missing)} (rankaudit feeds {given})",
        f"set INPUT_SHAPE to a dict naming every input, e.g. {{{shapes}}}, with INPUT_DTYPE for the "
        "integer ones, or wrap the model in a module whose forward takes one tensor",
    )


def _export_quietly(model: nn.Module, args: tuple, kwargs: dict):
    """torch.export logs warnings and graph dumps when it fails; the user gets our one-line error instead."""
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return torch.export.export(model, args, kwargs, strict=False)
    finally:
        logging.disable(logging.NOTSET)


_CALL_INDEX = re.compile(r"@\d+$")


class _ModuleStack:
    """Reads export's nn_module_stack: which module an aten op belongs to."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.cache: dict[str, nn.Module | None] = {}

    def module(self, path: str) -> nn.Module | None:
        path = _CALL_INDEX.sub("", path)
        if path not in self.cache:
            try:
                self.cache[path] = self.model.get_submodule(path) if path else self.model
            except (AttributeError, ValueError):
                self.cache[path] = None
        return self.cache[path]

    def atomic(self, stack: dict) -> tuple[str, str, nn.Module] | None:
        """The outermost norm or activation module (not torch.nn's own: those are single aten ops) around the op."""
        for key, (path, type_name) in stack.items():
            if type_name.startswith("torch.nn.modules."):
                continue
            module = self.module(path)
            if module is not None and ops.atomic_kind(module) is not None:
                return key, _CALL_INDEX.sub("", path), module
        return None


def _trace_export(
    model: nn.Module, specs: list[InputSpec], examples: dict[str, torch.Tensor], switches: dict[str, Any]
) -> _GraphBuilder:
    positional = [spec for spec in specs if spec.positional]
    args = tuple(examples[spec.name] for spec in positional)
    kwargs = {**{spec.name: examples[spec.name] for spec in specs if not spec.positional}, **switches}
    exported = _export_quietly(model, args, kwargs)
    signature = exported.graph_signature
    parameter_of = dict(signature.inputs_to_parameters)
    spec_of_tensor = {id(examples[spec.name]): spec for spec in specs}
    leaves = torch.utils._pytree.tree_leaves((args, kwargs))
    user_specs = [s for s in signature.input_specs if s.kind == torch.export.graph_signature.InputKind.USER_INPUT]
    placeholder_specs = {}
    for leaf, input_spec in zip(leaves, user_specs):
        if isinstance(input_spec.arg, torch.export.graph_signature.TensorArgument) and id(leaf) in spec_of_tensor:
            placeholder_specs[input_spec.arg.name] = spec_of_tensor[id(leaf)]
    named = dict(model.named_parameters(remove_duplicate=False))
    canonical = {id(p): name for name, p in model.named_parameters()}  # a tied parameter: its first name

    def parameters_at(node: fx.Node) -> list[tuple[str, nn.Parameter]]:
        if node.op != "placeholder" or node.name not in parameter_of:
            return []
        parameter = named[parameter_of[node.name]]
        return [(canonical.get(id(parameter), parameter_of[node.name]), parameter)]

    builder = _GraphBuilder(parameters_at)
    stacks = _ModuleStack(model)
    values: dict[str, Any] = {}
    for n in exported.graph_module.graph.nodes:
        if n.op == "placeholder":
            if n.name in parameter_of:
                values[n.name] = named[parameter_of[n.name]]
            else:
                values[n.name] = n.meta.get("val")
                builder.add_placeholder(n, values[n.name], placeholder_specs.get(n.name))
        elif n.op == "call_function":
            args_ = fx.node.map_arg(n.args, lambda a: values.get(a.name))
            kwargs_ = fx.node.map_arg(n.kwargs, lambda a: values.get(a.name))
            value = n.meta.get("val")
            values[n.name] = value
            if isinstance(n.target, torch._ops.OpOverload):
                kind, target = "aten", n.target.overloadpacket.__name__
            else:
                kind, target = "function", n.target
            display, name = getattr(target, "__name__", str(target)), n.name
            stack = n.meta.get("nn_module_stack") or {}
            atomic = stacks.atomic(stack)
            if stack and atomic is None:
                qualname, type_name = list(stack.values())[-1]
                qualname = _CALL_INDEX.sub("", qualname)
                if type_name.startswith("torch.nn.modules.") and qualname:
                    display, name = type_name.rsplit(".", 1)[-1], qualname
                elif qualname and _reads_own_parameters(builder, n, qualname):
                    # A layer of another library (GPT-2's Conv1D is one addmm): named after its module.
                    display, name = type_name.rsplit(".", 1)[-1], qualname
            builder.add_call(
                n,
                kind,
                target,
                display,
                name,
                None,
                args_,
                kwargs_,
                value,
                _parameters_in((args_, kwargs_)),
                _source_from_stack(n.meta.get("stack_trace")),
                atomic=atomic,
            )
        elif n.op == "output":
            outputs = list(n.args[0]) if n.args and isinstance(n.args[0], (tuple, list)) else list(n.all_input_nodes)
            builder.output_ids = _export_output_choice(outputs, exported, builder.records)
    return builder


def _reads_own_parameters(builder: _GraphBuilder, node: fx.Node, qualname: str) -> bool:
    return any(
        name.startswith(qualname + ".") and name.count(".") == qualname.count(".") + 1
        for name, _ in builder._direct_parameters(node)
    )


def _export_output_choice(outputs: list, exported, records: dict[str, NodeRecord]) -> list[str]:
    """The output leaf named `logits` in export's output tree (a ModelOutput's keys), else the first traced one."""
    index = None
    try:
        index = _leaf_named(exported.call_spec.out_spec, "logits")
    except (AttributeError, TypeError):
        pass
    if (
        index is not None
        and index < len(outputs)
        and isinstance(outputs[index], fx.Node)
        and outputs[index].name in records
    ):
        return [outputs[index].name]
    traced = [o.name for o in outputs if isinstance(o, fx.Node) and o.name in records]
    return traced[:1]


def _leaf_named(spec, wanted: str) -> int | None:
    """Position, among the leaves of a pytree spec, of the leaf under the key `wanted`."""

    def walk(node, offset: int) -> tuple[int | None, int]:
        if node.is_leaf():
            return None, offset + 1
        keys = node.context if isinstance(node.context, (list, tuple)) else None
        children = node.children() if hasattr(node, "children") else node.children_specs
        for i, child in enumerate(children):
            if keys is not None and i < len(keys) and keys[i] == wanted and child.is_leaf():
                return offset, offset + 1
            found, offset = walk(child, offset)
            if found is not None:
                return found, offset
        return None, offset

    return walk(spec, 0)[0]


def _forward_parameters(model: nn.Module) -> tuple[dict[str, inspect.Parameter], bool]:
    """forward()'s named parameters, and whether it takes **kwargs."""
    try:
        parameters = dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}, True
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return {n: p for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}, var_keyword


_POSITION_IDS = ("position_ids", "token_type_ids", "cache_position", "type_ids")


def _role(name: str, dtype: torch.dtype) -> str:
    lowered = name.lower()
    if "mask" in lowered:
        return ROLE_MASK
    if dtype.is_floating_point or dtype.is_complex:
        return ROLE_DATA
    if lowered.endswith(_POSITION_IDS):
        return ROLE_IDS
    return ROLE_TOKENS


def input_specs(model: nn.Module, input_shape, input_dtype=None) -> list[InputSpec]:
    """What to feed forward(): one spec per input, from INPUT_SHAPE / INPUT_DTYPE (or the command line)."""
    parameters, var_keyword = _forward_parameters(model)

    def dtype_for(name: str) -> torch.dtype:
        if isinstance(input_dtype, dict):
            return input_dtype.get(name, torch.float32)
        return input_dtype or torch.float32  # one dtype: every input has it

    if isinstance(input_shape, dict):
        unknown = [name for name in input_shape if name not in parameters and not var_keyword]
        if unknown:
            raise UsageError(
                f"INPUT_SHAPE names {', '.join(unknown)}, which forward() does not take "
                f"(it takes {', '.join(parameters) or 'nothing'})",
                "name the inputs as forward()'s parameters are named",
            )
        if isinstance(input_dtype, dict):
            stray = [name for name in input_dtype if name not in input_shape]
            if stray:
                raise UsageError(
                    f"INPUT_DTYPE names {', '.join(stray)}, which INPUT_SHAPE does not",
                    "give a dtype for inputs that INPUT_SHAPE lists",
                )
        specs = [
            InputSpec(name, tuple(shape), dtype_for(name), _role(name, dtype_for(name)))
            for name, shape in input_shape.items()
        ]
    else:
        name = next(iter(parameters), "input")
        dtype = (
            next(iter(input_dtype.values()), torch.float32)
            if isinstance(input_dtype, dict)
            else input_dtype or torch.float32
        )
        role = ROLE_TOKENS if not (dtype.is_floating_point or dtype.is_complex) else ROLE_DATA
        specs = [InputSpec(name, tuple(input_shape), dtype, role, positional=True)]
    if not any(spec.carries_unknowns for spec in specs):
        raise UsageError(
            "no input carries unknowns (" + ", ".join(f"{s.name}: {s.role}" for s in specs) + ")",
            "give the data input a float dtype, or the token ids an integer dtype and a name other than a mask's",
        )
    tokens = next((spec for spec in specs if spec.role == ROLE_TOKENS), None)
    config = getattr(model, "config", None)
    if (
        tokens is not None
        and "decoder_input_ids" in parameters
        and "decoder_input_ids" not in [s.name for s in specs]
        and getattr(config, "is_encoder_decoder", False)
    ):
        # An encoder-decoder needs decoder inputs: the same ids, so the decoder's lookup is the encoder's.
        specs.append(InputSpec("decoder_input_ids", tokens.shape, tokens.dtype, ROLE_TOKENS, same_as=tokens.name))
    return specs


def _switches(model: nn.Module, forward_kwargs: dict | None) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments for forward(): no cache (only the logits carry the loss), named outputs, then the
    model file's FORWARD_KWARGS, which win."""
    parameters, var_keyword = _forward_parameters(model)
    wrapped = model
    while (
        var_keyword and callable(getattr(wrapped, "get_base_model", None)) and wrapped.get_base_model() is not wrapped
    ):
        # A wrapper that passes **kwargs on (peft's PeftModel): the switches are the wrapped model's.
        wrapped = wrapped.get_base_model()
        inner, var_keyword = _forward_parameters(wrapped)
        parameters = {**inner, **parameters}
    switches: dict[str, Any] = {}
    if "use_cache" in parameters:
        switches["use_cache"] = False
    if "return_dict" in parameters:
        switches["return_dict"] = True
    switches.update(forward_kwargs or {})
    return switches, [f"{key}={value!r}" for key, value in switches.items()]


_TOKEN_DTYPE_FIX = (
    "an embedding got float input: token ids need an integer dtype; set INPUT_DTYPE = torch.long "
    "in the model file or pass --input-dtype int64"
)


def _wants_token_ids(exc: BaseException) -> bool:
    return "'indices'" in str(exc) and ("Long" in str(exc) or "Int" in str(exc))


def _example(spec: InputSpec) -> torch.Tensor:
    return torch.empty((1,) + tuple(spec.shape), dtype=spec.dtype, device="meta")


def _tied_tables(builder: _GraphBuilder):
    for embedding in builder.token_embeddings:
        embedding.tied_with = [
            record.name
            for record in builder.records.values()
            if record.id != embedding.record
            and record.family != "embedding"
            and any(name == embedding.weight for name, _ in record.direct_params)
        ]


def _prune_to_outputs(builder: _GraphBuilder):
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


def trace_model(model: nn.Module, input_shape, *, input_dtype=None, forward_kwargs: dict | None = None) -> TracedModel:
    """Trace with torch.fx; where symbolic tracing fails, with torch.export (non-strict). All on meta.

    `input_shape` is one per-sample shape, or a dict of them by forward() parameter name (INPUT_SHAPE);
    `input_dtype` a dtype or a dict of them (INPUT_DTYPE; integer inputs are ids or masks).
    """
    model.eval()  # batch statistics need more than one sample; the counts do not depend on the mode
    specs = input_specs(model, input_shape, input_dtype)
    switches, notes = _switches(model, forward_kwargs)
    if any(spec.same_as for spec in specs):
        notes += [f"{spec.name}={spec.same_as}" for spec in specs if spec.same_as]
    parameters, _ = _forward_parameters(model)
    given = {spec.name for spec in specs} | set(switches)
    required = [name for name, p in parameters.items() if p.default is p.empty and name not in given]
    _check_inputs_given(required, specs)
    examples = {spec.name: _example(spec) for spec in specs}
    fallback_reason = None
    try:
        builder, tracer = _trace_fx(model, specs, examples, switches), "torch.fx"
    except TraceError:
        raise
    except Exception as fx_error:
        fallback_reason = f"torch.fx: {_first_line(fx_error)}{_where(fx_error)}"
        try:
            builder, tracer = _trace_export(model, specs, examples, switches), "torch.export"
        except TraceError:
            raise
        except Exception as export_error:
            raise TraceError(
                f"could not trace the model. {fallback_reason}; "
                f"torch.export: {_first_line(export_error)}{_where(export_error)}",
                _TOKEN_DTYPE_FIX
                if _wants_token_ids(export_error)
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
    )
