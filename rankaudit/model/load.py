"""Model file -> nn.Module built on the meta device (no real weights) + the per-sample input shape."""

from __future__ import annotations

import inspect
import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from rankaudit.errors import ModelLoadError, NoModelInFile, NoZeroArgumentModel, OutOfMemory, UsageError
from rankaudit.model import meta_device, supervise
from rankaudit.model import standins as import_standins
from rankaudit.model.input_shape import combine_shapes, dtype_from_file, shape_from_file
from rankaudit.model.load_errors import construction_error, describe_exception, needs_missing_module
from rankaudit.model.meta_device import (
    BUILD_DEVICE,
    BUILD_META,
    BUILD_META_PARAMETERS,
    BUILD_SMALL_CPU,
    building_on,
    everything_to_meta,
    failing_op,
)
from rankaudit.model.model_file import ConstructionFailed, execute_file, package_root, quiet_app_logs
from rankaudit.settings.model_spec import split_model_spec


def _zero_argument(cls) -> bool:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return False
    return all(
        p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in signature.parameters.values()
    )


def _accepts(cls, model_args: dict) -> bool:
    """Whether `cls(**model_args)` binds, with every other parameter defaulted."""
    try:
        inspect.signature(cls).bind(**model_args)
    except (TypeError, ValueError):
        return False
    return True


_UNREADABLE = "(parameters not readable)"


def _parameters(cls) -> str:
    """A constructor's parameters as its signature writes them: `(width, depth=2)`."""
    try:
        return str(inspect.signature(cls))
    except (TypeError, ValueError):
        return _UNREADABLE


def _candidates(module) -> tuple[dict[str, object], dict[str, type]]:
    """Module-level nn.Module instances, and nn.Module subclasses defined in (not imported into) the file."""
    instances, classes = {}, {}
    for attr, value in vars(module).items():
        if attr.startswith("_"):
            continue
        if isinstance(value, nn.Module):
            instances[attr] = value
        elif inspect.isclass(value) and issubclass(value, nn.Module) and value.__module__ == module.__name__:
            classes[attr] = value
    return instances, classes


def _hidden_models(module, path: Path) -> list[str]:
    """nn.Module instances under a private name, and nn.Module subclasses whose methods were written in this file
    but that are private or claim another module (`__module__` reassigned): what _candidates leaves out."""
    found, here = [], os.path.realpath(path)
    for attr, value in vars(module).items():
        if isinstance(value, nn.Module) and attr.startswith("_"):
            found.append(attr)
        elif inspect.isclass(value) and issubclass(value, nn.Module) and value is not nn.Module:
            written_here = any(
                os.path.realpath(member.__code__.co_filename) == here
                for member in vars(value).values()
                if hasattr(member, "__code__")
            )
            if written_here and (attr.startswith("_") or value.__module__ != module.__name__):
                found.append(attr)
    return sorted(found)


def _build(
    obj, attr: str, path: Path, device: str, build: str = BUILD_DEVICE, model_args: dict | None = None
) -> nn.Module:
    if isinstance(obj, nn.Module):
        if model_args:
            raise UsageError(
                f"'{attr}' in {path} is a model instance: it takes no arguments",
                "drop --model-arg (model-args), or name the class or factory that builds it",
            )
        return obj
    if not callable(obj):
        raise UsageError(
            f"'{attr}' in {path} is a {type(obj).__name__}, not a model",
            f"name an nn.Module subclass, a zero-argument factory or an instance: {path}:NAME",
        )
    if model_args and _parameters(obj) != _UNREADABLE and not _accepts(obj, model_args):
        raise UsageError(
            f"--model-arg {', '.join(sorted(model_args))} does not fit {attr} in {path}: it takes {_parameters(obj)}",
            "pass the arguments the constructor names (model-args in [tool.rankaudit])",
        )
    mode = None
    try:
        context, mode = building_on(device, build)
        with context, supervise.phase(f"the build of {attr}() from {path}"):
            built = obj(**(model_args or {}))
            if device == "meta" and isinstance(built, nn.Module):
                _compute_parametrized_weights(built)
    except (KeyboardInterrupt, GeneratorExit, SystemExit):
        raise
    except BaseException as exc:
        if supervise.is_out_of_memory(exc):
            raise OutOfMemory(f"the build of {attr}() from {path}", supervise.describe_memory_limit(), exc) from exc
        raise ConstructionFailed("build", exc, failing_op(mode, exc)) from exc
    if not isinstance(built, nn.Module):
        raise ModelLoadError(
            f"{attr}() in {path} returned a {type(built).__name__}, not an nn.Module",
            "make the factory return the model",
        )
    return built


def _compute_parametrized_weights(model: nn.Module) -> None:
    """Every parametrized tensor (orthogonal, weight_norm, spectral_norm) computed once from its meta originals; raises
    where one cannot be. torch.nn.utils.parametrize swallows a NotImplementedError from a parametrization's
    right_inverse, which the meta device raises wherever a value is read (orthogonal's test that its weight is
    orthogonal): the build then ends without error, the parametrization half set up (orthogonal's base is None),
    and the model needs the small CPU build instead. (Here, not in meta_device: the error must read as raised
    inside torch's own code, which is what sends the loader to that build.)"""
    from torch.nn.utils import parametrize

    with meta_device.MetaShortcuts():
        for module in model.modules():
            if parametrize.is_parametrized(module):
                for name in module.parametrizations:
                    getattr(module, name)


def _pick(module, name: str | None, path: Path, model_args: dict | None = None) -> tuple[str, object]:
    instances, classes = _candidates(module)
    if name is not None:
        if not hasattr(module, name):
            known = ", ".join(sorted({**instances, **classes})) or "none"
            raise UsageError(
                f"{path} has no attribute '{name}' (models defined there: {known})",
                f"pass {path}:NAME with one of those names",
            )
        return name, getattr(module, name)
    if len(instances) == 1:
        return next(iter(instances.items()))
    if len(instances) > 1:
        names = ", ".join(sorted(instances))
        raise UsageError(f"{path} holds several model instances ({names})", f"choose one with {path}:NAME")
    buildable = {
        attr: cls for attr, cls in classes.items() if (_accepts(cls, model_args) if model_args else _zero_argument(cls))
    }
    if len(buildable) == 1:
        return next(iter(buildable.items()))
    if len(buildable) > 1:
        names = ", ".join(sorted(buildable))
        raise UsageError(
            f"{path} defines several models that build without arguments ({names})", f"choose one with {path}:NAME"
        )
    if classes and model_args:
        raise UsageError(
            f"--model-arg {', '.join(sorted(model_args))} does not fit any model in {path}: "
            + "; ".join(f"{attr} takes {_parameters(cls)}" for attr, cls in sorted(classes.items())),
            "pass the arguments the constructor names (model-args in [tool.rankaudit]), or choose the model with "
            f"{path}:NAME",
        )
    if classes:
        names = ", ".join(sorted(classes))
        raise (ModelLoadError if model_args else NoZeroArgumentModel)(
            f"no model in {path} builds without arguments (found {names}, each needs arguments)",
            f"pass its arguments with --model-arg KEY=VALUE (model-args in [tool.rankaudit]), or "
            f"add a zero-argument factory function and pass {path}:factory",
        )
    for attr, value in vars(module).items():
        missing = import_standins.stands_in(value) if isinstance(value, type) else None
        if missing and getattr(value, "__module__", None) == module.__name__:
            raise ModelLoadError(
                f"{attr} in {path} derives from {missing}, which is not installed",
                f"install {missing.split('.')[0]} (a stand-in replaced it while the file was imported)",
            )
    hidden = _hidden_models(module, path)
    if hidden:  # not a helper module: a pre-commit run must not skip it as one and pass without a verdict
        raise ModelLoadError(
            f"{path} holds models rankaudit does not pick on its own ({', '.join(hidden)}: a name starting with _ "
            "or a class that claims another module)",
            f"name the model with {path}:{hidden[0]}",
        )
    raise NoModelInFile(
        f"no nn.Module subclass or instance is defined in {path}",
        "define the model class in that file, or name it with PATH:NAME",
    )


class CompiledModel(nn.Module):
    """A model that is TorchScript as a whole (torch.jit.script or torch.jit.trace of the model itself), held as the
    submodule `model` of one input: no tracer enters compiled code, so it is counted as a TorchScript submodule is
    (its parameters read from it, the worst case), and the verifiers can hook its first forward, which a
    ScriptModule refuses."""

    def __init__(self, compiled: nn.Module):
        super().__init__()
        self.model = compiled

    def forward(self, x):
        return self.model(x)


@dataclass
class LoadedModel:
    module: nn.Module
    input_shape: tuple[int, ...] | dict[str, tuple[int, ...]]  # per sample; a dict for several named inputs
    name: str  # the class, factory or instance the model came from
    path: Path
    spec: str  # what the user typed: PATH or PATH:NAME
    input_dtype: torch.dtype | dict[str, torch.dtype] | None = None  # None: float32
    forward_kwargs: dict = field(default_factory=dict)  # FORWARD_KWARGS: switches the file asks forward() for
    vocab_size: int | None = None  # VOCAB_SIZE, else the first nn.Embedding's rows
    build: str = BUILD_DEVICE  # which construction worked: meta-parameters, meta, small-cpu or device
    stand_ins: list[str] = field(default_factory=list)  # missing modules replaced while the file was imported


def _vocabulary(namespace, model: nn.Module, path: Path) -> int | None:
    declared = getattr(namespace, "VOCAB_SIZE", None)
    if declared is not None:
        if not isinstance(declared, int) or declared <= 0:
            raise UsageError(
                f"VOCAB_SIZE in {path} is {declared!r}, not a positive integer",
                "set VOCAB_SIZE to the number of token ids, or leave it out to use the first nn.Embedding",
            )
        return declared
    return next((m.num_embeddings for m in model.modules() if isinstance(m, nn.Embedding)), None)


_TORCH_DIR = str(Path(torch.__file__).resolve().parent) + os.sep


def _raised_inside_torch(error: BaseException) -> bool:
    """The torch function that failed was called by torch's own code (a stock module reading values the meta
    device lacks), not by the model file: a constructor of the user's that reads weights is told so instead.
    The caller is the frame just before the build context's __torch_function__ (or, without one, the deepest)."""
    frames = traceback.extract_tb(error.__traceback__)
    context = next((i for i, frame in enumerate(frames) if frame.filename == meta_device.__file__), None)
    caller = frames[context - 1] if context else (frames[-1] if frames else None)
    return caller is not None and str(Path(caller.filename).resolve()).startswith(_TORCH_DIR)


def _construct(path: Path, name: str | None, device: str, model_args: dict | None = None):
    """Run the file and build its model; on meta, first with parameters only on meta, then all on meta; when
    both fail inside torch's own code, on the CPU with real weights, capped in size (then moved to meta)."""
    builds = [BUILD_META_PARAMETERS, BUILD_META] if device == "meta" else [BUILD_DEVICE]
    first_failure, attr = None, name
    for build in builds:
        if build == BUILD_SMALL_CPU and not _raised_inside_torch(first_failure.error):
            break
        try:
            namespace = execute_file(path, device, build)
            attr, obj = _pick(namespace, name, path, model_args)
            model = _build(obj, attr, path, device, build, model_args)
        except ConstructionFailed as failure:
            needs_missing_module(failure.error, path)
            first_failure = first_failure or failure
            if build == BUILD_META:
                builds.append(BUILD_SMALL_CPU)
            continue
        missing = import_standins.stands_in(model)
        if missing:
            raise ModelLoadError(
                f"the model {attr} in {path} derives from {missing}, which is not installed",
                f"install {missing.split('.')[0]} (a stand-in replaced it while the file was imported)",
            )
        return namespace, attr, model, build
    error = first_failure.error
    if first_failure.phase == "import" and isinstance(error, ModuleNotFoundError) and error.name:
        top = error.name.split(".")[0]
        library = import_standins.library_import(error, package_root(path)[0])
        if library is not None:
            raise ModelLoadError(
                f"{path} imports a library that needs {error.name}, which is not installed in the environment "
                f"rankaudit runs in (imported by {library})",
                f"install {top} there; a stand-in answers only the model's own imports, not a library's",
            ) from error
        raise ModelLoadError(
            f"{path} imports {error.name}, which is not installed in the environment rankaudit runs in",
            f"install {top} there (in a pre-commit hook with an environment of its own, not repo: local: "
            f'additional_dependencies: ["{top}"], its PyPI name); or, if the model does not use it, pass --stand-in {top} (stand-ins = ["{top}"] in '
            "[tool.rankaudit])",
        ) from error
    if device != "meta":  # the verifier's real build: its error is the file's own
        what = describe_exception(first_failure.error, path)
        if first_failure.phase == "import":
            raise ModelLoadError(
                f"{path} raised on import: {what}", f"make the file importable on its own (run `python {path}`)"
            ) from first_failure.error
        raise ModelLoadError(
            f"could not build {attr}() from {path}: {what}",
            f"give {attr} defaults for every argument, or add a zero-argument factory function and pass {path}:factory",
        ) from first_failure.error
    raise construction_error(path, attr, first_failure, model_args) from first_failure.error


def load_model(
    spec: str,
    input_shape: tuple[int, ...] | dict | None = None,
    device: str = "meta",
    input_dtype: torch.dtype | dict | None = None,
    model_args: dict | None = None,
) -> LoadedModel:
    """Execute the model file and build its model on `device` ("meta" for analysis: no weight is allocated);
    `model_args`: keyword arguments of the class or factory (--model-arg)."""
    path, name = split_model_spec(spec)
    if path.suffix != ".py":
        raise UsageError(f"'{path}' is not a .py file", "give the Python file that defines the model")
    with quiet_app_logs():
        namespace, attr, model, build = _construct(path, name, device, model_args)
    if isinstance(model, torch.jit.ScriptModule):
        model = CompiledModel(model)
    if device == "meta":
        everything_to_meta(model)
    from_file = shape_from_file(namespace.INPUT_SHAPE, path) if hasattr(namespace, "INPUT_SHAPE") else None
    input_shape = combine_shapes(input_shape, from_file)
    if input_shape is None:
        raise UsageError(
            f"no input shape for {path}", "pass --input-shape C,H,W or set INPUT_SHAPE = (C, H, W) in the model file"
        )
    if input_dtype is None:
        input_dtype = dtype_from_file(getattr(namespace, "INPUT_DTYPE", None), path)
    forward_kwargs = getattr(namespace, "FORWARD_KWARGS", None) or {}
    if not isinstance(forward_kwargs, dict) or not all(isinstance(k, str) for k in forward_kwargs):
        raise UsageError(
            f"FORWARD_KWARGS in {path} is {forward_kwargs!r}, not a dict of keyword arguments",
            'set FORWARD_KWARGS = {"output_attentions": False} or leave it out',
        )
    return LoadedModel(
        module=model,
        input_shape=input_shape,
        name=attr,
        path=path,
        spec=spec,
        input_dtype=input_dtype,
        forward_kwargs=dict(forward_kwargs),
        vocab_size=_vocabulary(namespace, model, path),
        stand_ins=import_standins.used(),
        build=build,
    )
