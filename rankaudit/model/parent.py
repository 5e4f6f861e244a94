"""The light parent of a supervised run: reads the child's frames, keeps the time limit, ends with the report's code.

It imports only the standard library (and rankaudit.model.supervise, which does too): it costs a bare interpreter.
See rankaudit.model.supervise for the child's side and the frames, rankaudit.model.worker for the model's process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

from rankaudit.model import supervise
from rankaudit.model.supervise import (
    _ENDED,
    _EXIT,
    _HEADER,
    _MAX_FRAME,
    _OUTPUT,
    _PHASE,
    _REPORT,
    _REPORT_KINDS,
    _STATUS_KINDS,
    _TOKEN_BYTES,
    _WORKER,
    INTERRUPTED,
    _error,
    check_seconds,
)
from rankaudit.settings.limits import DEFAULT_TIMEOUT

_GRACE = 5.0  # seconds a child gets to stop after Ctrl-C before it is killed
_PHASES_AT_MOST = 8  # a limited worker's whole time, in --timeouts: import, build, trace and the steps between
_GAP_SECONDS = 10.0  # besides twice the limit, for rankaudit's own steps between a limited worker's phases
_stdout_closed = False  # rankaudit started with fd 1 closed (>&-): a report for stdout goes nowhere


def reopen_closed_streams() -> None:
    """fd 0, 1 or 2 closed when rankaudit starts (`>&-`, `2>&-`): /dev/null there, before any pipe is made, so that
    no pipe of ours gets the number (the model's prints on our status channel, our frames on the terminal). With
    stdout closed the report goes nowhere, and stderr says so; with stderr closed the error lines go nowhere, and
    the exit code alone says what happened."""
    global _stdout_closed
    import fcntl

    for fd in (0, 1, 2):
        try:  # closed, or (a shell script's own file, left there by a wrapper that exec'd us) not writable
            usable = fd == 0 or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY
        except OSError:
            usable = False
        if not usable:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if fd == 1:
                _stdout_closed = True
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - fd 1 for the rest of the run
            elif fd == 2:
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class _Parent:
    """Reads the child's frames, enforces the phase's time limit, forwards signals, and ends with the report's code."""

    def __init__(self, pid: int, read_end: int, report_end: int):
        self.pid, self.read_end, self.report_end = pid, read_end, report_end
        self.buffers = {read_end: b"", report_end: b""}
        self.output: list[bytes] = []
        self.code: int | None = None
        self.verdicts: list[bool] | None = None  # from the report frame: None when no report was handed over
        self.ended: str | None = None  # where the model called os._exit, when it did
        self.forged = False  # bytes on a pipe without this run's token, or a report kind on the status pipe
        self.phase, self.deadline, self.limit = "the start", None, None
        self.timeout = DEFAULT_TIMEOUT  # from the report pipe only: what the model's worker runs under
        self.worker: str | None = None  # "limited" or "open" while a model worker runs (report pipe), else None
        self.worker_deadline: float | None = None  # a limited worker's end, however many phases it says it enters
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

    def _frames(self, fd: int):
        allowed = _REPORT_KINDS if fd == self.report_end else _STATUS_KINDS
        while len(self.buffers[fd]) >= _HEADER.size and not self.forged:
            token, kind, length = _HEADER.unpack_from(self.buffers[fd])
            if token != supervise._token or kind not in allowed or length > _MAX_FRAME:
                self.forged = True  # no resynchronising: nothing after it can be trusted
                self.buffers[fd] = b""
                return
            if len(self.buffers[fd]) < _HEADER.size + length:
                return
            payload = self.buffers[fd][_HEADER.size : _HEADER.size + length]
            self.buffers[fd] = self.buffers[fd][_HEADER.size + length :]
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
            elif kind == _WORKER:
                self._worker(*payload.decode("ascii").split("\t"))
            elif kind == _PHASE:
                limit, _, name = payload.decode("utf-8", "replace").partition("\t")
                self._phase(name, float(limit) >= 0)
        except (ValueError, TypeError, UnicodeDecodeError):
            self.forged = True

    def _worker(self, mode: str, seconds: str) -> None:
        """A model worker starts (limited or open) or has ended (none): the limit comes from rankaudit, not from it."""
        if mode not in ("limited", "open", "none"):
            raise ValueError(mode)
        self.worker, now = (None if mode == "none" else mode), time.monotonic()
        self.timeout = check_seconds(float(seconds), "the time limit") if self.worker else self.timeout
        # Import, build and trace (and the steps between) each get the limit; a worker that says it entered more
        # phases gets no more than this in all.
        self.worker_deadline = now + _PHASES_AT_MOST * self.timeout + _GAP_SECONDS if mode == "limited" else None
        self.deadline, self.limit = self.worker_deadline, self.timeout if mode == "limited" else None

    def _phase(self, name: str, limited: bool) -> None:
        """The phase a model worker says it entered: the limit is the parent's own, and a limited worker can
        neither lift it (each of its phases gets the limit, whatever the frame says) nor, by entering phase after
        phase, stretch it past its end."""
        now = time.monotonic()
        self.phase = name
        if limited or self.worker == "limited":
            # Between the limited phases runs rankaudit's own code, the check whether the file runs on its own
            # included (under the same limit, in a process of its own): room for it, never an open end.
            seconds = self.timeout if limited else 2 * self.timeout + _GAP_SECONDS
            self.deadline, self.limit = now + seconds, seconds
            if self.worker_deadline is not None:
                self.deadline = min(self.deadline, self.worker_deadline)
        elif self.worker == "open":
            self.deadline, self.limit = None, None
        # No worker: only rankaudit's own code runs in the child; it names its phases but sets no limit.

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

        open_pipes = [self.report_end, self.read_end]  # the report pipe first: a worker's limit before its phases
        while True:
            now = time.monotonic()
            if self.interrupted_at is not None and now - self.interrupted_at > _GRACE:
                self._kill()
                break
            if self.deadline is not None and now > self.deadline and self.interrupted_at is None:
                self._kill()
                return self._timed_out()
            if not open_pipes:
                if self._reap(block=False):
                    break
                time.sleep(0.05)
                continue
            wait = 0.5 if self.deadline is None else min(0.5, self.deadline - now)
            try:
                ready, _, _ = select.select(open_pipes, [], [], max(0.0, wait))
            except InterruptedError:
                continue
            if not ready:
                if self._reap(block=False):  # ended while a grandchild still holds a pipe
                    break
                continue
            for fd in [fd for fd in open_pipes if fd in ready]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    open_pipes.remove(fd)
                    continue
                if not self.forged:
                    self.buffers[fd] += chunk
                    for kind, payload in self._frames(fd):
                        self._take(kind, payload)
        self._reap(block=True)
        self.end_group()
        os.close(self.read_end)
        os.close(self.report_end)
        if any(self.buffers.values()) and self.signalled is None:  # bytes that never made a whole frame: not ours
            self.forged = True
        return self._finish()

    def end_group(self) -> None:
        """SIGKILL to the child's process group: the model's own forks (a sleeper, a worker) end with rankaudit; and
        to every process below this one, those that left the group (a session of their own, a daemon's double
        fork) included: as a subreaper, this process inherits them when their parent ends."""
        if self.pid > 0:
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
            end_descendants(keep=self.watchdog, child=self.pid)

    watchdog: int | None = None  # the watchdog's pid: it outlives the model's processes by design

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
                "code wrote to a file descriptor it did not open, or sent what only rankaudit's own process may); "
                "the result cannot be trusted, so no report was written; fix: make the model write only to files "
                "it opened itself"
            )
            return 3
        if self.code is None or self.ended is not None:  # rankaudit's own exit never goes through os._exit
            if self.ended is None and os.WIFSIGNALED(self.status) and os.WTERMSIG(self.status) == signal.SIGKILL:
                _error(
                    f"the process running the model was killed from outside (SIGKILL) during {self.phase}, most "
                    "likely by the system's out-of-memory killer; no report was written; fix: give rankaudit more "
                    "memory, or set --memory-limit GIB below what the machine has free so that rankaudit stops the "
                    "model itself and says where"
                )
                return 3
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
        if self.output and code in (0, 1) and _stdout_closed:
            _error(
                "stdout is closed (>&-), so the report went nowhere; fix: keep stdout open, or write the report to a file with -o PATH"
            )
        elif self.output and code in (0, 1):
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
            if exited == code:  # rankaudit's own answer (2 usage, 3 the model, 130 Ctrl-C), said on stderr already
                return code
            _error(
                f"the process running the model ended during {self.phase} with exit status {exited}, not the "
                f"{code} it announced, so there is no verdict; fix: run the model on its own (`python FILE`) and "
                "make sure its code does not end the process"
            )
            return 3
        if self.verdicts is None or exited != code:
            _error(
                f"the process running the model ended during {self.phase} with exit status {exited} but without "
                "handing over a report, so there is no verdict; fix: run the model on its own (`python FILE`) and "
                "make sure its code does not end the process"
            )
            return 3
        return 1 if code == 1 or not all(self.verdicts) else 0


def _watch(alive: int, group: int, parent: int) -> None:
    """The watchdog, forked by the parent: when the parent's end of `alive` closes (the parent ended, however),
    SIGKILL the model's process group, and every process it saw below the parent that is still the same process
    (those of a session of their own too). It holds nothing else open (not the caller's stderr) and ignores the
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
        import select

        seen: dict[int, bytes] = {}
        while True:
            try:
                ready, _, _ = select.select([alive], [], [], 0.5)
                if ready and not os.read(alive, 1):
                    break
            except InterruptedError:
                continue
            seen.update(_below(parent, keep=os.getpid()))
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
        for pid, started in seen.items():
            if _started(pid) == started:  # not a new process that got the number since
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
    finally:
        supervise._real_exit(0)


def _started(pid: int) -> bytes | None:
    """A process's start time (clock ticks since boot): with its pid, what tells it from a later one."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _below(root: int, keep: int) -> dict[int, bytes]:
    """The processes below `root` (but `keep`), each with its start time."""
    children, found, todo = _children(), {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            started = _started(child)
            if child != keep and started is not None:
                found[child] = started
                todo.append(child)
    return found


def _start_watchdog(group: int) -> tuple[int | None, int | None]:
    """The write end the parent keeps open for its whole life (closed by the kernel when it dies), and the
    watchdog's pid."""
    parent = os.getpid()
    try:
        read_end, write_end = os.pipe()
        pid = os.fork()
    except OSError:
        return None, None
    if pid == 0:
        os.close(write_end)
        _watch(read_end, group, parent)
    os.close(read_end)
    return write_end, pid


_PARENT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, name)
)


def _children() -> dict[int, list[int]]:
    """Each process's children, from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    fields = stat.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def end_descendants(keep: int | None = None, child: int | None = None) -> None:
    """SIGKILL every process below this one but `keep`, until none is left (those orphaned meanwhile come to us:
    see _become_subreaper), and reap the ones that came to us (not `child`: its status is read by the caller)."""
    me = os.getpid()
    for _ in range(20):
        children, found, todo = _children(), [], [me]
        while todo:
            for below in children.get(todo.pop(), ()):
                if below != keep:
                    found.append(below)
                    todo.append(below)
        alive = []
        for pid in found:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
                alive.append(pid)
        for pid in alive:
            if pid != child:
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(pid, os.WNOHANG)
        if not alive:
            return
        time.sleep(0.01)


def _become_subreaper() -> None:
    """Linux: the model's processes that leave their parent (a daemon's double fork, a new session) become this
    process's children instead of init's, so that end_descendants finds them."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def run_supervised(main, argv: list[str]) -> int:
    """Fork; the child runs main(argv) and never returns; the parent returns the exit code for the command."""
    supervise._token = os.urandom(_TOKEN_BYTES)
    supervise._not_dumpable()
    _become_subreaper()
    read_end, write_end = os.pipe()
    report_read, report_write = os.pipe()
    parent = _Parent(0, read_end, report_read)
    previous = {signum: signal.signal(signum, parent.on_signal) for signum in _PARENT_SIGNALS}
    me = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.close(report_read)
        for signum in _PARENT_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        supervise._run_child(write_end, report_write, main, argv, me)
    parent.pid = pid
    os.close(write_end)
    os.close(report_write)
    watchdog, parent.watchdog = _start_watchdog(pid)
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
