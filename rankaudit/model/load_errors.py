"""A model file that does not load, as the user's error: the line of its code that raised, whether it runs on its own."""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

from rankaudit.errors import ModelLoadError
from rankaudit.model import standins as import_standins
from rankaudit.model import supervise
from rankaudit.model.model_file import ConstructionFailed, package_root


def _user_frame(exc: BaseException, path: Path) -> str:
    """The deepest traceback line inside the model file: where the user should look."""
    resolved = str(path.resolve())
    location = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        if str(Path(frame.filename).resolve()) == resolved:
            location = f"{path}:{frame.lineno}"
    return location


def describe_exception(exc: BaseException, path: Path) -> str:
    where = _user_frame(exc, path)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return f"{text} (at {where})" if where else text


_STANDALONE_CHECK = """
import contextlib, importlib, json, os, pathlib, resource, runpy, sys
limit = int(sys.argv[3])
if limit > 0:
    resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
# The same path as rankaudit's own import: the package root first, not the directory the command ran in.
sys.path[:] = [sys.argv[2]] + [entry for entry in sys.path if entry not in ("", ".")]
# The modules rankaudit may stand in for (defaults, --stand-in) are stood in for here too: the check is about
# the model, not a plot library the environment lacks.
stood_in = [name for name in os.environ.get("RANKAUDIT_STAND_INS", "").split(",") if name]
if stood_in:
    from rankaudit.model import standins
    standins.set_flags(tuple(stood_in), False)
    context = standins.while_importing(pathlib.Path(sys.argv[2]))  # the user's files: its package root
else:
    context = contextlib.nullcontext()
with context:
    dotted = sys.argv[4]
    namespace = (vars(importlib.import_module(dotted)) if dotted
                 else runpy.run_path(sys.argv[1], run_name="rankaudit_standalone_check"))
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
    import os

    environment = {**os.environ, "RANKAUDIT_STAND_INS": ",".join(import_standins.allowed_names())}
    rankaudit_root = str(Path(__file__).resolve().parents[2])  # so the check finds the stand-ins' module
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [rankaudit_root, os.environ.get("PYTHONPATH")]))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=seconds, env=environment)
    except subprocess.TimeoutExpired:
        return None, f"running it took over {seconds:g} s (--timeout)"
    if done.returncode == 0:
        return True, ""
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    last = lines[-1].strip() if lines else f"exit status {done.returncode}"
    if "MemoryError" in last or "std::bad_alloc" in last or "DefaultCPUAllocator" in last:
        return None, f"it needs more than {supervise.describe_memory_limit()} with real weights (--memory-limit)"
    return False, last


def construction_error(
    path: Path, attr: str | None, failure: ConstructionFailed, model_args: dict | None = None
) -> ModelLoadError:
    """The one-line error when no construction worked: what failed, where, and whether the file runs on its own."""
    what = describe_exception(failure.error, path)
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
            f"install {package} there; in a pre-commit hook with an environment of its own (not repo: local), list "
            f'it under the hook\'s additional_dependencies (additional_dependencies: ["{package}"], its PyPI name)',
        )
    unavailable = _missing_module(detail) if runs is False else None
    if unavailable is not None:
        # Not the model's fault: the check stopped at an import this environment lacks.
        return ModelLoadError(
            f"{head}; run on its own, the file stops earlier: it imports {unavailable}, which is not installed in "
            "the environment rankaudit runs in",
            f"install {unavailable} there; or, if the model does not use it, pass --stand-in {unavailable} "
            f'(stand-ins = ["{unavailable}"] in [tool.rankaudit])',
        )
    if runs is False:
        fix = (
            "make the file importable on its own (`" + command + "` fails the same way)"
            if failure.phase == "import"
            else f"make {attr}() build with plain PyTorch, or add a zero-argument factory function and pass "
            f"{path}:factory"
        )
        if failure.phase == "build" and "required positional argument" in detail:
            fix = (
                f"pass {attr}()'s arguments with --model-arg KEY=VALUE (model-args in [tool.rankaudit]), or add a "
                f"zero-argument factory function and pass {path}:factory"
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


def _missing_module(detail: str) -> str | None:
    """The top-level module of "ModuleNotFoundError: No module named 'x.y'", the last line of a failed check."""
    prefix = "ModuleNotFoundError: No module named "
    if not detail.startswith(prefix):
        return None
    return detail[len(prefix) :].strip("'\"").split(".")[0] or None


def needs_missing_module(error: BaseException, path: Path) -> None:
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
