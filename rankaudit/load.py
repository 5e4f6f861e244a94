"""Model file -> nn.Module built on the meta device (no real weights) + the per-sample input shape."""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rankaudit.errors import ModelLoadError, NoModelInFile, UsageError

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# In-place ops that nn.init and reset_parameters() use. On meta tensors they change no value, yet the first
# call of several (normal_ above all) imports torch._dynamo: a second or two for nothing. Shapes never change.
_INITIALISERS = frozenset({
    "normal_", "uniform_", "zero_", "fill_", "bernoulli_", "exponential_", "geometric_", "log_normal_",
    "cauchy_", "random_", "erfinv_", "clamp_", "clamp_min_", "clamp_max_", "mul_", "add_", "sub_", "div_",
    "copy_", "fmod_", "abs_", "sqrt_", "exp_", "neg_",
})


class _SkipMetaInitialisation(TorchFunctionMode):
    """While a model is built on meta, initialisers are no-ops (there are no values to initialise)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (getattr(func, "__name__", "") in _INITIALISERS and args and isinstance(args[0], torch.Tensor)
                and args[0].is_meta):
            return args[0]
        return func(*args, **(kwargs or {}))


def _building_on(device: str):
    """The context a model file runs in: the target device, and on meta no initialisation work."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.device(device))
    if device == "meta":
        stack.enter_context(_SkipMetaInitialisation())
    return stack


@dataclass
class LoadedModel:
    module: nn.Module
    input_shape: tuple[int, ...]
    name: str  # the class, factory or instance the model came from
    path: Path
    spec: str  # what the user typed: PATH or PATH:NAME


def split_model_spec(spec: str) -> tuple[Path, str | None]:
    """`path/to/model.py:Name` -> (path, "Name"); a bare path -> (path, None)."""
    path_text, name = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and _IDENTIFIER.match(tail) and head:
        path_text, name = head, tail
    path = Path(path_text)
    if not path.exists():
        raise UsageError(f"model file '{path_text}' does not exist",
                         "give the path of a Python file that defines the model, e.g. examples/cnn6.py")
    if path.is_dir():
        raise UsageError(f"'{path_text}' is a directory, not a model file",
                         "give the path of a Python file, e.g. examples/cnn6.py")
    return path, name


_SHAPE = re.compile(r"^\s*[(\[]?\s*(\d+(?:\s*[,x×]\s*\d+)*)\s*,?\s*[)\]]?\s*$")


def parse_input_shape(text: str) -> tuple[int, ...]:
    """'3,32,32', '3x32x32' or '(3, 32, 32)' -> (3, 32, 32); per sample, without the batch dimension."""
    match = _SHAPE.match(text)
    shape = tuple(int(d) for d in re.split(r"\s*[,x×]\s*", match.group(1))) if match else ()
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(f"malformed input shape '{text}'",
                         "give positive integers per sample without the batch dimension, e.g. --input-shape 3,32,32")
    return shape


def _shape_from_file(value, path: Path) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)) and value and all(isinstance(d, int) and d > 0 for d in value):
        return tuple(value)
    raise UsageError(f"INPUT_SHAPE in {path} is {value!r}, not a tuple of positive integers",
                     "set INPUT_SHAPE = (C, H, W) per sample, without the batch dimension")


def _user_frame(exc: BaseException, path: Path) -> str:
    """The deepest traceback line inside the model file: where the user should look."""
    resolved = str(path.resolve())
    location = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if str(Path(frame.filename).resolve()) == resolved:
            location = f"{path}:{frame.lineno}"
    return location


def _describe_exception(exc: BaseException, path: Path) -> str:
    where = _user_frame(exc, path)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"{text} (at {where})" if where else text


def _execute_file(path: Path, device: str):
    module_name = "rankaudit_model_" + re.sub(r"\W", "_", path.stem)
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"'{path}' is not a Python file", "give a .py file that defines the model")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    directory = str(path.resolve().parent)
    # A model file may import its neighbours, as it would when run as a script.
    sys.path.insert(0, directory)
    try:
        with _building_on(device):
            spec.loader.exec_module(module)
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except SyntaxError as exc:
        raise ModelLoadError(f"{path} does not parse: {exc.msg} (at {path}:{exc.lineno})",
                             "fix the syntax error in the model file") from exc
    except BaseException as exc:  # the user's file can raise anything, SystemExit included
        raise ModelLoadError(f"{path} raised on import: {_describe_exception(exc, path)}",
                             "make the file importable on its own (run `python " + str(path) + "`)") from exc
    finally:
        if sys.path and sys.path[0] == directory:
            sys.path.pop(0)
    return module


def _zero_argument(cls) -> bool:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
               for p in signature.parameters.values())


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


def _build(obj, attr: str, path: Path, device: str) -> nn.Module:
    if isinstance(obj, nn.Module):
        return obj
    if not callable(obj):
        raise UsageError(f"'{attr}' in {path} is a {type(obj).__name__}, not a model",
                         f"name an nn.Module subclass, a zero-argument factory or an instance: {path}:NAME")
    try:
        with _building_on(device):
            built = obj()
    except (KeyboardInterrupt, GeneratorExit):
        raise
    except BaseException as exc:
        raise ModelLoadError(f"could not build {attr}() from {path}: {_describe_exception(exc, path)}",
                             f"give {attr} defaults for every argument, or add a zero-argument factory "
                             f"function and pass {path}:factory") from exc
    if not isinstance(built, nn.Module):
        raise ModelLoadError(f"{attr}() in {path} returned a {type(built).__name__}, not an nn.Module",
                             "make the factory return the model")
    return built


def _pick(module, name: str | None, path: Path) -> tuple[str, object]:
    instances, classes = _candidates(module)
    if name is not None:
        if not hasattr(module, name):
            known = ", ".join(sorted({**instances, **classes})) or "none"
            raise UsageError(f"{path} has no attribute '{name}' (models defined there: {known})",
                             f"pass {path}:NAME with one of those names")
        return name, getattr(module, name)
    if len(instances) == 1:
        return next(iter(instances.items()))
    if len(instances) > 1:
        names = ", ".join(sorted(instances))
        raise UsageError(f"{path} holds several model instances ({names})",
                         f"choose one with {path}:NAME")
    buildable = {attr: cls for attr, cls in classes.items() if _zero_argument(cls)}
    if len(buildable) == 1:
        return next(iter(buildable.items()))
    if len(buildable) > 1:
        names = ", ".join(sorted(buildable))
        raise UsageError(f"{path} defines several models that build without arguments ({names})",
                         f"choose one with {path}:NAME")
    if classes:
        names = ", ".join(sorted(classes))
        raise ModelLoadError(f"no model in {path} builds without arguments (found {names}, each needs arguments)",
                             f"add a zero-argument factory function and pass {path}:factory")
    raise NoModelInFile(f"no nn.Module subclass or instance is defined in {path}",
                         "define the model class in that file, or name it with PATH:NAME")


def load_model(spec: str, input_shape: tuple[int, ...] | None = None, device: str = "meta") -> LoadedModel:
    """Execute the model file and build its model on `device` ("meta" for analysis: nothing is allocated)."""
    path, name = split_model_spec(spec)
    if path.suffix != ".py":
        raise UsageError(f"'{path}' is not a .py file", "give the Python file that defines the model")
    module = _execute_file(path, device)
    attr, obj = _pick(module, name, path)
    model = _build(obj, attr, path, device)
    if device == "meta" and any(not p.is_meta for p in model.parameters()):
        # The file loaded real weights (torch.load at import, say); drop them: analysis needs shapes only.
        model = model.to("meta")
    if input_shape is None:
        if not hasattr(module, "INPUT_SHAPE"):
            raise UsageError(f"no input shape for {path}",
                             "pass --input-shape C,H,W or set INPUT_SHAPE = (C, H, W) in the model file")
        input_shape = _shape_from_file(module.INPUT_SHAPE, path)
    return LoadedModel(module=model, input_shape=tuple(input_shape), name=attr, path=path, spec=spec)
