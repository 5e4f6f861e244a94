"""fx (fallback torch.export) -> graph of layer records (networkx view on demand), shapes propagated on meta."""
from __future__ import annotations

import contextlib
import functools
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
from rankaudit.errors import TraceError

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OWN_DIR = str(Path(__file__).resolve().parent)


@dataclass
class NodeRecord:
    """One traced call that depends on the model's input."""

    id: str                          # the graph node's unique name
    name: str                        # module qualified name (layer2.0.conv1) or fx node name (add_1)
    op: str                          # display: Conv2d, relu, add
    family: str                      # the ops registry family key
    counting: ops.Counting
    output_numel: int                # per sample: traced with batch size 1
    output_shape: tuple[int, ...] | None
    inputs: list[str]                # ids of the traced operands, in argument order
    source: str | None = None        # file:line of the call in the model's code
    # (qualified parameter name, trainable numel) of every parameter that reaches this op other than through
    # another traced op: a module call's own parameters, and parameters among a function's arguments or behind
    # untraced get_attr/expand/reshape chains (cls_token.expand(B, -1, -1) read by a cat). Frozen ones: numel 0.
    direct_params: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class TracedModel:
    records: dict[str, NodeRecord]   # node id -> record, for every traced call that depends on the input
    successors: dict[str, list[str]] # node id -> the records that read its output: edges follow the data
    order: list[str]                 # execution order (a topological order)
    input_id: str
    output_ids: list[str]
    tracer: str                      # "torch.fx" or "torch.export"
    fallback_reason: str | None      # why torch.fx was not used
    parameters: int                  # all parameters of the model, trainable or not

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
    return not (filename.startswith("<") or resolved.startswith(_TORCH_DIR) or resolved.startswith(_OWN_DIR)
                or "/site-packages/" in resolved or "/lib/python" in resolved)


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
        self.output_ids: list[str] = []

    def unique_name(self, name: str) -> str:
        count = self.names_used.get(name, 0) + 1
        self.names_used[name] = count
        return name if count == 1 else f"{name}#{count}"

    def add_input(self, node_id: str, value: torch.Tensor):
        shape = tuple(value.shape)
        record = NodeRecord(node_id, "input", "input", "input", ops.Counting(ops.Role.TRANSPARENT),
                            math.prod(shape), shape, [])
        self._add(record)
        self.input_id = node_id

    def direct_params(self, node: fx.Node, own: list[tuple[str, nn.Parameter]] = ()) -> list[tuple[str, int]]:
        """Parameters reaching `node` without passing through a traced op: `own` first, then the untraced chains."""
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
        return [(name, param.numel() if param.requires_grad else 0) for name, param in found.items()]

    def add_call(self, node: fx.Node, kind: str, target: Any, display: str, name: str, module: nn.Module | None,
                 args: tuple, kwargs: dict, value: Any, params: list[nn.Parameter], source: str | None,
                 own_params: list[tuple[str, nn.Parameter]] = ()):
        traced_args = [a for a in node.all_input_nodes if a.name in self.traced]
        if not traced_args:
            return  # depends on constants and parameters only: not part of the input's flow
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
        facts = ops.OpFacts(display, module, args, kwargs, operand_shapes,
                            torch.Size(output_shape) if output_shape is not None else None, output_numel, params)
        family = ops.family_of(kind, target)
        counting = family.handler(facts)
        inputs = [a.name for a in traced_args if a.name in self.records]
        record = NodeRecord(node.name, self.unique_name(name), display, family.key, counting,
                            output_numel, output_shape, inputs, source, self.direct_params(node, own_params))
        self._add(record)

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

    def __init__(self, module: fx.GraphModule, builder: _GraphBuilder):
        super().__init__(module)
        self.builder = builder
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
            return [(self.parameter_name(p, f"{node.target}.{local}"), p)
                    for local, p in self.fetch_attr(node.target).named_parameters()]
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
            raise TraceError(f"shape propagation failed at {label}: {_first_line(exc)}{_where(exc)}",
                             "check the input shape (--input-shape or INPUT_SHAPE) against the model's first layer")
        if n.op == "placeholder":
            if self.builder.input_id is None:
                self.builder.add_input(n.name, value)
        elif n.op in ("call_module", "call_function", "call_method"):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            source = n.meta.get("rankaudit_source")
            if n.op == "call_module":
                module = self.fetch_attr(n.target)
                self.builder.add_call(n, "module", module, type(module).__name__, n.target, module, args, kwargs,
                                      value, list(module.parameters()), source,
                                      [(self.parameter_name(p, f"{n.target}.{local}"), p)
                                       for local, p in module.named_parameters()])
            elif n.op == "call_function":
                display = getattr(n.target, "__name__", str(n.target))
                self.builder.add_call(n, "function", n.target, display, n.name, None, args, kwargs, value,
                                      _parameters_in((args, kwargs)), source)
            else:
                self.builder.add_call(n, "method", n.target, n.target, n.name, None, args, kwargs, value,
                                      _parameters_in((args, kwargs)), source)
        elif n.op == "output":
            self.builder.output_ids = [a.name for a in n.all_input_nodes if a.name in self.builder.records]
        return value


def _placeholders_without_default(graph: fx.Graph) -> list[str]:
    return [n.name for n in graph.nodes if n.op == "placeholder" and not n.args]


class _SourceRecordingTracer(fx.Tracer):
    """torch.fx's tracer, noting for each node the model-code line that created it.

    fx's own record_stack_traces imports much of torch on first use (over a second); a frame walk is enough.
    """

    def create_node(self, *args, **kwargs) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and not _is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            node.meta["rankaudit_source"] = f"{_relative(frame.f_code.co_filename)}:{frame.f_lineno}"
        return node


def _trace_fx(model: nn.Module, example: torch.Tensor) -> _GraphBuilder:
    tracer = _SourceRecordingTracer()
    graph = tracer.trace(model)
    module = fx.GraphModule(tracer.root, graph)
    _check_single_input(_placeholders_without_default(graph))
    builder = _GraphBuilder()
    _MetaShapeRecorder(module, builder).run(example)
    return builder


def _check_single_input(required: list[str]):
    if len(required) > 1:
        raise TraceError(f"forward() takes {len(required)} inputs ({', '.join(required)}); "
                         "rankaudit analyses the gradient of one input tensor",
                         "wrap the model in a module whose forward takes one tensor")


def _export_quietly(model: nn.Module, example: torch.Tensor):
    """torch.export logs warnings and graph dumps when it fails; the user gets our one-line error instead."""
    logging.disable(logging.CRITICAL)
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return torch.export.export(model, (example,), strict=False)
    finally:
        logging.disable(logging.NOTSET)


def _trace_export(model: nn.Module, example: torch.Tensor) -> _GraphBuilder:
    exported = _export_quietly(model, example)
    signature = exported.graph_signature
    parameter_of = dict(signature.inputs_to_parameters)
    user_inputs = list(signature.user_inputs)
    _check_single_input(user_inputs)
    named = dict(model.named_parameters())
    builder = _GraphBuilder(lambda node: [(parameter_of[node.name], named[parameter_of[node.name]])]
                            if node.op == "placeholder" and node.name in parameter_of else [])
    values: dict[str, Any] = {}
    for n in exported.graph_module.graph.nodes:
        if n.op == "placeholder":
            if n.name in parameter_of:
                values[n.name] = named[parameter_of[n.name]]
            else:
                values[n.name] = n.meta.get("val")
                if n.name == user_inputs[0]:
                    builder.add_input(n.name, values[n.name])
        elif n.op == "call_function":
            args = fx.node.map_arg(n.args, lambda a: values.get(a.name))
            kwargs = fx.node.map_arg(n.kwargs, lambda a: values.get(a.name))
            value = n.meta.get("val")
            values[n.name] = value
            if isinstance(n.target, torch._ops.OpOverload):
                kind, target = "aten", n.target.overloadpacket.__name__
            else:
                kind, target = "function", n.target
            display, name = getattr(target, "__name__", str(target)), n.name
            stack = n.meta.get("nn_module_stack") or {}
            if stack:
                qualname, type_name = list(stack.values())[-1]
                if type_name.startswith("torch.nn.modules.") and qualname:
                    display, name = type_name.rsplit(".", 1)[-1], qualname
            builder.add_call(n, kind, target, display, name, None, args, kwargs, value,
                             _parameters_in((args, kwargs)), _source_from_stack(n.meta.get("stack_trace")))
        elif n.op == "output":
            builder.output_ids = [a.name for a in n.all_input_nodes if a.name in builder.records]
    return builder


def trace_model(model: nn.Module, input_shape: tuple[int, ...]) -> TracedModel:
    """Trace with torch.fx; where symbolic tracing fails, with torch.export (non-strict). All on meta."""
    model.eval()  # batch statistics need more than one sample; the counts do not depend on the mode
    example = torch.empty((1,) + tuple(input_shape), device="meta")
    fallback_reason = None
    try:
        builder, tracer = _trace_fx(model, example), "torch.fx"
    except TraceError:
        raise
    except Exception as fx_error:
        fallback_reason = f"torch.fx: {_first_line(fx_error)}{_where(fx_error)}"
        try:
            builder, tracer = _trace_export(model, example), "torch.export"
        except TraceError:
            raise
        except Exception as export_error:
            raise TraceError(f"could not trace the model. {fallback_reason}; "
                             f"torch.export: {_first_line(export_error)}{_where(export_error)}",
                             "remove data-dependent control flow from forward() (branches on tensor values), "
                             "or move it into a function marked with torch.fx.wrap") from export_error
    if builder.input_id is None:
        raise TraceError("the model's forward() takes no input tensor", "give forward() one input tensor")
    parameters = sum(p.numel() for p in model.parameters())
    return TracedModel(builder.records, builder.successors, builder.order, builder.input_id, builder.output_ids, tracer,
                       fallback_reason, parameters)
