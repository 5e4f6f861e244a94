"""Model file -> nn.Module built on the meta device (no real weights) + the per-sample input shape."""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from rankaudit.errors import ModelLoadError, NoModelInFile, NoZeroArgumentModel, OutOfMemory, UsageError
from rankaudit.model import standins as import_standins
from rankaudit.model import supervise

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


# In-place ops that nn.init and reset_parameters() use. On meta tensors they change no value, yet the first
# call of several (normal_ above all) imports torch._dynamo: a second or two for nothing. Shapes never change.
_INITIALISERS = frozenset(
    {
        "normal_",
        "uniform_",
        "zero_",
        "fill_",
        "bernoulli_",
        "exponential_",
        "geometric_",
        "log_normal_",
        "cauchy_",
        "random_",
        "erfinv_",
        "clamp_",
        "clamp_min_",
        "clamp_max_",
        "mul_",
        "add_",
        "sub_",
        "div_",
        "copy_",
        "fmod_",
        "abs_",
        "sqrt_",
        "exp_",
        "neg_",
    }
)
# Factories torch.nn's own layers call for their weights and buffers (torch.empty(out, in) in nn.Linear).
_FACTORIES = frozenset({"empty", "zeros", "ones", "full", "rand", "randn", "tensor"})
_TORCH_NN_DIR = str(Path(nn.__file__).resolve().parent)

# How a model was built, as -v and the JSON's `build` say it.
BUILD_META_PARAMETERS = "meta-parameters"
BUILD_META = "meta"
BUILD_DEVICE = "device"


class _SkipMetaInitialisation(TorchFunctionMode):
    """While a model is built on meta, initialisers are no-ops (there are no values to initialise)."""

    def __init__(self):
        super().__init__()
        self.failed: tuple[str, BaseException] | None = None  # the last torch function that raised, and how

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            getattr(func, "__name__", "") in _INITIALISERS
            and args
            and isinstance(args[0], torch.Tensor)
            and args[0].is_meta
        ):
            return args[0]
        return self._call(func, args, kwargs or {})

    def _call(self, func, args, kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as exc:
            self.failed = (getattr(func, "__name__", None) or str(func), exc)
            raise


class _MetaParametersOnly(_SkipMetaInitialisation):
    """Parameters live on meta; every other tensor the constructor computes lives on the CPU, for real.

    Constructors compute with tensors (stage widths with torch arithmetic and .tolist(), relative-position
    tables, rotary frequencies) and need their values, which the meta device does not have. Only parameters
    are sure never to be read: they move to meta as they are registered (see _parameters_on_meta), and the
    factories of torch.nn's own layers (torch.empty(out, in) in nn.Linear) go straight to meta, so a
    10-billion-parameter model never allocates its weights even for a moment.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _INITIALISERS and args and isinstance(args[0], torch.Tensor) and args[0].is_meta:
            return args[0]
        if name in _FACTORIES and kwargs.get("device") is None and _called_from_torch_nn():
            kwargs = {**kwargs, "device": "meta"}
        return self._call(func, args, kwargs)


def _called_from_torch_nn() -> bool:
    # Frame 0 is _called_from_torch_nn, 1 the mode's __torch_function__, 2 whoever called the factory.
    caller = sys._getframe(2)
    return caller.f_code.co_filename.startswith(_TORCH_NN_DIR)


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter registered meanwhile is replaced by a meta copy (the technique of accelerate's
    init_empty_weights): nn.Module.__setattr__ and register_parameter both end here."""
    register = nn.Module.register_parameter

    def register_on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            try:
                moved = type(param)(param.detach().to("meta"), requires_grad=param.requires_grad)
            except TypeError:  # a Parameter subclass with other constructor arguments
                moved = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
            module._parameters[name] = moved

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _building_on(device: str, build: str = BUILD_DEVICE):
    """The context a model file runs in. On meta: either parameters only on meta (the constructor's own
    arithmetic on the CPU), or everything on meta; no initialisation work either way."""
    stack = contextlib.ExitStack()
    if device != "meta":
        stack.enter_context(torch.device(device))
        return stack, None
    if build == BUILD_META_PARAMETERS:
        stack.enter_context(_parameters_on_meta())
        mode = stack.enter_context(_MetaParametersOnly())
    else:
        stack.enter_context(torch.device("meta"))
        mode = stack.enter_context(_SkipMetaInitialisation())
    return stack, mode


def _everything_to_meta(model: nn.Module) -> None:
    """After construction, buffers and tensor attributes join the parameters on meta: the trace runs on meta
    and an op cannot mix devices. Nothing reads their values any more (the constructor has finished)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and not buffer.is_meta:
                module._buffers[name] = buffer.to("meta")
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not value.is_meta:
                setattr(module, name, value.to("meta"))
    if any(not p.is_meta for p in model.parameters()):
        # The file loaded real weights (torch.load at import, say); drop them: analysis needs shapes only.
        model.to("meta")


def split_model_spec(spec: str) -> tuple[Path, str | None]:
    """`path/to/model.py:Name` -> (path, "Name"); a bare path -> (path, None)."""
    path_text, name = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and _IDENTIFIER.match(tail) and head:
        path_text, name = head, tail
    path = Path(path_text)
    if not path.exists():
        raise UsageError(
            f"model file '{path_text}' does not exist",
            "give the path of a Python file that defines the model, e.g. examples/cnn6.py",
        )
    if path.is_dir():
        raise UsageError(
            f"'{path_text}' is a directory, not a model file", "give the path of a Python file, e.g. examples/cnn6.py"
        )
    return path, name


_SHAPE = re.compile(r"^\s*[(\[]?\s*(\d+(?:\s*[,x×]\s*\d+)*)\s*,?\s*[)\]]?\s*$")


# Larger than any real input, small enough that sizes stay within torch's 64-bit arithmetic with a batch on top.
MAX_DIMENSION = 2**31 - 1
MAX_SAMPLE_VALUES = 2**40


def check_shape_size(shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    """A shape rankaudit can trace: each dimension and the values per sample within the limits above (exit 2)."""
    values = 1
    for dimension in shape:
        values *= dimension
    if any(dimension > MAX_DIMENSION for dimension in shape) or values > MAX_SAMPLE_VALUES:
        shown = "x".join(str(dimension) for dimension in shape)
        raise UsageError(
            f"the input shape {shown} ({where}) has {values:.3g} values per sample, above the {MAX_SAMPLE_VALUES:.3g} "
            f"(and {MAX_DIMENSION:,} per dimension) rankaudit analyses",
            "give the shape of one real sample, without the batch dimension, e.g. 3,224,224",
        )
    return shape


def parse_input_shape(text: str) -> tuple[int, ...]:
    """'3,32,32', '3x32x32' or '(3, 32, 32)' -> (3, 32, 32); per sample, without the batch dimension."""
    match = _SHAPE.match(text)
    shape = tuple(int(d) for d in re.split(r"\s*[,x×]\s*", match.group(1))) if match else ()
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(
            f"malformed input shape '{text}'",
            "give positive integers per sample without the batch dimension, e.g. --input-shape 3,32,32",
        )
    return check_shape_size(shape, "--input-shape")


_DTYPES = {
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_input_dtype(text: str) -> torch.dtype | dict[str, torch.dtype]:
    """'int64' (every input) or 'input_ids=int64,attention_mask=int64' (per named input) -> dtypes."""

    def one(word: str) -> torch.dtype:
        key = word.strip().lower().removeprefix("torch.")
        if key not in _DTYPES:
            raise UsageError(
                f"unknown input dtype '{word.strip()}'",
                "give one of " + ", ".join(sorted(_DTYPES)) + ", e.g. --input-dtype int64",
            )
        return _DTYPES[key]

    if "=" not in text:
        return one(text)
    dtypes = {}
    for part in text.split(","):
        name, sep, word = part.partition("=")
        if not sep or not name.strip():
            raise UsageError(
                f"malformed input dtype '{text}'",
                "give one dtype (--input-dtype int64) or NAME=DTYPE pairs "
                "(--input-dtype input_ids=int64,attention_mask=int64)",
            )
        dtypes[name.strip()] = one(word)
    return dtypes


def _shape_from_file(value, path: Path) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
    def valid(shape) -> bool:
        return isinstance(shape, (tuple, list)) and bool(shape) and all(isinstance(d, int) and d > 0 for d in shape)

    if valid(value):
        return check_shape_size(tuple(value), f"INPUT_SHAPE in {path}")
    if isinstance(value, dict) and value and all(isinstance(k, str) and valid(v) for k, v in value.items()):
        return {name: check_shape_size(tuple(shape), f"INPUT_SHAPE in {path}") for name, shape in value.items()}
    raise UsageError(
        f"INPUT_SHAPE in {path} is {value!r}, not a tuple of positive integers",
        "set INPUT_SHAPE = (C, H, W) per sample, without the batch dimension, or a dict "
        '{"input_ids": (128,), "attention_mask": (128,)} for a model with several inputs',
    )


def _dtype_from_file(value, path: Path) -> torch.dtype | dict[str, torch.dtype] | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return parse_input_dtype(value)
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (torch.dtype, str)) for k, v in value.items()
    ):
        return {k: v if isinstance(v, torch.dtype) else parse_input_dtype(v) for k, v in value.items()}
    raise UsageError(
        f"INPUT_DTYPE in {path} is {value!r}, not a torch dtype",
        "set INPUT_DTYPE = torch.long for token ids (or a dict of dtypes per input name)",
    )


def _combine_shapes(given, from_file):
    """A shape from the command line replaces the file's; for a file with several inputs it replaces each
    input's shape (they usually share the sequence length: --input-shape 16 for ids and mask alike)."""
    if given is None:
        return from_file
    if isinstance(given, tuple) and isinstance(from_file, dict):
        return {name: given for name in from_file}
    return given


MODEL_MODULE_PREFIX = "rankaudit_model_"  # the module name a model file runs under: how its frames are found
_MODEL_PACKAGES: set[str] = set()  # top-level packages of model files that run under their package name


def _is_model_module(name: str) -> bool:
    return name.startswith(MODEL_MODULE_PREFIX) or name.split(".")[0] in _MODEL_PACKAGES


def _user_frame(exc: BaseException, path: Path) -> str:
    """The deepest traceback line inside the model file: where the user should look."""
    resolved = str(path.resolve())
    location = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if str(Path(frame.filename).resolve()) == resolved:
            location = f"{path}:{frame.lineno}"
    return location


def model_fault(exc: BaseException) -> ModelLoadError | None:
    """An exception raised inside a model file's own code (a frame of a module _execute_file ran), as the model's
    error: exit 3 with the file:line and the exception (issue 23), not an internal error of rankaudit's. None when
    no frame of a model file is on its traceback (or its cause's): then it is ours."""
    seen, current = set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        location, frame = None, current.__traceback__
        while frame is not None:
            if _is_model_module(str(frame.tb_frame.f_globals.get("__name__", ""))):
                location = (frame.tb_frame.f_code.co_filename, frame.tb_lineno)
            frame = frame.tb_next
        if location is not None:
            filename, line = location
            try:
                filename = os.path.relpath(filename)
            except ValueError:
                pass
            message = str(current).strip().splitlines()[0] if str(current).strip() else ""
            text = f"{type(current).__name__}: {message}" if message else type(current).__name__
            return ModelLoadError(
                f"the model's code raised {text} (at {filename}:{line})",
                "fix the model at that line (rankaudit ran it on real inputs to verify; --debug shows the traceback)",
            )
        current = current.__cause__ or current.__context__
    return None


def _describe_exception(exc: BaseException, path: Path) -> str:
    where = _user_frame(exc, path)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"{text} (at {where})" if where else text


class _ConstructionFailed(Exception):
    """One construction strategy failed; carries what the user needs to hear if every strategy fails."""

    def __init__(self, phase: str, error: BaseException, failed_op: str | None):
        super().__init__(str(error))
        self.phase = phase  # "import" or "build"
        self.error = error
        self.failed_op = failed_op


def _failing_op(mode, exc: BaseException) -> str | None:
    """The torch function that raised `exc`, when one did (not a ValueError of the user's own)."""
    if mode is None or mode.failed is None:
        return None
    name, raised = mode.failed
    chain, current = set(), exc
    while current is not None and id(current) not in chain:
        chain.add(id(current))
        if current is raised:
            return name
        current = current.__cause__ or current.__context__
    return None


def package_root(path: Path) -> tuple[Path, str | None]:
    """The folder that goes on sys.path for `path`, and its dotted module name when it sits in a package: walk up
    while the folder holds an __init__.py (pkg/task.py -> the folder above pkg, "pkg.task"), as `python -m` and
    Flower would import it. A file outside any package: its own folder, no dotted name."""
    folder, parts = path.resolve().parent, [path.stem]
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    return folder, (".".join(parts) if len(parts) > 1 else None)


def _execute_file(path: Path, device: str, build: str = BUILD_DEVICE):
    root, dotted = package_root(path)
    # In a package, the file runs as its own module (pkg.task), so `from pkg.x import ...` and relative imports
    # resolve as they do when the app runs; model_fault knows the package's frames as the model's.
    module_name = dotted or MODEL_MODULE_PREFIX + re.sub(r"\W", "_", path.stem)
    if dotted:
        _MODEL_PACKAGES.add(dotted.split(".")[0])
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"'{path}' is not a Python file", "give a .py file that defines the model")
    module = importlib.util.module_from_spec(spec)
    if dotted:  # a package of the same name imported from elsewhere (another app) would shadow this one's
        top = dotted.split(".")[0]
        for name in [name for name in sys.modules if name == top or name.startswith(top + ".")]:
            if not str(getattr(sys.modules[name], "__file__", None) or "").startswith(str(root)):
                del sys.modules[name]
    sys.modules[module_name] = module  # dataclasses and pickling look the module up by name
    directory = str(root)
    # A model file may import its neighbours (or its package's), as it would when run as a script or by the app.
    sys.path.insert(0, directory)
    mode = None
    try:
        context, mode = _building_on(device, build)
        with context, supervise.phase(f"the import of {path}"), import_standins.while_importing():
            spec.loader.exec_module(module)
    except (KeyboardInterrupt, GeneratorExit, SystemExit):  # SystemExit: the model ended the process (cli.main)
        raise
    except SyntaxError as exc:
        raise ModelLoadError(
            f"{path} does not parse: {exc.msg} (at {path}:{exc.lineno})", "fix the syntax error in the model file"
        ) from exc
    except BaseException as exc:  # the user's file can raise anything, SystemExit included
        if supervise.is_out_of_memory(exc):  # no second strategy and no re-run: each would take as much
            raise OutOfMemory(f"the import of {path}", supervise.describe_memory_limit()) from exc
        raise _ConstructionFailed("import", exc, _failing_op(mode, exc)) from exc
    finally:
        if sys.path and sys.path[0] == directory:
            sys.path.pop(0)
    return module


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
    mode = None
    try:
        context, mode = _building_on(device, build)
        with context, supervise.phase(f"the build of {attr}() from {path}"):
            built = obj(**(model_args or {}))
    except (KeyboardInterrupt, GeneratorExit, SystemExit):
        raise
    except BaseException as exc:
        if supervise.is_out_of_memory(exc):
            raise OutOfMemory(f"the build of {attr}() from {path}", supervise.describe_memory_limit()) from exc
        raise _ConstructionFailed("build", exc, _failing_op(mode, exc)) from exc
    if not isinstance(built, nn.Module):
        raise ModelLoadError(
            f"{attr}() in {path} returned a {type(built).__name__}, not an nn.Module",
            "make the factory return the model",
        )
    return built


_STANDALONE_CHECK = """
import importlib, json, resource, runpy, sys
limit = int(sys.argv[3])
if limit > 0:
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
# The same path as rankaudit's own import: the package root first, not the directory the command ran in.
sys.path[:] = [sys.argv[2]] + [entry for entry in sys.path if entry not in ("", ".")]
dotted = sys.argv[4]
namespace = vars(importlib.import_module(dotted)) if dotted else runpy.run_path(sys.argv[1],
                                                                               run_name="rankaudit_standalone_check")
if len(sys.argv) > 5:
    import torch.nn
    obj = namespace[sys.argv[5]]
    if not isinstance(obj, torch.nn.Module):
        obj(**json.loads(sys.argv[6]))
"""


def _runs_on_its_own(path: Path, attr: str | None, model_args: dict | None = None) -> tuple[bool | None, str]:
    """Does the file import (and, with `attr`, build) with plain PyTorch on the CPU, in a fresh process?

    (True, ""), (False, its error) or (None, why it could not be told). A separate process with a memory cap:
    a real build may be large, and the user's file should not run inside rankaudit with real weights.
    """
    import json
    import subprocess

    root, dotted = package_root(path)
    memory, seconds = int(supervise.memory_limit() * 1024**3), supervise.timeout()  # the run's own limits
    command = [sys.executable, "-c", _STANDALONE_CHECK, str(path), str(root), str(memory), dotted or ""]
    if attr is not None:
        try:
            command += [attr, json.dumps(model_args or {})]
        except TypeError:
            return None, "its factory arguments are not plain values"
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds)
    except subprocess.TimeoutExpired:
        return None, f"running it took over {seconds:g} s (--timeout)"
    if done.returncode == 0:
        return True, ""
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else f"exit status {done.returncode}"
    if "MemoryError" in last or "std::bad_alloc" in last or "DefaultCPUAllocator" in last:
        return None, f"it needs more than {supervise.describe_memory_limit()} with real weights (--memory-limit)"
    return False, last


def _construction_error(
    path: Path, attr: str | None, failure: _ConstructionFailed, model_args: dict | None = None
) -> ModelLoadError:
    """The one-line error when no construction worked: what failed, where, and whether the file runs on its own."""
    what = _describe_exception(failure.error, path)
    if failure.failed_op:
        what += f" in torch's {failure.failed_op}()"
    head = (
        f"{path} raised on import: {what}"
        if failure.phase == "import"
        else f"could not build {attr}() from {path}: {what}"
    )
    runs, detail = _runs_on_its_own(path, attr if failure.phase == "build" else None, model_args)
    command = f"python {path}"
    missing = failure.error.name if isinstance(failure.error, ModuleNotFoundError) else None
    if runs is False and failure.phase == "import" and missing:
        package = missing.split(".")[0]
        return ModelLoadError(
            f"{head}; the environment rankaudit runs in lacks {package}, which the model file imports",
            f"install {package} there; in a pre-commit hook, list it under the hook's additional_dependencies "
            f'(additional_dependencies: ["{package}"], with its PyPI name)',
        )
    if runs is False:
        fix = (
            "make the file importable on its own (`" + command + "` fails the same way)"
            if failure.phase == "import"
            else f"make {attr}() build with plain PyTorch, or add a zero-argument factory function and pass "
            f"{path}:factory"
        )
        return ModelLoadError(f"{head}; it fails with plain PyTorch too ({detail})", fix)
    if runs is True:
        where = "imports" if failure.phase == "import" else f"imports and {attr}() builds"
        return ModelLoadError(
            f"{head}; the file {where} with plain PyTorch on the CPU, so what fails is building "
            "without weights (parameters on the meta device)",
            "compute sizes from Python numbers or CPU tensors rather than from parameter values "
            "while building, or report this model to rankaudit with the line above",
        )
    return ModelLoadError(
        f"{head}; whether the file runs on its own could not be checked ({detail})",
        f"check that `{command}` runs, then report the model to rankaudit if it does",
    )


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
    raise NoModelInFile(
        f"no nn.Module subclass or instance is defined in {path}",
        "define the model class in that file, or name it with PATH:NAME",
    )


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
    build: str = BUILD_DEVICE  # which construction worked: meta-parameters, meta or device
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


def _construct(path: Path, name: str | None, device: str, model_args: dict | None = None):
    """Run the file and build its model; on meta, first with parameters only on meta, then all on meta."""
    builds = (BUILD_META_PARAMETERS, BUILD_META) if device == "meta" else (BUILD_DEVICE,)
    first_failure, attr = None, name
    for build in builds:
        try:
            namespace = _execute_file(path, device, build)
            attr, obj = _pick(namespace, name, path, model_args)
            model = _build(obj, attr, path, device, build, model_args)
        except _ConstructionFailed as failure:
            _needs_missing_module(failure.error, path)
            first_failure = first_failure or failure
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
        raise ModelLoadError(
            f"{path} imports {error.name}, which is not installed in the environment rankaudit runs in",
            f'install {top} there (in a pre-commit hook: additional_dependencies: ["{top}"], with its PyPI '
            f'name); or, if the model does not use it, pass --stand-in {top} (stand-ins = ["{top}"] in '
            "[tool.rankaudit])",
        ) from error
    if device != "meta":  # the verifier's real build: its error is the file's own
        what = _describe_exception(first_failure.error, path)
        if first_failure.phase == "import":
            raise ModelLoadError(
                f"{path} raised on import: {what}", f"make the file importable on its own (run `python {path}`)"
            ) from first_failure.error
        raise ModelLoadError(
            f"could not build {attr}() from {path}: {what}",
            f"give {attr} defaults for every argument, or add a zero-argument factory function and pass {path}:factory",
        ) from first_failure.error
    raise _construction_error(path, attr, first_failure, model_args) from first_failure.error


def _needs_missing_module(error: BaseException, path: Path) -> None:
    """The model used a module a stand-in replaced: exit 3 naming that module, not the stand-in's symptom."""
    current, seen = error, set()
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, import_standins.StandInUsed):
            raise ModelLoadError(
                f"the model in {path} needs {current.module}, which is not installed ({current.what})",
                f"install {current.module}",
            ) from error
        current = current.__cause__ or current.__context__


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
    namespace, attr, model, build = _construct(path, name, device, model_args)
    if device == "meta":
        _everything_to_meta(model)
    from_file = _shape_from_file(namespace.INPUT_SHAPE, path) if hasattr(namespace, "INPUT_SHAPE") else None
    input_shape = _combine_shapes(input_shape, from_file)
    if input_shape is None:
        raise UsageError(
            f"no input shape for {path}", "pass --input-shape C,H,W or set INPUT_SHAPE = (C, H, W) in the model file"
        )
    if input_dtype is None:
        input_dtype = _dtype_from_file(getattr(namespace, "INPUT_DTYPE", None), path)
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
