"""The model's code runs in a child process; a light parent (no torch) turns how the child ended into an exit code.

A model file is arbitrary Python: it can call os._exit(0), loop forever at import, or print to stdout. None of that
may reach the user as a silent pass or a corrupted report. So `rankaudit` forks before anything heavy is imported:

    parent  waits on a status pipe: the phase the child is in (with its time limit), the report text, the verdicts
            the report carries, the exit code
    child   runs cli.main() with fd 1 pointed at stderr (whatever the model prints lands there), in a session of its
            own, under a memory limit; the report goes to the parent over the pipe, and the parent alone writes it
            to stdout, once, after the child finished

A child that closes the pipe without an exit code ended the process itself (exit 3, with the os._exit call's file and
line when it was one); a limited phase (import, build, trace) that overruns --timeout is killed (exit 3); Ctrl-C is
exit 130 without a report. Without fork (Windows) the command runs in one process, as before.

The exit code is the report's: 0 or 1 only when the child handed over a report (its verdicts decide between them),
the child's own exit status agrees, and every frame carried this run's token (a stray write of the model's onto the
pipe is no frame). Whatever else happens is exit 3. The model's processes end with rankaudit: the child and what it
forks share one process group, killed when the command ends; a watchdog outside it kills that group when the parent
dies by a signal it cannot catch (SIGKILL), and the child itself dies with its parent (PR_SET_PDEATHSIG).

This module imports only the standard library: the parent must stay at the cost of a bare interpreter.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import sys
import time

DEFAULT_TIMEOUT = 300.0  # seconds for each of the model's import, build and trace
INTERRUPTED = 130  # 128 + SIGINT: the shell's convention for a command ended by Ctrl-C
_GRACE = 5.0  # seconds a child gets to stop after Ctrl-C before it is killed
_TOKEN_BYTES = 16
_HEADER = struct.Struct(f">{_TOKEN_BYTES}scI")

# Frames on the status pipe: this run's token, kind (one byte), payload length, payload.
_PHASE, _OUTPUT, _EXIT, _ENDED, _REPORT = b"P", b"O", b"X", b"E", b"R"
_token = b""  # this run's token, drawn by the parent before the fork

_channel: int | None = None  # the child's end of the status pipe; None in-process (tests, no fork)
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


def set_config_timeout(seconds: float | None) -> None:
    """[tool.rankaudit] timeout of the model being analysed (None when the file says nothing)."""
    global _timeout_config
    _timeout_config = seconds


def timeout() -> float:
    for value in (_timeout_flag, _timeout_config):
        if value is not None:
            return float(value)
    return DEFAULT_TIMEOUT


def check_seconds(value: float, where: str) -> float:
    """A time limit must be a finite positive number: nan and inf would remove it (ValueError naming `where`)."""
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")):
        raise ValueError(f"{where} must be a positive, finite number of seconds, not {value!r}")
    return float(value)


# ---- the memory limit: --memory-limit, else [tool.rankaudit] memory-limit, else the default ----------------------

_memory_flag: float | None = None  # GiB
_memory_config: float | None = None
_GIB = 1024**3


def default_memory_limit() -> float:
    """GiB: 8, or half the machine's memory where that is less."""
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / _GIB
    except (ValueError, OSError, AttributeError):
        return 8.0
    return min(8.0, physical / 2)


def set_flag_memory_limit(gib: float | None) -> None:
    global _memory_flag
    _memory_flag = gib


def set_config_memory_limit(gib: float | None) -> None:
    global _memory_config
    _memory_config = gib


def memory_limit() -> float:
    """GiB the model's process may hold as data (0: no limit)."""
    for value in (_memory_flag, _memory_config):
        if value is not None:
            return float(value)
    return default_memory_limit()


def describe_memory_limit() -> str:
    return f"{memory_limit():g} GiB"


def _apply_memory_limit() -> None:
    """RLIMIT_DATA (heap and private mappings: what torch's allocator and Python objects take; unlike RLIMIT_AS it
    leaves the address space torch reserves alone), in the supervised child only: never in a test's own process."""
    if _channel is None:
        return
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        wanted = memory_limit()
        soft = resource.RLIM_INFINITY if wanted <= 0 else int(wanted * _GIB)
        if hard != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY or soft > hard):
            soft = hard
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


def is_out_of_memory(exc: BaseException) -> bool:
    """MemoryError, or torch's allocator refusing (a RuntimeError) under the memory limit."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "can't allocate memory" in text or "Cannot allocate memory" in text or "std::bad_alloc" in text
    )


def current_phase() -> str:
    return _phase_name


# ---- the child's side ---------------------------------------------------------------------------------------------


def _send(kind: bytes, payload: bytes) -> None:
    if _channel is None or os.getpid() != _child_pid:
        return
    data = _HEADER.pack(_token, kind, len(payload)) + payload
    while data:
        data = data[os.write(_channel, data) :]


@contextlib.contextmanager
def phase(name: str, limited: bool = True):
    """The model's code runs in here (`name`: 'the import of model.py'); limited: the parent ends it after
    timeout() seconds. On leaving, the enclosing phase (and its limit) is back."""
    global _phase_name, _phase_limited, _exited_in
    outer = _phase_name, _phase_limited
    _phase_name, _phase_limited = name, limited
    _apply_memory_limit()
    _send(_PHASE, f"{timeout() if limited else -1.0}\t{name}".encode())
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
        _send(_PHASE, f"{timeout() if outer[1] else -1.0}\t{outer[0]}".encode())


def take_exit_phase() -> str | None:
    """The phase a SystemExit of the model's came through (once: the next run starts clean)."""
    global _exited_in
    name, _exited_in = _exited_in, None
    return name


def enter(name: str) -> None:
    """A new unlimited phase (a verifier's attack, say): named when the model ends the process in it."""
    global _phase_name, _phase_limited
    _phase_name, _phase_limited = name, False
    _apply_memory_limit()
    _send(_PHASE, f"-1.0\t{name}".encode())


def open_limited(name: str) -> tuple[str, bool]:
    """Enter a limited phase where a with-block cannot hold it (a model's first forward, between a forward
    pre-hook and a forward hook); close_limited(the returned state) goes back."""
    global _phase_name, _phase_limited
    outer = _phase_name, _phase_limited
    _phase_name, _phase_limited = name, True
    _send(_PHASE, f"{timeout()}\t{name}".encode())
    return outer


def close_limited(outer: tuple[str, bool]) -> None:
    global _phase_name, _phase_limited
    _phase_name, _phase_limited = outer
    _send(_PHASE, f"{timeout() if outer[1] else -1.0}\t{outer[0]}".encode())


def report_delivered(verdicts: list[bool]) -> None:
    """The report is out (on stdout through the parent, or in its file): the verdicts it carries, True for each
    model whose policy passed. The parent's exit code is derived from these; without them it is exit 3."""
    import json

    _send(_REPORT, json.dumps([bool(v) for v in verdicts]).encode())


def supervised() -> bool:
    return _channel is not None


def stdout_isatty() -> bool:
    """Whether the report's destination is a terminal (the parent's stdout when supervised)."""
    if _channel is not None:
        return _stdout_tty
    return bool(getattr(sys.stdout, "isatty", lambda: False)())


def write_stdout(text: str) -> None:
    """The report on stdout: to the parent when supervised (it writes it once the child finished), else echoed."""
    if _channel is None:
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


def _hooked_exit(code=0):
    """os._exit in the child: tell the parent where it was called from, then exit as asked."""
    with contextlib.suppress(Exception):
        caller = sys._getframe(1)
        _send(_ENDED, f"os._exit({code}) at {source_location(caller.f_code.co_filename, caller.f_lineno)}".encode())
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


def _run_child(write_end: int, main, argv: list[str], parent: int) -> None:
    """In the forked child: run main(argv) with the model's stdout on stderr, hand back the exit code, never return."""
    global _channel, _child_pid, _stdout_tty
    _channel, _child_pid = write_end, os.getpid()
    with contextlib.suppress(OSError):
        os.setsid()  # a process group of its own: the parent ends it, and everything the model forks, at once
    _die_with_parent(parent)
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
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(Exception):
        _send(_EXIT, str(code).encode())
    _real_exit(code)


# ---- the parent's side --------------------------------------------------------------------------------------------


def _error(message: str) -> None:
    sys.stderr.write(f"rankaudit: error: {message}\n")
    sys.stderr.flush()


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _Parent:
    """Reads the child's frames, enforces the phase's time limit, forwards signals, and ends with the report's code."""

    def __init__(self, pid: int, read_end: int):
        self.pid, self.read_end = pid, read_end
        self.buffer = b""
        self.output: list[bytes] = []
        self.code: int | None = None
        self.verdicts: list[bool] | None = None  # from the report frame: None when no report was handed over
        self.ended: str | None = None  # where the model called os._exit, when it did
        self.forged = False  # bytes on the pipe without this run's token: something else wrote there
        self.phase, self.deadline, self.limit = "the start", None, None
        self.interrupted_at: float | None = None
        self.signalled: int | None = None  # the signal that ended us (INT, TERM, HUP, QUIT), forwarded to the child
        self.status: int | None = None

    def on_signal(self, signum, frame):
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
            self.signalled = signum
        if self.pid > 0:  # 0 before the fork returned: os.kill(0, ...) would signal our own process group
            # Ctrl-C lets the child say so; any other signal ends its whole group (SIGQUIT would dump a core).
            forwarded = signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM
            with contextlib.suppress(OSError):
                os.kill(self.pid, forwarded)
            if forwarded != signal.SIGINT:
                self.end_group()

    def _frames(self):
        while len(self.buffer) >= _HEADER.size and not self.forged:
            token, kind, length = _HEADER.unpack_from(self.buffer)
            if token != _token or kind not in (_PHASE, _OUTPUT, _EXIT, _ENDED, _REPORT):
                self.forged = True  # no resynchronising: nothing after it can be trusted
                self.buffer = b""
                return
            if len(self.buffer) < _HEADER.size + length:
                return
            payload = self.buffer[_HEADER.size : _HEADER.size + length]
            self.buffer = self.buffer[_HEADER.size + length :]
            yield kind, payload

    def _take(self, kind: bytes, payload: bytes) -> None:
        import json

        try:
            if kind == _OUTPUT:
                self.output.append(payload)
            elif kind == _EXIT:
                self.code = int(payload)
            elif kind == _REPORT:
                verdicts = json.loads(payload)
                self.verdicts = (self.verdicts or []) + [bool(v) for v in verdicts]
            elif kind == _ENDED:
                self.ended = payload.decode("utf-8", "replace")
            elif kind == _PHASE:
                limit, _, name = payload.decode("utf-8", "replace").partition("\t")
                self.phase, self.limit = name, float(limit)
                self.deadline = time.monotonic() + self.limit if self.limit >= 0 else None
        except (ValueError, TypeError):
            self.forged = True

    def _reap(self, block: bool) -> bool:
        if self.status is not None:
            return True
        pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        self.status = status
        return True

    def wait(self) -> int:
        """Read every frame until the child has ended (a frame claiming the end is not the end)."""
        import select

        open_pipe = True
        while True:
            now = time.monotonic()
            if self.interrupted_at is not None and now - self.interrupted_at > _GRACE:
                self._kill()
                break
            if self.deadline is not None and now > self.deadline and self.interrupted_at is None:
                self._kill()
                return self._timed_out()
            if not open_pipe:
                if self._reap(block=False):
                    break
                time.sleep(0.05)
                continue
            wait = 0.5 if self.deadline is None else min(0.5, self.deadline - now)
            try:
                ready, _, _ = select.select([self.read_end], [], [], max(0.0, wait))
            except InterruptedError:
                continue
            if not ready:
                if self._reap(block=False):  # ended while a grandchild still holds the pipe
                    break
                continue
            chunk = os.read(self.read_end, 1 << 16)
            if not chunk:
                open_pipe = False
                continue
            if not self.forged:
                self.buffer += chunk
                for kind, payload in self._frames():
                    self._take(kind, payload)
        self._reap(block=True)
        self.end_group()
        os.close(self.read_end)
        if self.buffer and self.signalled is None:  # bytes that never made a whole frame: not ours
            self.forged = True
        return self._finish()

    def end_group(self) -> None:
        """SIGKILL to the child's process group: the model's own forks (a sleeper, a worker) end with rankaudit."""
        if self.pid > 0:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        self.end_group()
        self._reap(block=True)

    def _timed_out(self) -> int:
        _error(
            f"{self.phase} did not finish within {self.limit:g} s, so it was stopped; fix: find what loops or "
            "blocks there, or allow more time with --timeout SECONDS (or `timeout` in [tool.rankaudit])"
        )
        return 3

    def _finish(self) -> int:
        if self.signalled == signal.SIGINT:
            if self.code != INTERRUPTED:  # the child did not say so itself (it was killed, or had finished)
                _error("interrupted (Ctrl-C); no report was written")
            return INTERRUPTED
        if self.signalled is not None:
            _error(f"stopped by {_signal_name(self.signalled)}; no report was written")
            return 128 + self.signalled
        if self.forged:
            _error(
                f"something other than rankaudit wrote onto its status channel during {self.phase} (the model's "
                "code wrote to a file descriptor it did not open); the result cannot be trusted, so no report was "
                "written; fix: make the model write only to files it opened itself"
            )
            return 3
        if self.code is None or self.ended is not None:  # rankaudit's own exit never goes through os._exit
            if self.ended is None and os.WIFSIGNALED(self.status):
                name = _signal_name(os.WTERMSIG(self.status))
                _error(
                    f"the process running the model was killed by {name} during {self.phase} (a crash in the "
                    "model's code or an extension, a kill, or the system out of memory); no report was written; "
                    f"fix: run the model on its own (`python FILE`) to see whether it crashes there"
                )
                return 3
            how = self.ended or f"exit status {os.waitstatus_to_exitcode(self.status)}, without a result"
            _error(
                f"the model file ended the process ({how}) during {self.phase}; no report was written; fix: a "
                "model file must not end the process: remove the exit call, or guard it with "
                '`if __name__ == "__main__":`'
            )
            return 3
        code = self._code_from_report()
        if self.output and code in (0, 1):
            try:
                sys.stdout.buffer.write(b"".join(self.output))
                sys.stdout.flush()
            except BrokenPipeError:  # `| head`: the reader has what it wanted
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            except (OSError, ValueError, AttributeError) as exc:  # stdout closed (>&-): None, or a closed file
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                if isinstance(exc, OSError) and exc.errno not in (None, 9):  # EBADF: no stdout at all, nothing lost
                    _error(f"could not write the report to stdout: {exc}; fix: write it to a file with -o PATH")
                    return 2
        return code

    def _code_from_report(self) -> int:
        """0 or 1 only with a report: its verdicts decide, and the child must have ended with the code it sent."""
        code = self.code
        exited = os.waitstatus_to_exitcode(self.status) if self.status is not None else None
        if code not in (0, 1):
            return code if exited == code else 3
        if self.verdicts is None or exited != code:
            _error(
                f"the process running the model ended during {self.phase} with exit status {exited} but without "
                "handing over a report, so there is no verdict; fix: run the model on its own (`python FILE`) and "
                "make sure its code does not end the process"
            )
            return 3
        return 1 if code == 1 or not all(self.verdicts) else 0


def _watch(alive: int, group: int) -> None:
    """The watchdog, forked by the parent: when the parent's end of `alive` closes (the parent ended, however),
    SIGKILL the model's process group. It holds nothing else open (not the caller's stderr) and ignores the
    signals aimed at rankaudit's own process group."""
    try:
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(signum, signal.SIG_IGN)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        os.closerange(3, alive)
        os.closerange(alive + 1, 1 << 16)
        while True:
            try:
                if not os.read(alive, 1):
                    break
            except InterruptedError:
                continue
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    finally:
        _real_exit(0)


def _start_watchdog(group: int) -> int | None:
    """The write end the parent keeps open for its whole life (closed by the kernel when it dies)."""
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
    except OSError:
        return None
    if pid == 0:
        os.close(write_end)
        _watch(read_end, group)
    os.close(read_end)
    return write_end


_PARENT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


def run_supervised(main, argv: list[str]) -> int:
    """Fork; the child runs main(argv) and never returns; the parent returns the exit code for the command."""
    global _token
    _token = os.urandom(_TOKEN_BYTES)
    read_end, write_end = os.pipe()
    parent = _Parent(0, read_end)
    previous = {signum: signal.signal(signum, parent.on_signal) for signum in _PARENT_SIGNALS}
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        for signum in _PARENT_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        _run_child(write_end, main, argv, me)
    parent.pid = pid
    os.close(write_end)
    watchdog = _start_watchdog(pid)
    if parent.signalled is not None:  # it came while we forked: the child did not hear it from us
        parent.on_signal(parent.signalled, None)
    try:
        return parent.wait()
    except BaseException:  # a bug of ours here must not leave the child running
        parent._kill()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if watchdog is not None:
            with contextlib.suppress(OSError):
                os.close(watchdog)


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
