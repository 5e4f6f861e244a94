"""The model's code runs in a worker process forked for it; what it hands back is data, read without running code.

The supervised child (rankaudit.model.supervise) reads the settings, computes the bounds, the findings, the report
and the verdict, and hands them to the parent. It never imports the model file: each step that runs the model's
code (import, build and trace; a verifier's attack; suggest's edits) runs in a worker forked off it, which closes
the report pipe first. A model that calls rankaudit's own functions, or rewrites them, changes what its worker
computes, never the report or the exit code. See docs/limits.md ("A model file is code you run").

What the worker hands back is pickled, and read here with only rankaudit's own classes, torch's dtypes and sizes,
numpy's arrays and the builtin containers allowed: no name the pickle gives can import the model file or call a
function. A worker that ends without handing anything back ends this process the same way (the same exit status,
the same signal), so that the parent says what happened with the phase and line the worker reported.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import select
import signal
import struct
import sys

from rankaudit import errors
from rankaudit.model import supervise

_LENGTH = struct.Struct(">Q")
_SAFE_BUILTINS = {"set", "frozenset", "complex", "slice", "range", "bytearray"}
_SAFE_NAMES = {
    ("collections", "OrderedDict"),
    ("collections", "defaultdict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("torch", "Size"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
}


class _DataOnly(pickle.Unpickler):
    """Unpickles data: rankaudit's classes (never its functions), and the few library types listed above."""

    def find_class(self, module: str, name: str):
        if "." in name:
            raise pickle.UnpicklingError(f"{module}.{name} is not data")
        if module == "builtins" and name in _SAFE_BUILTINS or (module, name) in _SAFE_NAMES:
            return super().find_class(module, name)
        if module == "torch":
            import torch

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        if module.split(".")[0] == "rankaudit" and module in sys.modules:
            value = getattr(sys.modules[module], name, None)
            if isinstance(value, type) and value.__module__ == module:
                return value
        raise pickle.UnpicklingError(f"{module}.{name} is not data")


def _as_error(exc: BaseException, phase: str | None = None) -> tuple:
    """What the clean process raises for an exception in the worker: the same class of rankaudit's errors."""
    from rankaudit.model.faults import ended_process, model_fault, out_of_memory

    if isinstance(exc, SystemExit):
        exc = ended_process(exc)
    elif not isinstance(exc, errors.RankauditError):
        exc = out_of_memory(exc) or model_fault(exc, phase) or exc
    if isinstance(exc, errors.RankauditError):
        return ("error", type(exc).__name__, exc.problem, exc.fix)
    if "--debug" in sys.argv:
        import traceback

        traceback.print_exception(exc)
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return ("internal", type(exc).__name__, message)


_CAP_SYS_PTRACE, _CAP_SYS_RESOURCE = 19, 24


def _no_tracing() -> None:
    """Linux, run as root: the worker gives up CAP_SYS_PTRACE, without which no process (root's included) reads or
    writes a non-dumpable one's memory or file descriptors: the supervising processes stay out of the model's reach;
    and CAP_SYS_RESOURCE, without which it cannot raise its memory limit's hard value."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable for capabilities 0-31, then 32-63
    if libc.capget(header, data) != 0:
        return
    dropped = (1 << _CAP_SYS_PTRACE) | (1 << _CAP_SYS_RESOURCE)
    if not data[1] & dropped:
        return
    for index in (0, 1, 2):
        data[index] &= ~dropped
    libc.capset(header, data)
    for capability in (_CAP_SYS_PTRACE, _CAP_SYS_RESOURCE):
        libc.prctl(24, capability, 0, 0, 0)  # PR_CAPBSET_DROP: nor regained by a program it starts


def _serve(function, args, kwargs, write_end: int, phase: str | None = None) -> None:
    """In the worker: run the function (as one limited phase when `phase` names it), write its answer, end (never
    return)."""
    supervise.become_worker()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: ends with its parent
    with contextlib.suppress(Exception):
        _no_tracing()
    code = 0
    try:
        if phase is None:
            answer = ("ok", function(*args, **kwargs))
        else:
            with supervise.phase(phase):
                answer = ("ok", function(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure is handed back, as the clean process says it
        answer = _as_error(exc, phase)
    try:
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:  # noqa: BLE001
        data = pickle.dumps(("internal", type(exc).__name__, f"the worker's answer could not be sent: {exc}"))
    data = _LENGTH.pack(len(data)) + data
    try:
        while data:
            data = data[os.write(write_end, data) :]
    except OSError:
        code = 3
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    supervise._real_exit(code)


def _read_answer(read_end: int, pid: int) -> tuple[bytes, int]:
    """The worker's answer (empty when it ended without one) and its wait status. A process the model forked may
    hold the pipe open: the worker's own end decides, not the pipe's."""
    data, status = b"", None
    while status is None:
        ready, _, _ = select.select([read_end], [], [], 0.2)
        if ready:
            chunk = os.read(read_end, 1 << 20)
            data += chunk
            if chunk and not _complete(data):
                continue
            if chunk:  # the whole answer is in: the worker ends next
                _, status = os.waitpid(pid, 0)
                break
        done, waited = os.waitpid(pid, os.WNOHANG)
        if done:
            status = waited
    while True:  # what it wrote just before it ended
        ready, _, _ = select.select([read_end], [], [], 0)
        chunk = os.read(read_end, 1 << 20) if ready else b""
        if not chunk:
            break
        data += chunk
    return (data if _complete(data) else b""), status


def _complete(data: bytes) -> bool:
    return len(data) >= _LENGTH.size and len(data) >= _LENGTH.size + _LENGTH.unpack_from(data)[0]


def _end_as(status: int) -> None:
    """The worker ended without an answer: end this process the same way, for the parent to say what happened."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP have no handler to reset
            signal.signal(number, signal.SIG_DFL)
        with contextlib.suppress(OSError):
            os.kill(os.getpid(), number)
    supervise._real_exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 3)


def run(function, *args, limited: bool = True, phase: str | None = None, **kwargs):
    """function(*args, **kwargs) with the model's code in a worker process; its answer, or its error raised here.

    limited: the worker only imports, builds and traces (each under --timeout, never without one); otherwise it
    runs a verifier or suggest's searches, unlimited but for the phases it enters. phase: the function runs as one
    phase of that name under --timeout (the phases it enters get their own; on leaving one, the clock starts again):
    a client's local training, say, that must end like the model's load. Unsupervised (in-process, tests, no fork)
    it is a plain call."""
    if not supervise.may_report() or not hasattr(os, "fork"):
        return function(*args, **kwargs)
    read_end, write_end = os.pipe()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    supervise.worker_starting(limited)
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _serve(function, args, kwargs, write_end, phase)
    os.close(write_end)
    try:
        data, status = _read_answer(read_end, pid)
    except BaseException:  # Ctrl-C (or a bug of ours): the worker ends with us
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(read_end)
        supervise.worker_ended()
    if not data:
        _end_as(status)
    try:
        answer = _DataOnly(io.BytesIO(data[_LENGTH.size :])).load()
    except Exception as exc:  # noqa: BLE001 - what the worker sent is not data of ours
        raise errors.ModelLoadError(
            f"the process running the model handed back something that is not rankaudit's data ({exc})",
            "make sure the model's code does not write to file descriptors it did not open",
        ) from None
    return _answer(answer)


def _answer(answer):
    if not isinstance(answer, tuple) or not answer:
        raise errors.ModelLoadError("the process running the model handed back no answer", "rerun with --debug")
    if answer[0] == "ok" and len(answer) == 2:
        return answer[1]
    if answer[0] == "error" and len(answer) == 4:
        _, name, problem, fix = answer
        cls = getattr(errors, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, errors.RankauditError)):
            cls = errors.ModelLoadError
        error = cls.__new__(cls)
        errors.RankauditError.__init__(error, str(problem), None if fix is None else str(fix))
        raise error
    if answer[0] == "internal" and len(answer) == 3:
        raise RuntimeError(f"{answer[1]}: {answer[2]}" if answer[2] else str(answer[1]))
    raise errors.ModelLoadError("the process running the model handed back no answer", "rerun with --debug")
