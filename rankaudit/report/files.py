"""Report files: their paths checked before the analysis, and written atomically (a temporary file, then a rename)."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from pathlib import Path

from rankaudit.errors import RankauditError, UsageError

_STDOUT = ("/dev/stdout", "/dev/fd/1", "/proc/self/fd/1")


def _os_error(exc: OSError) -> str:
    return f"[Errno {exc.errno}] {exc.strerror}" if exc.strerror else str(exc)


def _refuse(option: str, path: str, problem: str, fix: str):
    raise UsageError(f"{option} {path}: {problem}", fix)


def _check_file(option: str, path: str) -> None:
    """Can a report be written at `path`? Opened for writing without truncating it, and removed again if this
    check created it: a missing folder, a read-only place or a name too long shows up here, before the analysis."""
    if os.path.isdir(path):
        _refuse(option, path, "is a folder", f"give a file name, e.g. {option} {os.path.join(path, 'report')}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        _refuse(option, path, f"the folder {folder} {what}", "create the folder first, or write the report elsewhere")
    existed = os.path.exists(path)
    if existed and not os.path.isfile(path):  # a device or a pipe: opening a pipe would wait for its reader
        if not os.access(path, os.W_OK):
            _refuse(option, path, "cannot be written (permission denied)", "choose a writable path")
        if stat.S_ISSOCK(os.stat(path).st_mode):
            _refuse(option, path, "is a socket, which a report cannot be written to", "give a file name")
        if stat.S_ISFIFO(os.stat(path).st_mode):  # held open until the report is written: closing it would end
            _held_fifos.setdefault(os.path.realpath(path), _open_fifo(option, path))  # the reader's input
        return
    try:
        descriptor = os.open(path, os.O_WRONLY | (0 if existed else os.O_CREAT | os.O_EXCL), 0o666)
    except OSError as exc:
        _refuse(
            option,
            path,
            f"cannot be written ({_os_error(exc)})",
            "choose a writable path" + (" with a shorter name" if exc.errno == errno.ENAMETOOLONG else ""),
        )
    os.close(descriptor)
    if not existed:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _check_appended(option: str, path: str) -> None:
    """Can lines be appended to `path`? A regular file, or one that can be created: a pipe would hold the run until
    something reads it, a device is no log."""
    if os.path.exists(path) and not os.path.isfile(path):
        mode = os.stat(path).st_mode
        what = "a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else "not a file"
        _refuse(option, path, f"is {what}; lines are appended to a regular file", "give a file name")
    _check_file(option, path)


_held_fifos: dict[str, int] = {}  # named pipes checked, by their real path: the descriptor the report goes to


def _open_fifo(option: str, path: str) -> int:
    """A named pipe opened for writing without waiting: a pipe no process reads would block the run for ever."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno != errno.ENXIO:
            raise
        _refuse(
            option,
            path,
            "is a named pipe (FIFO) that no process reads",
            "start its reader first (`cat PATH &`), or write the report to a file",
        )
    os.set_blocking(descriptor, True)
    return descriptor


def _check_folder(option: str, path: str) -> None:
    """--artifacts: an existing folder, or one that can be created under its nearest existing parent."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            _refuse(option, path, "exists and is not a folder", "name a folder, or remove that file")
        if not os.access(path, os.W_OK | os.X_OK):
            _refuse(option, path, "is not writable", "choose a writable folder")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        _refuse(option, path, f"{parent} is not a folder", "choose a path under a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        _refuse(option, path, f"the folder {parent} is not writable", "choose a writable folder")


def _same_file(first: str, second: str) -> bool:
    if os.path.exists(first) and os.path.exists(second):
        with contextlib.suppress(OSError):
            return os.path.samefile(first, second)
    return os.path.realpath(first) == os.path.realpath(second)


# Inside a folder given as an input (an app's directory, a --data folder), the files that are read.
_READ_IN_FOLDERS = (".py", ".toml", ".npy", ".npz", ".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _inside(path: str, folder: str) -> bool:
    real, root = os.path.realpath(path), os.path.realpath(folder)
    return real != root and real.startswith(root.rstrip(os.sep) + os.sep)


def _names_input(path: str, input_path: str) -> bool:
    """Would writing `path` overwrite `input_path` (the same file through a link, `..` or a hard link), or a file
    read from the input folder `input_path`?"""
    if os.path.isdir(input_path):
        return _inside(path, input_path) and os.path.splitext(path)[1].lower() in _READ_IN_FOLDERS
    return _same_file(path, input_path)


def refuse_inputs(outputs: dict[str, str | None], inputs: list[tuple[str, str | None]]) -> None:
    """An output path naming one of the command's inputs (the model file, its configuration, --data, ...) is
    refused (exit 2): the report would overwrite what it was made from."""
    for option, path in outputs.items():
        if not path or os.path.abspath(path) in _STDOUT:
            continue
        for what, input_path in inputs:
            if input_path and os.path.exists(input_path) and _names_input(path, input_path):
                named = f"is a file read from {what}" if os.path.isdir(input_path) else f"names {what}"
                raise UsageError(
                    f"{option} {path} {named} {input_path}: the report would overwrite it",
                    f"give {option} a file of its own, not one the command reads",
                )


def command_inputs(specs, **files: str | None) -> list[tuple[str, str | None]]:
    """What a command reads, as (what, path): each model file (or app folder), the pyproject.toml configuring it,
    and the data files given by option (`data="--data"`'s value ...). No output may name one of them."""
    from rankaudit.settings.pyproject import find_pyproject

    inputs: list[tuple[str, str | None]] = []
    for spec in specs:
        path = spec
        if not os.path.exists(path) and ":" in spec:
            path = spec.rsplit(":", 1)[0]
        inputs.append(("the app folder" if os.path.isdir(path) else "the model file", path))
        if os.path.exists(path):
            try:
                config = find_pyproject(Path(path) / "model.py" if os.path.isdir(path) else Path(path))
            except RankauditError:  # a malformed file is reported where it is read, with its fix
                config = None
            if config is not None:
                inputs.append(("the configuration", str(config)))
    inputs += [(f"the {option.replace('_', '-')} input", value) for option, value in files.items() if value]
    return inputs


def check_outputs(
    output: str | None = None,
    html: str | None = None,
    artifacts: str | None = None,
    inputs: list[tuple[str, str | None]] | None = None,
    log: str | None = None,
) -> None:
    """Every output path of a command, before any model code runs: one line and exit 2 for one that cannot work
    (`inputs`: what the command reads, as (what, path): no output may name one; `log`: a file lines are appended
    to, --log)."""
    if output and html and _same_file(output, html):
        raise UsageError(f"-o and --html both name {output}", "give the HTML report its own file name")
    if output and log and _same_file(output, log):
        raise UsageError(f"-o and --log both name {output}", "give the log its own file name")
    refuse_inputs({"-o": output, "--html": html, "--log": log}, inputs or [])
    if log:
        _check_appended("--log", log)
    for option, path in (("-o", output), ("--html", html)):
        if path:
            _check_file(option, path)
    if artifacts:
        _check_folder("--artifacts", artifacts)


def write_file(path: str, text: str) -> None:
    """Write a report at `path`: into a temporary file in the same folder, renamed over `path` once complete, so
    a failed write (a full disk) leaves the old file or nothing. A device or a pipe (/dev/stdout, /dev/full) is
    written directly. An OSError is a UsageError (exit 2) naming the path."""
    if os.path.abspath(path) in _STDOUT:  # fd 1 is stderr while the model's code runs: the report's stdout
        from rankaudit.model import supervise

        supervise.write_stdout(text)
        return
    data = text.encode("utf-8")
    target = os.path.realpath(path)  # through a symbolic link, as a plain write would go
    try:
        mode = os.stat(target).st_mode
    except OSError:
        mode = None
    try:
        if mode is not None and stat.S_ISFIFO(mode):
            held = _held_fifos.pop(target, None)
            with open(held if held is not None else _open_fifo("the report file", target), "wb") as handle:
                handle.write(data)
            return
        if mode is not None and not stat.S_ISREG(mode):
            with open(target, "wb") as handle:
                handle.write(data)
            return
        try:
            descriptor, temporary = tempfile.mkstemp(prefix=".rankaudit-", suffix=".tmp", dir=os.path.dirname(target))
        except PermissionError:
            if mode is None:
                raise
            # A writable file in a folder we may not add to: write it in place (not atomic, but as asked).
            with open(target, "wb") as handle:
                handle.write(data)
            return
        try:
            with os.fdopen(descriptor, "wb") as handle:
                handle.write(data)
            permissions = stat.S_IMODE(mode) if mode is not None else 0o666 & ~_umask()
            os.chmod(temporary, permissions)
            os.replace(temporary, target)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
    except OSError as exc:
        raise UsageError(
            f"could not write the report to {path} ({_os_error(exc)}); nothing was written there",
            "free space or choose another path",
        ) from exc


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current
