"""The user's model file run as a module of its own, under the build context."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import sys
from pathlib import Path

from rankaudit.errors import ModelLoadError, OutOfMemory, UsageError
from rankaudit.model import standins as import_standins
from rankaudit.model import supervise
from rankaudit.model.faults import MODEL_MODULE_PREFIX, MODEL_PACKAGES
from rankaudit.model.meta_device import BUILD_DEVICE, building_on, failing_op


class ConstructionFailed(Exception):
    """One construction strategy failed; carries what the user needs to hear if every strategy fails."""

    def __init__(self, phase: str, error: BaseException, failed_op: str | None):
        super().__init__(str(error))
        self.phase = phase  # "import" or "build"
        self.error = error
        self.failed_op = failed_op


def package_root(path: Path) -> tuple[Path, str | None]:
    """The folder that goes on sys.path for `path`, and its dotted module name when it sits in a package: walk up
    while the folder holds an __init__.py (pkg/task.py -> the folder above pkg, "pkg.task"), as `python -m` and
    Flower would import it. A file outside any package: its own folder, no dotted name."""
    folder, parts = path.resolve().parent, [path.stem]
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        parts.insert(0, folder.name)
        folder = folder.parent
    if len(parts) == 1:  # no __init__.py: a namespace package the file imports by its own name is the app's
        return _namespace_root(path.resolve())
    return folder, ".".join(parts)


def _namespace_root(path: Path) -> tuple[Path, str | None]:
    """A file in folders without __init__.py that imports its own package by name (FedPer's
    fedper/implemented_models/mobile_model.py: `from fedper.models import ...`, run as `python -m fedper.main`): the
    folder above that package goes on sys.path, the file runs as fedper.implemented_models.mobile_model."""
    import ast

    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return path.parent, None
    imported = {
        name.split(".")[0]
        for node in ast.walk(tree)
        for name in ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
        + ([alias.name for alias in node.names] if isinstance(node, ast.Import) else [])
    }
    for ancestor in path.parents:
        if ancestor.name in imported and ancestor.parent != ancestor and not _installed(ancestor.name, ancestor):
            dotted = path.relative_to(ancestor.parent).with_suffix("").parts
            if all(part.isidentifier() for part in dotted):
                return ancestor.parent, ".".join(dotted)
    return path.parent, None


@contextlib.contextmanager
def quiet_app_logs():
    """The app's own INFO and DEBUG log lines (an app module's `logging.basicConfig(level=logging.INFO)` and the
    lines it logs while it is imported and built) stay out of rankaudit's stderr; its warnings and errors show."""
    previous = logging.root.manager.disable
    logging.disable(max(previous, logging.INFO))
    try:
        yield
    finally:
        logging.disable(previous)


def _installed(name: str, folder: Path) -> bool:
    """Whether `name` is a module the environment already has (torch, a library) somewhere other than `folder`:
    a folder of that name is never taken for the app's own package, whose import would then shadow it."""
    if name in sys.stdlib_module_names:
        return True
    module = sys.modules.get(name)
    try:
        spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
    except (ImportError, ValueError, AttributeError):
        return False
    if spec is None:
        return module is not None
    places = [spec.origin] if spec.origin and spec.origin not in ("namespace", "built-in", "frozen") else []
    places += list(spec.submodule_search_locations or [])
    return not places or any(not Path(place).resolve().is_relative_to(folder) for place in places)


def execute_file(path: Path, device: str, build: str = BUILD_DEVICE):
    root, dotted = package_root(path)
    # In a package, the file runs as its own module (pkg.task), so `from pkg.x import ...` and relative imports
    # resolve as they do when the app runs; model_fault knows the package's frames as the model's.
    module_name = dotted or MODEL_MODULE_PREFIX + re.sub(r"\W", "_", path.stem)
    if dotted:
        MODEL_PACKAGES.add(dotted.split(".")[0])
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
        context, mode = building_on(device, build)
        with context, supervise.phase(f"the import of {path}"), import_standins.while_importing(root):
            spec.loader.exec_module(module)
    except (KeyboardInterrupt, GeneratorExit, SystemExit):  # SystemExit: the model ended the process (cli.main)
        raise
    except SyntaxError as exc:
        raise ModelLoadError(
            f"{path} does not parse: {exc.msg} (at {path}:{exc.lineno})", "fix the syntax error in the model file"
        ) from exc
    except BaseException as exc:  # the user's file can raise anything, SystemExit included
        if supervise.is_out_of_memory(exc):  # no second strategy and no re-run: each would take as much
            raise OutOfMemory(f"the import of {path}", supervise.describe_memory_limit(), exc) from exc
        raise ConstructionFailed("import", exc, failing_op(mode, exc)) from exc
    finally:
        if sys.path and sys.path[0] == directory:
            sys.path.pop(0)
    return module
