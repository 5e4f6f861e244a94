"""The model's code runs in a child process; a light parent (no torch) turns how the child ended into an exit code.

A model file is arbitrary Python: it can call os._exit(0), loop forever at import, or print to stdout. None of that
may reach the user as a silent pass or a corrupted report. So `rankaudit` forks before anything heavy is imported:

    parent  waits on a status pipe: the phase the child is in (with its time limit), the report text, the exit code
    child   runs cli.main() with fd 1 pointed at stderr (whatever the model prints lands there); the report goes to
            the parent over the pipe, and the parent alone writes it to stdout, once, after the child finished

A child that closes the pipe without an exit code ended the process itself (exit 3, with the os._exit call's file and
line when it was one); a limited phase (import, build, trace) that overruns --timeout is killed (exit 3); Ctrl-C is
exit 130 without a report. Without fork (Windows) the command runs in one process, as before.

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
_HEADER = struct.Struct(">cI")

# Frames on the status pipe: kind (one byte), payload length, payload.
_PHASE, _OUTPUT, _EXIT, _ENDED = b"P", b"O", b"X", b"E"

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


# ---- the child's side ---------------------------------------------------------------------------------------------


def _send(kind: bytes, payload: bytes) -> None:
    if _channel is None or os.getpid() != _child_pid:
        return
    data = _HEADER.pack(kind, len(payload)) + payload
    while data:
        data = data[os.write(_channel, data) :]


@contextlib.contextmanager
def phase(name: str, limited: bool = True):
    """The model's code runs in here (`name`: 'the import of model.py'); limited: the parent ends it after
    timeout() seconds. On leaving, the enclosing phase (and its limit) is back."""
    global _phase_name, _phase_limited, _exited_in
    outer = _phase_name, _phase_limited
    _phase_name, _phase_limited = name, limited
    _send(_PHASE, f"{timeout() if limited else -1.0}\t{name}".encode())
    try:
        yield
    except SystemExit:
        _exited_in = _exited_in or name  # the innermost phase: cli.main names it beside the model's line
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
    _send(_PHASE, f"-1.0\t{name}".encode())


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


def _run_child(write_end: int, main, argv: list[str]) -> None:
    """In the forked child: run main(argv) with the model's stdout on stderr, hand back the exit code, never return."""
    global _channel, _child_pid, _stdout_tty
    _channel, _child_pid = write_end, os.getpid()
    signal.signal(signal.SIGINT, _on_child_sigint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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
    """Reads the child's frames, enforces the phase's time limit, forwards Ctrl-C, and ends as the child asked."""

    def __init__(self, pid: int, read_end: int):
        self.pid, self.read_end = pid, read_end
        self.buffer = b""
        self.output: list[bytes] = []
        self.code: int | None = None
        self.ended: str | None = None  # where the model called os._exit, when it did
        self.phase, self.deadline, self.limit = "the start", None, None
        self.interrupted_at: float | None = None
        self.signalled: int | None = None  # the signal that ended us (SIGINT, SIGTERM), forwarded to the child
        self.status: int | None = None

    def on_signal(self, signum, frame):
        if self.interrupted_at is None:
            self.interrupted_at = time.monotonic()
            self.signalled = signum
        if self.pid > 0:  # 0 before the fork returned: os.kill(0, ...) would signal our own process group
            with contextlib.suppress(OSError):
                os.kill(self.pid, signum)

    def _frames(self):
        while len(self.buffer) >= _HEADER.size:
            kind, length = _HEADER.unpack_from(self.buffer)
            if len(self.buffer) < _HEADER.size + length:
                return
            payload = self.buffer[_HEADER.size : _HEADER.size + length]
            self.buffer = self.buffer[_HEADER.size + length :]
            yield kind, payload

    def _take(self, kind: bytes, payload: bytes) -> None:
        if kind == _OUTPUT:
            self.output.append(payload)
        elif kind == _EXIT:
            self.code = int(payload)
        elif kind == _ENDED:
            self.ended = payload.decode("utf-8", "replace")
        elif kind == _PHASE:
            limit, _, name = payload.decode("utf-8", "replace").partition("\t")
            self.phase, self.limit = name, float(limit)
            self.deadline = time.monotonic() + self.limit if self.limit >= 0 else None

    def _reap(self, block: bool) -> bool:
        if self.status is not None:
            return True
        pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
        if pid == 0:
            return False
        self.status = status
        return True

    def wait(self) -> int:
        import select

        open_pipe = True
        while self.code is None:
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
            ready, _, _ = select.select([self.read_end], [], [], max(0.0, wait))
            if not ready:
                if self._reap(block=False):  # ended while a grandchild still holds the pipe
                    break
                continue
            chunk = os.read(self.read_end, 1 << 16)
            if not chunk:
                open_pipe = False
                continue
            self.buffer += chunk
            for kind, payload in self._frames():
                self._take(kind, payload)
        self._reap(block=True)
        os.close(self.read_end)
        return self._finish()

    def _kill(self) -> None:
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
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
        if self.code is None:
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
        if self.output:
            try:
                sys.stdout.buffer.write(b"".join(self.output))
                sys.stdout.flush()
            except BrokenPipeError:  # `| head`: the reader has what it wanted
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
                _error(f"could not write the report to stdout: {exc}; fix: write it to a file with -o PATH")
                return 2
        return self.code


def run_supervised(main, argv: list[str]) -> int:
    """Fork; the child runs main(argv) and never returns; the parent returns the exit code for the command."""
    read_end, write_end = os.pipe()
    parent = _Parent(0, read_end)
    previous = {signum: signal.signal(signum, parent.on_signal) for signum in (signal.SIGINT, signal.SIGTERM)}
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        _run_child(write_end, main, argv)
    parent.pid = pid
    if parent.signalled is not None:  # it came while we forked: the child did not hear it from us
        parent.on_signal(parent.signalled, None)
    os.close(write_end)
    try:
        return parent.wait()
    except BaseException:  # a bug of ours here must not leave the child running
        parent._kill()
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def can_supervise() -> bool:
    return hasattr(os, "fork")


def needs_no_child(argv: list[str]) -> bool:
    """--help, --version and a bare `rankaudit` run no model: they are answered in this process."""
    return not argv or any(arg in ("--help", "-h", "--version") for arg in argv)
