"""Stand-ins for missing third-party modules a model file imports but its model does not use (data, logging, FL)."""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import sys
import types
from contextlib import contextmanager

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
            with open(filename, encoding="utf-8") as handle:
                tree = ast.parse(handle.read())
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
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


def _guarded_import() -> bool:
    """The import runs inside `try: ... except ImportError`: the code has its own answer to a missing module."""
    frame = sys._getframe(2)
    while frame is not None and (
        frame.f_code.co_filename.startswith("<frozen") or "importlib" in frame.f_code.co_filename
    ):
        frame = frame.f_back
    if frame is None:
        return False
    line = frame.f_lineno
    return any(start <= line <= end for start, end in _guarded_lines(frame.f_code.co_filename))


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Last on sys.meta_path: only a module no other finder found reaches it."""

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if not _POLICY.allowed(top) or _guarded_import():
            return None
        if top == fullname and importlib.machinery.PathFinder.find_spec(fullname) is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        top = module.__name__.split(".")[0]
        if top not in _POLICY.used:
            _POLICY.used.append(top)


@contextmanager
def while_importing():
    """Stand-ins may be created and used while the model file runs; afterwards the finder and the stand-in
    modules leave sys.modules (nothing else sees them), and any use of one the file kept raises StandInUsed."""
    finder = _Finder()
    sys.meta_path.append(finder)
    _POLICY.used = []
    _POLICY.importing = True
    try:
        yield
    finally:
        _POLICY.importing = False
        sys.meta_path.remove(finder)
        for name in [name for name, module in sys.modules.items() if isinstance(module, _Module)]:
            del sys.modules[name]
