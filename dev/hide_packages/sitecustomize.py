"""Hide installed packages from this Python, as if they were not installed (CI's environment without torchvision).

Put this folder on PYTHONPATH and name the packages in RANKAUDIT_HIDE_PACKAGES (comma-separated import names,
e.g. ``torchvision,flwr,opacus``): importing one raises ModuleNotFoundError, ``importlib.util.find_spec`` answers
None and ``importlib.metadata`` finds no distribution of that name. Child processes inherit both variables, so
the processes rankaudit supervises see the same environment. Without the variable nothing changes.

Every finder on ``sys.meta_path`` at start-up (the path finder, editable-install finders) is wrapped to answer
None for the hidden names, so a finder added later (rankaudit's stand-ins among them) sees them as missing, as it
would in an environment without them. A sitecustomize this one shadows still runs.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import re
import sys

HIDDEN = frozenset(name.strip() for name in os.environ.get("RANKAUDIT_HIDE_PACKAGES", "").split(",") if name.strip())


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


_HIDDEN_DISTRIBUTIONS = frozenset(_normalised(name) for name in HIDDEN)


def hidden(fullname: str) -> bool:
    return fullname.split(".")[0] in HIDDEN


class _HidingFinder:
    """A finder of sys.meta_path that no longer finds the hidden packages, modules or distributions."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, fullname, path=None, target=None):
        if hidden(fullname):
            return None
        find = getattr(self._finder, "find_spec", None)
        return find(fullname, path, target) if find is not None else None

    def find_distributions(self, *args, **kwargs):
        find = getattr(self._finder, "find_distributions", None)
        for distribution in find(*args, **kwargs) if find is not None else ():
            name = distribution.metadata["Name"] or ""
            if _normalised(name) not in _HIDDEN_DISTRIBUTIONS:
                yield distribution

    def invalidate_caches(self):
        invalidate = getattr(self._finder, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()

    def __getattr__(self, name):
        return getattr(self._finder, name)

    def __repr__(self):
        return f"<hiding {', '.join(sorted(HIDDEN))} from {self._finder!r}>"


def _run_shadowed_sitecustomize() -> None:
    """Python runs the first sitecustomize on sys.path only: run the one this file shadows, if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    others = [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if HIDDEN:
    sys.meta_path[:] = [_HidingFinder(finder) for finder in sys.meta_path]
    for name in [name for name in sys.modules if hidden(name)]:
        del sys.modules[name]
_run_shadowed_sitecustomize()
