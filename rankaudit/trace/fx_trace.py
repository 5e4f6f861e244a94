"""torch.fx's symbolic trace, run on meta tensors to record each call's shapes and facts."""

from __future__ import annotations

import contextlib
import re
import sys
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from rankaudit.errors import TraceError
from rankaudit.model.meta_device import MetaShortcuts
from rankaudit.trace.code_location import first_line, is_user_file, relative_path, where_raised
from rankaudit.trace.inputs import TOKEN_DTYPE_FIX, InputSpec, check_inputs_given, wants_token_ids
from rankaudit.trace.records import NodeRecord, OpFamilyKey, OpTable, RecordBuilder, parameters_in


def _meta_values(shape):
    """A shape rule's answer as meta tensors: a shape (a tuple of sizes) is one tensor; a tuple of shapes (and
    Nones) is the tuple an op such as nn.LSTM returns."""
    if shape is None:
        return None
    if all(isinstance(size, int) for size in shape):
        return torch.empty(shape, device="meta")
    return tuple(_meta_values(part) for part in shape)


class _MetaShapeRecorder(fx.Interpreter):
    """Runs a symbolically traced module on meta tensors and records each call's facts."""

    def __init__(self, module: fx.GraphModule, builder: RecordBuilder, specs: dict[str, InputSpec]):
        super().__init__(module)
        self.builder = builder
        self.specs = specs
        self.calls: dict[str, int] = {}
        # A tied parameter has one name however many modules hold it: the first, as named_parameters() gives it.
        self.canonical = {id(p): name for name, p in module.named_parameters()}
        builder.attribution.parameters_at = self.parameters_at

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

    def _family(self, n: fx.Node) -> tuple[str, Any, OpFamilyKey | None]:
        if n.op == "call_module":
            module = self.fetch_attr(n.target)
            return "module", module, self.builder.op_table.family_of("module", module)
        if n.op == "call_function":
            return "function", n.target, self.builder.op_table.family_of("function", n.target)
        if n.op == "call_method":
            return "method", n.target, self.builder.op_table.family_of("method", n.target)
        return n.op, n.target, None

    def _evaluate(self, n: fx.Node, target: Any, family: OpFamilyKey | None) -> Any:
        if family is not None and family.shape is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            shape = family.shape(target, args, kwargs)
            if shape is not None:
                return _meta_values(shape)
        return super().run_node(n)

    def run_node(self, n: fx.Node) -> Any:
        kind, target, family = self._family(n)
        try:
            value = self._evaluate(n, target, family)
        except TraceError:
            raise
        except Exception as exc:
            label = n.target if n.op == "call_module" else n.name
            if isinstance(target, torch.jit.ScriptModule):
                raise TraceError(
                    f"the TorchScript module {label} could not run without weights: {_compiled_error(exc)}",
                    "register the tensors its code makes as buffers before it is traced or scripted, so that they "
                    "move with the model (a traced module keeps any other tensor where it was made); or analyse the "
                    "module uncompiled",
                ) from exc
            raise TraceError(
                f"shape propagation failed at {label}: {first_line(exc)}{where_raised(exc)}",
                TOKEN_DTYPE_FIX
                if wants_token_ids(exc)
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
                    _module_display(module),
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
                    parameters_in((args, kwargs)),
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
                    parameters_in((args, kwargs)),
                    source,
                )
        elif n.op == "output":
            self.builder.output_ids = _output_choice(n.args[0] if n.args else None, self.builder.records)
        return value


def _compiled_error(error: BaseException) -> str:
    """What failed inside compiled code: the interpreter's last error line and the model-code line it names (its own
    first line only says that an operation failed in the TorchScript interpreter)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    failed = next((line for line in reversed(lines) if re.match(r"^\w+(Error|Exception): ", line)), None)
    if failed is None:
        return first_line(error)
    while re.match(r"^\w+(Error|Exception): \w+(Error|Exception): ", failed):
        failed = failed.split(": ", 1)[1]  # the interpreter repeats the error's type
    where = next(
        (line for line in lines if re.match(r"^\S+\.py\(\d+\): ", line) and is_user_file(line.split("(")[0])), None
    )
    if where is None:
        return failed
    file, line = re.match(r"^(\S+\.py)\((\d+)\)", where).groups()
    return f"{failed} (at {relative_path(file)}:{line})"


def _module_display(module: nn.Module) -> str:
    """A module call's op as the user wrote it: its class, and for a TorchScript module the class it was compiled
    from (torch.jit names every one RecursiveScriptModule or TopLevelTracedModule)."""
    if isinstance(module, torch.jit.ScriptModule):
        return f"{getattr(module, 'original_name', None) or type(module).__name__} (TorchScript)"
    return type(module).__name__


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
        while frame is not None and not is_user_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            node.meta["rankaudit_source"] = f"{relative_path(frame.f_code.co_filename)}:{frame.f_lineno}"
        return node

    def __init__(self, op_table: OpTable):
        super().__init__()
        self.op_table = op_table

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A TorchScript module runs compiled code fx cannot enter: one call, whose parameters the record keeps.
        return (
            isinstance(m, torch.jit.ScriptModule)
            or super().is_leaf_module(m, module_qualified_name)
            or self.op_table.atomic_kind(m) is not None
        )


def _checkpointed_forward(
    function,
    *args,
    use_reentrant=None,
    context_fn=None,
    determinism_check=None,
    debug=None,
    preserve_rng_state=True,
    early_stop=None,
    **kwargs,
):
    """What torch.utils.checkpoint.checkpoint computes in the forward pass: function(*args, **kwargs) (it only
    changes what the backward pass keeps)."""
    return function(*args, **kwargs)


@contextlib.contextmanager
def _checkpoint_without_compiler():
    """torch.utils.checkpoint.checkpoint's wrapper imports torch's compiler on its first call, and its
    non-reentrant variant reads the compiler's settings: seconds for a forward pass that is function(*args). While
    fx traces through it, the wrapper's cached callee is that forward pass (checkpoint_sequential's, itself)."""
    import torch.utils.checkpoint as checkpointing

    stand_ins = {checkpointing.checkpoint: _checkpointed_forward, checkpointing.checkpoint_sequential: None}
    seeded = []
    for wrapper, forward in stand_ins.items():
        function = getattr(wrapper, "__wrapped__", None)
        code = getattr(wrapper, "__code__", None)
        if function is None or code is None or not code.co_filename.endswith("_compile.py"):
            continue  # another torch: leave it as it is
        if "__dynamo_disable" not in vars(function):
            function.__dynamo_disable = forward or function
            seeded.append(function)
    try:
        yield
    finally:
        for function in seeded:
            vars(function).pop("__dynamo_disable", None)


_CONCRETE_SUFFIX = re.compile(r"_\d+$")


def trace_with_fx(
    model: nn.Module,
    specs: list[InputSpec],
    examples: dict[str, torch.Tensor],
    switches: dict[str, Any],
    op_table: OpTable,
) -> RecordBuilder:
    tracer = _SourceRecordingTracer(op_table)
    with _checkpoint_without_compiler():
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
    check_inputs_given(missing, specs)
    builder = RecordBuilder(op_table)
    with MetaShortcuts():  # a parametrised weight (weight_norm) is computed when a shape rule reads it
        _MetaShapeRecorder(module, builder, placeholder_specs).run(*values)
    return builder
