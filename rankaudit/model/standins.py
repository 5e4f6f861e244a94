"""Stand-ins for missing third-party modules a model file imports but its model does not use (data, logging, FL)."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.abc
import importlib.machinery
import os
import site
import sys
import sysconfig
import traceback
import types
from contextlib import contextmanager
from pathlib import Path

from rankaudit.errors import UsageError
from rankaudit.settings.files import read_source

# Packages an app imports for data, logging, configuration or the federation itself, not for its model: when one
# is not installed, the model file is still imported, with a stand-in in its place (as Sphinx's autodoc mocks).
DEFAULT_STAND_INS = (
    "datasets",
    "flwr",
    "flwr_datasets",
    "nvflare",
    "wandb",
    "hydra",
    "omegaconf",
    "mlflow",
    "tensorboard",
    "tensorboardX",
    "tqdm",
    "opacus",
    "torchvision",
    "pandas",
    "sklearn",
    "matplotlib",
    "PIL",
    "evaluate",
    "ray",
)


class StandInUsed(Exception):
    """The model used a module that is not installed while it was built or traced."""

    def __init__(self, module: str, what: str):
        super().__init__(f"{what} of the missing module {module}")
        self.module, self.what = module, what


class _Policy:
    def __init__(self):
        self.flags: tuple[tuple[str, ...], bool] = ((), False)  # --stand-in MODULE..., --no-stand-ins
        self.configured: tuple[tuple[str, ...], bool] = ((), False)  # [tool.rankaudit] stand-ins
        self.used: list[str] = []  # top-level modules a stand-in replaced, in the order the file imported them
        self.importing = False
        self.created = False  # a stand-in module may be in sys.modules

    def allowed(self, top: str) -> bool:
        (flag_added, flag_forbidden), (config_added, config_forbidden) = self.flags, self.configured
        if flag_forbidden or (config_forbidden and top not in flag_added):
            return False
        return top in DEFAULT_STAND_INS or top in flag_added or top in config_added


_POLICY = _Policy()


def set_flags(added=(), forbidden: bool | None = None) -> None:
    """--stand-in MODULE (repeatable) adds modules, --no-stand-ins forbids every stand-in (each run sets both)."""
    current_added, current_forbidden = _POLICY.flags
    _POLICY.flags = (
        tuple(added) if added is not None else current_added,
        bool(forbidden) if forbidden is not None else current_forbidden,
    )


def set_configured(value) -> None:
    """`stand-ins` in [tool.rankaudit]: a list of modules to add, or false for none (flags win)."""
    _POLICY.configured = ((), True) if value is False else (tuple(value or ()), False)


def allowed_names() -> list[str]:
    """Every top-level module a stand-in may replace under the current flags and configuration."""
    (flag_added, _), (config_added, _) = _POLICY.flags, _POLICY.configured
    names = dict.fromkeys([*DEFAULT_STAND_INS, *flag_added, *config_added])
    return [name for name in names if _POLICY.allowed(name)]


def used() -> list[str]:
    return list(_POLICY.used)


def _check(module: str, what: str) -> None:
    if not _POLICY.importing:
        raise StandInUsed(module, what)


class _StandIn:
    """Any attribute, call or subclass of a missing module while the file is imported; an error afterwards."""

    def __init__(self, name: str):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attribute: str):
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)
        return _StandIn(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        _check(self._name.split(".")[0], f"a call of {self._name}")
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]  # a decorator (@app.train(), @hydra.main(...)) leaves the function as it is
        return _StandIn(f"{self._name}()")

    def __mro_entries__(self, bases):
        return (_stand_in_class(self._name),)

    def __iter__(self):
        return iter(())

    def __bool__(self):
        return False

    def __repr__(self):
        return f"<stand-in for {self._name}>"


def _stand_in_class(name: str) -> type:
    def __init__(self, *args, **kwargs):
        _check(name.split(".")[0], f"an instance of a subclass of {name}")

    return type(name.rsplit(".", 1)[-1], (), {"__init__": __init__, "_stand_in_for": name})


def stands_in(obj) -> str | None:
    """The missing module an object's class (or a class itself) derives from, if any."""
    for cls in (obj if isinstance(obj, type) else type(obj)).__mro__:
        name = cls.__dict__.get("_stand_in_for")
        if name:
            return name
    return None


class _Module(types.ModuleType):
    def __getattr__(self, attribute: str):
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)
        return _StandIn(f"{self.__name__}.{attribute}")


_GUARDS: dict[str, list[tuple[int, int]]] = {}  # file -> line ranges of `try:` bodies that catch ImportError
_CATCHING = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def _guarded_lines(filename: str) -> list[tuple[int, int]]:
    if filename not in _GUARDS:
        ranges = []
        try:
            tree = ast.parse(read_source(Path(filename)))
        except (UsageError, SyntaxError, ValueError, RecursionError, MemoryError):
            tree = None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, ast.Try) and node.body:
                caught = set()
                for handler in node.handlers:
                    kinds = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
                    caught |= {"Exception" if kind is None else ast.unparse(kind).split(".")[-1] for kind in kinds}
                if caught & _CATCHING:
                    ranges.append((node.body[0].lineno, node.body[-1].end_lineno or node.body[-1].lineno))
        _GUARDS[filename] = ranges
    return _GUARDS[filename]


def _guarded_import(frame) -> bool:
    """The import runs inside `try: ... except ImportError`: the code has its own answer to a missing module."""
    line = frame.f_lineno
    return any(start <= line <= end for start, end in _guarded_lines(frame.f_code.co_filename))


_IMPORT_MACHINERY = tuple(
    {
        str(Path(importlib.__file__).parent) + os.sep,
        str(Path(importlib.__file__).resolve().parent) + os.sep,
        __file__,
        str(Path(__file__).resolve()),
    }
)


def _importer():
    """The frame that asked for a module: the first one outside the import system and this module."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename.startswith(_IMPORT_MACHINERY)
    ):
        frame = frame.f_back
    return frame


def _installed_places() -> tuple[str, ...]:
    """Folders that hold the interpreter's library and installed packages: code there is never the user's."""
    places = {sysconfig.get_path(name) for name in ("stdlib", "platstdlib", "purelib", "platlib")}
    places |= set(getattr(site, "getsitepackages", list)()) | {getattr(site, "getusersitepackages", str)()}
    return tuple(str(Path(place).resolve()) + os.sep for place in places if place)


class _UserCode:
    """The files a stand-in answers: the model file and its neighbours (its folder, or its package's), never an
    installed library. A library that asks whether a package exists (importlib.util.find_spec, the metadata)
    or imports one learns the truth, so its own optional imports behave as they do without rankaudit."""

    def __init__(self, folder: Path | None):
        self.folder = str(folder.resolve()) + os.sep if folder is not None else None
        self.installed = _installed_places()
        self.answers: dict[str, bool] = {}

    def wrote(self, frame) -> bool:
        return self.wrote_file(frame.f_code.co_filename)

    def wrote_file(self, filename: str) -> bool:
        if filename not in self.answers:
            resolved = str(Path(filename).resolve()) if not filename.startswith("<") else filename
            self.answers[filename] = (
                self.folder is not None
                and resolved.startswith(self.folder)
                and not resolved.startswith(self.installed)
                and not any(part in ("site-packages", "dist-packages") for part in Path(resolved).parts)
            )
        return self.answers[filename]


def library_import(error: BaseException, user_folder: Path) -> str | None:
    """The installed library whose import statement raised `error` (a missing module), or None when the model's
    own files made it: a stand-in answers only those, so --stand-in cannot help a library."""
    frames = [
        frame
        for frame in traceback.extract_tb(error.__traceback__)
        if not frame.filename.startswith("<frozen") and not frame.filename.startswith(_IMPORT_MACHINERY)
    ]
    if not frames:
        return None
    importer = frames[-1].filename
    return None if _UserCode(user_folder).wrote_file(importer) else importer


def _forget_stand_ins() -> None:
    """Take the stand-in modules out of sys.modules: the user's file holds its own references to them, and a
    library that looks a package up there (importlib.util.find_spec does) must not find a stand-in."""
    _POLICY.created = False
    for name in [name for name, module in sys.modules.items() if isinstance(module, _Module)]:
        del sys.modules[name]


def _forgetting_after_user_imports(user_code: _UserCode, original_import):
    """builtins.__import__ that takes the stand-ins back out of sys.modules once an import statement of the
    user's files has bound them (a library imported next must not find them there)."""

    def import_then_forget(name, globals=None, locals=None, fromlist=(), level=0):
        try:
            return original_import(name, globals, locals, fromlist, level)
        finally:
            if _POLICY.created and user_code.wrote(sys._getframe(1)):
                _forget_stand_ins()

    return import_then_forget


class _Gatekeeper(importlib.abc.MetaPathFinder):
    """First on sys.meta_path: every import of a module not yet loaded passes here. One that a library makes
    first takes the stand-ins out of sys.modules, then lets the ordinary finders answer."""

    def __init__(self, user_code: _UserCode):
        self.user_code = user_code

    def find_spec(self, fullname, path=None, target=None):
        if _POLICY.created and not isinstance(sys.modules.get(fullname.split(".")[0]), _Module):
            importer = _importer()
            if importer is None or not self.user_code.wrote(importer):
                _forget_stand_ins()
        return None


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: only a module no other finder found reaches it, and it answers only the user's
    own files."""

    def __init__(self, user_code: _UserCode):
        self.user_code = user_code

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if not _POLICY.allowed(top):
            return None
        importer = _importer()
        if importer is None or not self.user_code.wrote(importer) or _guarded_import(importer):
            return None
        if top == fullname and importlib.machinery.PathFinder.find_spec(fullname) is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        _POLICY.created = True
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        top = module.__name__.split(".")[0]
        if top not in _POLICY.used:
            _POLICY.used.append(top)


@contextmanager
def while_importing(user_folder: Path | None = None):
    """Stand-ins may be created and used while the model file runs, for the imports of the files under
    `user_folder`; afterwards the finders and the stand-in modules leave sys.modules (nothing else sees them),
    and any use of one the file kept raises StandInUsed."""
    user_code = _UserCode(user_folder)
    finder, gatekeeper = _Finder(user_code), _Gatekeeper(user_code)
    sys.meta_path.insert(0, gatekeeper)
    sys.meta_path.append(finder)
    original_import = builtins.__import__
    builtins.__import__ = _forgetting_after_user_imports(user_code, original_import)
    _POLICY.used = []
    _POLICY.importing = True
    try:
        yield
    finally:
        _POLICY.importing = False
        sys.meta_path.remove(finder)
        sys.meta_path.remove(gatekeeper)
        builtins.__import__ = original_import
        _forget_stand_ins()
