"""The model's code runs in a child process; a light parent (no torch) turns how the child ended into an exit code.

A model file is arbitrary Python: it can call os._exit(0), loop forever at import, or print to stdout. None of that
may reach the user as a silent pass or a corrupted report. So `rankaudit` forks before anything heavy is imported:

    parent  (rankaudit.model.parent) waits on two pipes: on the report pipe, the report text, the verdicts it
            carries, the exit code and each model worker's time limit; on the status pipe, the phase the model's
            code is in and where it ended the process
    child   runs cli.main() with fd 1 pointed at stderr, in a session of its own; it reads the settings and computes
            the report, never running the model's code: that runs in workers forked off it (rankaudit.model.worker),
            under a memory limit, which close the report pipe first and write only to the status pipe

A child that closes the pipe without an exit code ended the process itself (exit 3, with the os._exit call's file and
line when it was one); a limited phase (import, build, trace) that overruns --timeout is killed (exit 3); Ctrl-C is
exit 130 without a report. Without fork (Windows) the command runs in one process, as before.

The exit code is the report's: 0 or 1 only when the child handed over a report (its verdicts decide between them),
the child's own exit status agrees, and every frame carried this run's token on the pipe of its kind (a stray write of
the model's is no frame; a report frame on the status pipe is forged). Whatever else happens is exit 3. The model's processes end with rankaudit: the child and what it
forks share one process group, killed when the command ends; a watchdog outside it kills that group when the parent
dies by a signal it cannot catch (SIGKILL), and the child itself dies with its parent (PR_SET_PDEATHSIG).

This module imports only the standard library (and rankaudit.settings.limits and .files, light): the parent (rankaudit.model.parent) must stay at the cost of a bare
interpreter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import sys

from rankaudit.settings import files
from rankaudit.settings.limits import DEFAULT_TIMEOUT, MAX_SECONDS, default_memory_limit, shown

INTERRUPTED = 130  # 128 + SIGINT: the shell's convention for a command ended by Ctrl-C
_TOKEN_BYTES = 16
_HEADER = struct.Struct(f">{_TOKEN_BYTES}scI")
_MAX_FRAME = 1 << 24  # no frame of ours is longer (the report goes in pieces of 1 MiB)

# Frames: this run's token, kind (one byte), payload length, payload. Two pipes carry them. The status pipe is
# written by whichever process runs the model's code: the phase it is in and where the model ended the process.
# The report pipe is written only by the child that never runs the model's code (rankaudit.model.worker forks the
# model's processes off it and they close their copy first): the report, its verdicts, the exit code, and the time
# limit each model worker runs under. A frame of a report kind on the status pipe is forged.
_PHASE, _OUTPUT, _EXIT, _ENDED, _REPORT, _WORKER = b"P", b"O", b"X", b"E", b"R", b"W"
_STATUS_KINDS, _REPORT_KINDS = (_PHASE, _ENDED), (_OUTPUT, _EXIT, _REPORT, _WORKER)
_token = b""  # this run's token, drawn by the parent before the fork

_channel: int | None = None  # the child's end of the status pipe; None in-process (tests, no fork)
_report_channel: int | None = None  # the child's end of the report pipe; None in a model worker and in-process
_child_pid: int | None = None  # the child's pid, so that a grandchild (a DataLoader worker) never writes frames
_stdout_tty = False  # whether the real stdout (the parent's) is a terminal: colour in the table
_timeout_flag: float | None = None
_timeout_config: float | None = None
_phase_name = "the analysis"
_phase_limited = False
_exited_in: str | None = None


# ---- the time limit: --timeout, else [tool.rankaudit] timeout, else DEFAULT_TIMEOUT ------------------------------


def set_flag_timeout(seconds: float | None) -> None:
    """--timeout's value (None when not given); the flag wins over the configuration."""
    global _timeout_flag
    _timeout_flag = seconds
    _share_limits()


def set_config_timeout(seconds: float | None) -> None:
    """[tool.rankaudit] timeout of the model being analysed (None when the file says nothing)."""
    global _timeout_config
    _timeout_config = seconds
    _share_limits()


def timeout() -> float:
    for value in (_timeout_flag, _timeout_config):
        if value is not None:
            return float(value)
    return DEFAULT_TIMEOUT


def check_seconds(value: float, where: str) -> float:
    """A time limit must be a finite positive number: nan and inf would remove it (ValueError naming `where`)."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_SECONDS):
        raise ValueError(
            f"{where} must be a positive, finite number of seconds up to {MAX_SECONDS:,.0f}, not {shown(value)}"
        )
    return float(value)


# ---- the memory limit: --memory-limit, else [tool.rankaudit] memory-limit, else the default ----------------------

_memory_flag: float | None = None  # GiB
_memory_config: float | None = None
_GIB = 1024**3


def set_flag_memory_limit(gib: float | None) -> None:
    global _memory_flag
    _memory_flag = gib
    _share_limits()


def set_config_memory_limit(gib: float | None) -> None:
    global _memory_config
    _memory_config = gib
    _share_limits()


def memory_limit() -> float:
    """GiB the model's process may hold as data (0: no limit)."""
    for value in (_memory_flag, _memory_config):
        if value is not None:
            return float(value)
    return default_memory_limit()


def _share_limits() -> None:
    """A parse of an app's configuration runs under the same limits (rankaudit.settings.files)."""
    files.use_limits(memory_limit(), timeout())


def describe_memory_limit() -> str:
    return f"{memory_limit():g} GiB"


_HEADROOM = 512 * 1024**2  # address space beyond the data limit: thread stacks, torch's and the loader's mappings
_STACK_PER_CORE = 16 * 1024**2


def _address_space() -> int | None:
    """Bytes of address space this process holds now (VmSize), None where /proc does not say."""
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return None


def _apply_memory_limit() -> None:
    """In a model worker: RLIMIT_DATA (heap and private mappings) at the limit, soft and hard, so that the model
    cannot raise it; and RLIMIT_AS (what shared mappings also take) at what the worker holds when it starts plus the
    limit and room for its threads' stacks (malloc keeps few arenas, so threads do not reserve 64 MiB each). Not on
    a machine with an NVIDIA GPU: CUDA reserves far more address space than it uses, and there only the data limit
    holds. Never in a test's own process (unsupervised)."""
    if _channel is None:
        return
    with contextlib.suppress(ImportError, ValueError, OSError, OverflowError):
        import resource

        wanted = memory_limit()
        if wanted <= 0:
            return
        limit = int(wanted * _GIB)
        _cap_recursion(limit)
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        limit = limit if hard == resource.RLIM_INFINITY else min(limit, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
        held = _address_space()
        if held is None or os.path.exists("/dev/nvidiactl"):
            return
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None).mallopt(-8, 4)  # M_ARENA_MAX
        space = held + limit + _HEADROOM + _STACK_PER_CORE * (os.cpu_count() or 1)
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        space = space if hard == resource.RLIM_INFINITY else min(space, hard)
        resource.setrlimit(resource.RLIMIT_AS, (space, space))


# Python calls Python without the C stack: each frame is on the heap. A recursion without end under a raised
# recursion limit grows until the memory limit refuses a frame, and then unwinds millions of frames, each failing to
# allocate its traceback: minutes, past --timeout. The depth is capped at what the memory limit holds (this many
# bytes a frame, generously), so it ends at once, as running out of memory.
_FRAME_BYTES = 4096
_recursion_ceiling: int | None = None


def _cap_recursion(limit: int) -> None:
    """In a model worker: sys.setrecursionlimit keeps to the depth `limit` bytes of frames hold."""
    global _recursion_ceiling
    _recursion_ceiling = max(10_000, limit // _FRAME_BYTES)
    allow = sys.setrecursionlimit

    def capped(depth):
        allow(min(depth, _recursion_ceiling) if isinstance(depth, int) else depth)

    sys.setrecursionlimit = capped
    allow(min(sys.getrecursionlimit(), _recursion_ceiling))


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or torch's allocator refusing (a RuntimeError) under the memory limit, or a recursion as deep
    as the memory limit holds."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, RecursionError) and _recursion_ceiling is not None:
        return sys.getrecursionlimit() >= _recursion_ceiling
    if isinstance(exc, OSError) and exc.errno == 12:  # ENOMEM: a mapping over the address-space limit
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "Cannot allocate memory" in text or "std::bad_alloc" in text
    )


def current_phase() -> str:
    return _phase_name


# ---- the child's side ---------------------------------------------------------------------------------------------


def _send(kind: bytes, payload: bytes) -> None:
    # Text payloads name files: encoded with surrogateescape, a UTF-8 name that arrived escaped (the C locale) is
    # its own bytes again on the wire, and the parent reads it back as the name.
    channel = _channel if kind in _STATUS_KINDS else _report_channel
    if channel is None or os.getpid() != _child_pid:
        return
    data = _HEADER.pack(_token, kind, len(payload)) + payload
    while data:
        data = data[os.write(channel, data) :]


def worker_starting(limited: bool) -> None:
    """Before a model worker forks (rankaudit.model.worker): the time limit its phases run under. limited: the
    worker only imports, builds and traces, so it never runs without a deadline; otherwise (a verifier's attack)
    only the phases it says are limited have one. The parent takes the limit from here, never from the worker."""
    _send(_WORKER, f"{'limited' if limited else 'open'}\t{timeout()}".encode())


def worker_ended() -> None:
    _send(_WORKER, b"none\t0")


def become_worker() -> None:
    """In a model worker, just forked: it may say its phase, never hand over a report or a verdict."""
    global _report_channel, _child_pid
    if _report_channel is not None:
        with contextlib.suppress(OSError):
            os.close(_report_channel)
    _report_channel, _child_pid = None, os.getpid()
    _apply_memory_limit()


@contextlib.contextmanager
def phase(name: str, limited: bool = True):
    """The model's code runs in here (`name`: 'the import of model.py'); limited: the parent ends it after
    timeout() seconds. On leaving, the enclosing phase (and its limit) is back."""
    global _phase_name, _phase_limited, _exited_in
    outer = _phase_name, _phase_limited
    _phase_name, _phase_limited = name, limited
    _send(_PHASE, f"{timeout() if limited else -1.0}\t{name}".encode(errors="surrogateescape"))
    try:
        yield
    except SystemExit:
        # The innermost phase: model.faults.ended_process names it beside the model's line.
        _exited_in = _exited_in or name
        raise
    except BaseException as exc:
        if is_out_of_memory(exc) and not hasattr(exc, "rankaudit_phase"):
            with contextlib.suppress(AttributeError, TypeError):
                exc.rankaudit_phase = name  # the innermost phase: the one-line error names it
        raise
    finally:
        _phase_name, _phase_limited = outer
        _send(_PHASE, f"{timeout() if outer[1] else -1.0}\t{outer[0]}".encode(errors="surrogateescape"))


def take_exit_phase() -> str | None:
    """The phase a SystemExit of the model's came through (once: the next run starts clean)."""
    global _exited_in
    name, _exited_in = _exited_in, None
    return name


def enter(name: str) -> None:
    """A new unlimited phase (a verifier's attack, say): named when the model ends the process in it."""
    global _phase_name, _phase_limited
    _phase_name, _phase_limited = name, False
    _send(_PHASE, f"-1.0\t{name}".encode(errors="surrogateescape"))


def open_limited(name: str) -> tuple[str, bool]:
    """Enter a limited phase where a with-block cannot hold it (a model's first forward, between a forward
    pre-hook and a forward hook); close_limited(the returned state) goes back."""
    global _phase_name, _phase_limited
    outer = _phase_name, _phase_limited
    _phase_name, _phase_limited = name, True
    _send(_PHASE, f"{timeout()}\t{name}".encode(errors="surrogateescape"))
    return outer


def close_limited(outer: tuple[str, bool]) -> None:
    global _phase_name, _phase_limited
    _phase_name, _phase_limited = outer
    _send(_PHASE, f"{timeout() if outer[1] else -1.0}\t{outer[0]}".encode(errors="surrogateescape"))


def report_delivered(verdicts: list[bool]) -> None:
    """The report is out (on stdout through the parent, or in its file): the verdicts it carries, True for each
    model whose policy passed. The parent's exit code is derived from these; without them it is exit 3."""
    import json

    _send(_REPORT, json.dumps([bool(v) for v in verdicts]).encode())


def supervised() -> bool:
    return _channel is not None


def may_report() -> bool:
    """Whether this process hands the report to the parent (the supervised child, not a model worker)."""
    return _report_channel is not None


def stdout_isatty() -> bool:
    """Whether the report's destination is a terminal (the parent's stdout when supervised)."""
    if _channel is not None:
        return _stdout_tty
    return bool(getattr(sys.stdout, "isatty", lambda: False)())


def write_stdout(text: str) -> None:
    """The report on stdout: to the parent when supervised (it writes it once the child finished), else echoed."""
    if _report_channel is None:
        import click

        click.echo(text, nl=False, color=True)  # the renderer already decided about colour
        return
    data = text.encode("utf-8")
    for start in range(0, len(data), 1 << 20):
        _send(_OUTPUT, data[start : start + (1 << 20)])


def source_location(filename: str, line: int) -> str:
    """'FILE:LINE (`the line`)', the file relative to the working directory when under it."""
    import linecache

    text = linecache.getline(filename, line).strip()
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(filename)
        if not relative.startswith(".."):
            filename = relative
    return f"{filename}:{line}" + (f" (`{text}`)" if text else "")


def _error(message: str) -> None:
    from rankaudit.errors import one_line

    sys.stderr.write(f"rankaudit: error: {one_line(message)}\n")
    sys.stderr.flush()


def _hooked_exit(code=0):
    """os._exit in the child: tell the parent where it was called from, then exit as asked."""
    with contextlib.suppress(Exception):
        caller = sys._getframe(1)
        _send(
            _ENDED,
            f"os._exit({code}) at {source_location(caller.f_code.co_filename, caller.f_lineno)}".encode(
                errors="surrogateescape"
            ),
        )
    _real_exit(code)


_real_exit = os._exit


def _on_child_sigint(signum, frame):
    # One KeyboardInterrupt: the same Ctrl-C reaches the child from the terminal and from the parent.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL to this process when its parent ends, however it ends (SIGKILL included)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it ended before the request took effect
        _real_exit(3)


def _not_dumpable() -> None:
    """Linux: no other process of the user's (a model worker) may read or write this one's memory or open its file
    descriptors through /proc, nor attach a debugger: the report pipe stays this process's own."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0


def _run_child(write_end: int, report_end: int, main, argv: list[str], parent: int) -> None:
    """In the forked child: run main(argv) with the model's stdout on stderr, hand back the exit code, never return."""
    global _channel, _report_channel, _child_pid, _stdout_tty
    _channel, _report_channel, _child_pid = write_end, report_end, os.getpid()
    with contextlib.suppress(OSError):
        os.setsid()  # a process group of its own: the parent ends it, and everything the model forks, at once
    _die_with_parent(parent)
    _not_dumpable()
    signal.signal(signal.SIGINT, _on_child_sigint)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    _stdout_tty = os.isatty(1)
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    try:
        os.dup2(2, 1)  # fd 1 is stderr from here: print(), os.write(1, ...) and C extensions alike
    except OSError:  # no stderr at all (2>&-): the model's prints go nowhere rather than into the report
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    os._exit = _hooked_exit
    code = 1
    try:
        main(argv)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        _error("interrupted (Ctrl-C); no report was written")
        code = INTERRUPTED
    except BrokenPipeError:
        code = 1
    except BaseException as exc:  # --debug lets it through: its traceback, then the exit code it would have had
        import traceback

        from rankaudit.errors import RankauditError

        traceback.print_exc()
        # Exit 1 would read as a policy failure, and the parent would add that the model ended the process.
        code = exc.exit_code if isinstance(exc, RankauditError) else 3
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        _send(_EXIT, str(code).encode())
    _real_exit(code)


def can_supervise() -> bool:
    return hasattr(os, "fork")


_reading_help = False


def reading_help() -> bool:
    """True while the parent reads argv for --help/--version: a command that would run the model must not run."""
    return _reading_help


def may_answer_here(argv: list[str]) -> bool:
    """A bare `rankaudit`, or --help, -h or --version somewhere in argv: perhaps answered in this process (where
    they are option values, the command runs supervised after all: see answer_here)."""
    return not argv or any(arg in ("--help", "-h", "--version") for arg in argv)


def answer_here(main, argv: list[str], runs_model: type[BaseException]) -> int | None:
    """Run main(argv) in this process with every command that runs the model refused (it raises `runs_model`):
    the exit code of a help, version or usage answer, or None when a command would run (then: supervised)."""
    global _reading_help
    _reading_help = True
    try:
        main(argv)
        return 0
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except runs_model:
        return None
    finally:
        _reading_help = False
