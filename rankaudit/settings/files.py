"""An app's files opened and parsed safely: regular files only, a size cap, a nesting and alias cap, parsers under
the model worker's memory and time limits, includes kept inside the app's folder; each refusal one line naming the
file (exit 2); and the check that a file a command reads (--weights, --data ...) is a regular file.

rankaudit reads a deployment's configuration in its own process, from folders it did not write: a config may be a
link to /dev/zero, a FIFO that never yields, a 370-byte YAML alias bomb, a HOCON substitution that doubles itself,
or nesting a recursive parser cannot climb out of. Every reader of an app's files (pyproject.toml, YAML, JSON, HOCON,
Python source) goes through here.
"""

from __future__ import annotations

import contextlib
import io
import os
import stat
from pathlib import Path

from rankaudit.errors import UsageError, one_line
from rankaudit.settings.limits import DEFAULT_TIMEOUT, default_memory_limit

CONFIG_BYTES = 1 << 20  # a configuration file (TOML, YAML, JSON, HOCON): real ones are a few KiB
SOURCE_BYTES = 16 << 20  # a Python source file of the app
MAX_DEPTH = 100  # nesting of maps and lists in a parsed configuration
MAX_NODES = 200_000  # values in a parsed configuration, aliases expanded (a YAML alias bomb has billions)
MAX_INCLUDES = 16  # HOCON includes in one configuration, all levels together
_RESULT_BYTES = 64 << 20  # what a parse may hand back from its process
_GIB = 1024**3

# The limits a parse runs under: the model worker's (--memory-limit and --timeout, else their configuration and
# defaults); rankaudit.model.supervise keeps them current.
_limits = {"gib": None, "seconds": None}


def use_limits(gib: float | None, seconds: float | None) -> None:
    """The memory (GiB, 0: none) and time (seconds) a parse of an app's file may take."""
    _limits["gib"], _limits["seconds"] = gib, seconds


def shown_path(path: Path | str) -> str:
    """A path as a one-line message quotes it (errors.one_line: a newline in a name cannot split the line)."""
    return one_line(path if isinstance(path, str) else os.fsdecode(path))


def read_bytes(path: Path, what: str = "configuration file", limit: int = CONFIG_BYTES) -> bytes:
    """A regular file's bytes, at most `limit` of them. A link is followed, but what it reaches must be a regular
    file: a device (/dev/zero), a FIFO or a socket is refused at once, without blocking on it."""
    name = shown_path(path)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        descriptor = os.open(path, flags)
    except OSError as exc:
        raise UsageError(
            f"cannot read the {what} {name}: {exc.strerror}", "check that it exists and is readable"
        ) from None
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise UsageError(
                f"the {what} {name} is not a regular file ({_kind(status.st_mode)}); rankaudit reads only files",
                "replace it with the file itself",
            )
        if status.st_size > limit:
            raise UsageError(
                f"the {what} {name} is {status.st_size:,} bytes, over the {limit:,} rankaudit reads",
                "shorten it, or move what is not configuration out of it",
            )
        with contextlib.suppress(OSError):
            os.set_blocking(descriptor, True)
        chunks, held = [], 0
        while held <= limit:
            chunk = os.read(descriptor, min(1 << 20, limit + 1 - held))
            if not chunk:
                break
            chunks.append(chunk)
            held += len(chunk)
        if held > limit:  # it grew while being read
            raise UsageError(f"the {what} {name} is over the {limit:,} bytes rankaudit reads", "shorten it")
        return b"".join(chunks)
    except OSError as exc:
        raise UsageError(f"cannot read the {what} {name}: {exc.strerror}", "check that it is readable") from None
    finally:
        os.close(descriptor)


def read_text(path: Path, what: str = "configuration file", limit: int = CONFIG_BYTES) -> str:
    """A regular file's text (UTF-8), as read_bytes bounds it."""
    try:
        return read_bytes(path, what, limit).decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"the {what} {shown_path(path)} is not UTF-8 text", "fix or replace that file") from None


def read_source(path: Path) -> str:
    """A Python file of the app, as text (a source file may be larger than a configuration)."""
    return read_text(path, "Python file", SOURCE_BYTES)


def _kind(mode: int) -> str:
    for test, word in (
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return word
    return "not a plain file"


def not_a_file(path: str | Path) -> str | None:
    """What `path` is when it exists and is no regular file ("a FIFO", "a folder", ...), through links; None for a
    regular file or one that is not there. Asked before a read that would block on a FIFO or fail on a folder."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return None if stat.S_ISREG(mode) else _kind(mode)


def input_file(path: str | Path, option: str, fix: str) -> None:
    """A file a command reads (--weights, --labels ...): one line, exit 2, saying what it is when it is not a
    regular file, or that it is not there."""
    kind = not_a_file(path)
    if kind is not None:
        raise UsageError(f"{option} {shown_path(path)} is {kind}, not a regular file", fix)
    if not os.path.exists(path):
        raise UsageError(f"{option} {shown_path(path)}: no such file", fix)


def inside(root: Path, path: Path) -> bool:
    """Whether `path`, links resolved, lies in the folder `root`."""
    try:
        return Path(os.path.realpath(path)).is_relative_to(os.path.realpath(root))
    except (OSError, ValueError):
        return False


def check_shape(value, path: Path) -> None:
    """A parsed configuration's nesting and size within MAX_DEPTH and MAX_NODES (shared values counted each time
    they appear, as a reader walking it would), else one line naming the file."""
    counted, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        counted += 1
        if depth > MAX_DEPTH:
            raise nests_too_deep(path)
        if counted > MAX_NODES:
            raise too_many_values(path)
        children = node.values() if isinstance(node, dict) else node if isinstance(node, (list, tuple)) else ()
        stack.extend((child, depth + 1) for child in children)


def nests_too_deep(path: Path) -> UsageError:
    return UsageError(
        f"the configuration file {shown_path(path)} nests more than {MAX_DEPTH} levels deep; rankaudit does not read "
        "it",
        "flatten that file",
    )


def too_many_values(path: Path) -> UsageError:
    return UsageError(
        f"the configuration file {shown_path(path)} expands to over {MAX_NODES:,} values (aliases or includes "
        "repeated); rankaudit does not read it",
        "write the values out instead of repeating aliases",
    )


# ---- a parse in a process of its own, under the memory and time limits --------------------------------------------


def bounded(parse, path: Path, *args):
    """parse(*args) in a forked process under the model worker's memory limit and time limit: a parser that a file
    makes allocate without end or never return is stopped with one line naming `path`. Its result comes back
    pickled (it holds only what the parser built from text). Where the system cannot fork, it runs here."""
    if not hasattr(os, "fork"):
        return _outcome(_attempt(parse, args), path)
    import select
    import signal
    import time

    seconds = _limits["seconds"] or DEFAULT_TIMEOUT
    read_end, write_end = os.pipe()
    try:
        pid = os.fork()
    except OSError:  # no process to spare (EAGAIN): the size and nesting caps still hold here
        os.close(read_end)
        os.close(write_end)
        return _outcome(_attempt(parse, args), path)
    if pid == 0:  # pragma: no cover - the forked process (its coverage is not collected)
        code = 70
        try:
            os.close(read_end)
            _limit_memory()
            data = _packed(_attempt(parse, args))
            while data:
                data = data[os.write(write_end, data) :]
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    chunks, held, deadline, late, too_large = [], 0, time.monotonic() + seconds, False, False
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                late = True
                break
            chunk = os.read(read_end, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            held += len(chunk)
            if held > _RESULT_BYTES:
                too_large = True
                break
    finally:
        os.close(read_end)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)
    if late:
        raise UsageError(
            f"reading the configuration file {shown_path(path)} took over {seconds:g} s (the time limit); rankaudit "
            "stopped it",
            "simplify that file (its substitutions or includes), or raise --timeout",
        )
    if too_large:
        return _outcome(("values",), path)
    if not chunks:  # the process ended without an answer: killed over the memory limit
        return _outcome(("memory",), path)
    try:
        outcome = _PlainData(io.BytesIO(b"".join(chunks))).load()
    except Exception as exc:  # noqa: BLE001 - an answer cut short, or holding more than plain data
        outcome = ("error", type(exc).__name__, str(exc)[:300])
    return _outcome(outcome, path)


def _packed(outcome: tuple) -> bytes:  # pragma: no cover - runs in the forked process
    import pickle

    try:
        data = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
    except MemoryError:
        return pickle.dumps(("memory",))
    except Exception as exc:  # a value the parser built that does not pickle
        return pickle.dumps(("error", type(exc).__name__, str(exc)[:300]))
    return data if len(data) <= _RESULT_BYTES else pickle.dumps(("values",))


class _PlainData:
    """Unpickles what a parser builds from text (dicts, lists, strings, numbers, dates, sets) and nothing else: no
    class the answer names is imported or called but these."""

    _ALLOWED = {
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("builtins", "bytearray"),
        ("datetime", "date"),
        ("datetime", "datetime"),
        ("datetime", "time"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
    }

    def __init__(self, stream):
        import pickle

        allowed = self._ALLOWED

        class Unpickler(pickle.Unpickler):
            def find_class(self, module, name):
                if (module, name) not in allowed:
                    raise pickle.UnpicklingError(f"{module}.{name} is not plain data")
                return super().find_class(module, name)

        self._unpickler = Unpickler(stream)

    def load(self):
        return self._unpickler.load()


def _attempt(parse, args) -> tuple:
    try:
        return ("ok", parse(*args))
    except UsageError as exc:
        return ("usage", exc.problem, exc.fix)
    except RecursionError:
        return ("deep",)
    except MemoryError:
        return ("memory",)
    except Exception as exc:  # the parser's own complaint: bad syntax, an unknown include
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return ("error", type(exc).__name__, text[:300])


class ParseFailed(ValueError):
    """The parser refused the file (its syntax); the caller decides whether that is an error or a note."""


def _outcome(outcome: tuple, path: Path):
    kind = outcome[0]
    if kind == "ok":
        return outcome[1]
    if kind == "usage":
        raise UsageError(outcome[1], outcome[2])
    if kind == "deep":
        raise nests_too_deep(path)
    if kind == "values":
        raise too_many_values(path)
    if kind == "memory":
        gib = _limits["gib"] if _limits["gib"] is not None else default_memory_limit()
        raise UsageError(
            f"reading the configuration file {shown_path(path)} went over the memory limit ({gib:g} GiB); rankaudit "
            "stopped it",
            "simplify that file (its aliases, substitutions or includes), or raise --memory-limit",
        )
    raise ParseFailed(outcome[2] or outcome[1])


def _limit_memory() -> None:  # pragma: no cover - runs in the forked process
    """RLIMIT_DATA at what the process holds when forked plus the limit (the parent may hold a loaded torch)."""
    gib = _limits["gib"] if _limits["gib"] is not None else default_memory_limit()
    if not gib or gib <= 0:
        return
    with contextlib.suppress(ImportError, ValueError, OSError, OverflowError):
        import resource

        held = 0
        with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmData:"):
                    held = int(line.split()[1]) * 1024
        limit = held + int(gib * _GIB)
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
