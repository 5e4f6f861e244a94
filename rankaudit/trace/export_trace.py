"""torch.export's fallback: the exported aten graph read into layer records, each op named after its module."""

from __future__ import annotations

import contextlib
import io
import logging
import re
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from rankaudit.trace.code_location import source_from_stack
from rankaudit.trace.inputs import InputSpec
from rankaudit.trace.records import NodeRecord, OpTable, RecordBuilder, parameters_in


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

    def __init__(self, model: nn.Module, op_table: OpTable):
        self.model = model
        self.op_table = op_table
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
            if module is not None and self.op_table.atomic_kind(module) is not None:
                return key, _CALL_INDEX.sub("", path), module
        return None


def trace_with_export(
    model: nn.Module,
    specs: list[InputSpec],
    examples: dict[str, torch.Tensor],
    switches: dict[str, Any],
    op_table: OpTable,
) -> RecordBuilder:
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

    builder = RecordBuilder(op_table, parameters_at)
    stacks = _ModuleStack(model, op_table)
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
                parameters_in((args_, kwargs_)),
                source_from_stack(n.meta.get("stack_trace")),
                atomic=atomic,
            )
        elif n.op == "output":
            outputs = list(n.args[0]) if n.args and isinstance(n.args[0], (tuple, list)) else list(n.all_input_nodes)
            builder.output_ids = _export_output_choice(outputs, exported, builder.records)
    return builder


def _reads_own_parameters(builder: RecordBuilder, node: fx.Node, qualname: str) -> bool:
    return any(
        name.startswith(qualname + ".") and name.count(".") == qualname.count(".") + 1
        for name, _ in builder.attribution.parameters(node)
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
