"""A small dependency-free progress bar for the terminal, drawn on stderr; off a terminal (CI), a line every 25 s."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

LOG_INTERVAL = 25.0  # seconds between progress lines off a terminal: a CI log shows life at least every 30 s


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


class ProgressBar:
    """Shows ``label [#####-----] 3/8 12.3s`` on one line, redrawn in place.

    When the stream is not a terminal (a log, a pipe, CI) it draws no bar: a
    run that ends within ``log_interval`` seconds writes nothing, and a longer
    one writes a plain line every ``log_interval`` seconds with the work done
    and an estimate of what is left (from a timer thread, so a single slow
    step still shows life).  Nothing at all when ``enabled`` is false.  Use it
    as a context manager and call :meth:`update`, or pass the bar itself where
    code reports progress through an ``(done, total)`` callback.
    """

    def __init__(
        self,
        total: int,
        label: str = "",
        *,
        width: int = 20,
        enabled: bool = True,
        stream: TextIO | None = None,
        min_interval: float = 0.1,
        log_interval: float = LOG_INTERVAL,
    ) -> None:
        if total < 0:
            raise ValueError(f"total must be non-negative, got {total}")
        self.total = int(total)
        self.label = label
        self.width = max(1, int(width))
        self.done = 0
        # Looked up now, not at import, so a test or caller that swaps sys.stderr is honoured.
        self.stream = sys.stderr if stream is None else stream
        self.enabled = bool(enabled) and _is_terminal(self.stream)
        self.logging = bool(enabled) and not self.enabled  # off a terminal: plain lines, from a timer thread
        self.log_interval = float(log_interval)
        self._stop = threading.Event()
        self._timer: threading.Thread | None = None
        # Per-step callbacks can fire thousands of times a second; redrawing each time would
        # cost more than the work being reported.
        self.min_interval = float(min_interval)
        self._started = time.perf_counter()
        self._last_drawn_at: float | None = None
        self._drawn_state: tuple[int, int] | None = None

    def __enter__(self) -> ProgressBar:
        self._started = time.perf_counter()
        self._draw(force=True)
        if self.logging:
            self._timer = threading.Thread(target=self._log_periodically, daemon=True)
            self._timer.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __call__(self, done: int, total: int | None = None) -> None:
        """Callback adaptor: set the absolute position ``done`` out of ``total``."""
        if total is not None:
            self.total = int(total)
        self.done = int(done)
        self._draw()

    def update(self, n: int = 1) -> None:
        """Advance the bar by ``n`` units."""
        self.done += int(n)
        self._draw()

    def close(self) -> None:
        """Draw the final state and move the cursor past the bar (off a terminal: stop the timer)."""
        self._stop.set()
        if self._timer is not None:
            self._timer.join()
            self._timer = None
        if not self.enabled:
            return
        self._draw(force=True)
        self.stream.write("\n")
        self.stream.flush()
        self.enabled = False

    def render(self) -> str:
        """The bar's text as it would be drawn now, without the leading carriage return."""
        fraction = 1.0 if self.total == 0 else min(max(self.done / self.total, 0.0), 1.0)
        filled = int(round(fraction * self.width))
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.perf_counter() - self._started
        prefix = f"{self.label} " if self.label else ""
        return f"{prefix}[{bar}] {self.done}/{self.total} {elapsed:.1f}s"

    def log_line(self) -> str:
        """The plain line written off a terminal: done of total, the time so far and an estimate of what is left."""
        elapsed = time.perf_counter() - self._started
        prefix = f"{self.label}: " if self.label else ""
        done, total = min(self.done, self.total), self.total
        if 0 < done < total:
            left = f"about {_duration(elapsed * (total - done) / done)} left"
        elif done >= total:
            left = "finishing"
        else:
            left = "no estimate yet (nothing finished)"
        return f"rankaudit: {prefix}{done}/{total} after {_duration(elapsed)}, {left}"

    def _log_periodically(self) -> None:
        while not self._stop.wait(self.log_interval):
            try:
                self.stream.write(self.log_line() + "\n")
                self.stream.flush()
            except (ValueError, OSError):  # the stream closed under us: nothing more to say
                return

    def _draw(self, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        state = (self.done, self.total)
        finished = self.done >= self.total
        throttled = self._last_drawn_at is not None and now - self._last_drawn_at < self.min_interval
        if not force and not finished and throttled:
            return
        if not force and finished and state == self._drawn_state:
            return
        # Trailing spaces wipe leftovers when the new line is shorter than the old one.
        self.stream.write("\r" + self.render() + "   ")
        self.stream.flush()
        self._last_drawn_at = now
        self._drawn_state = state


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    if isatty is None:
        return False
    try:
        return bool(isatty())
    except (ValueError, OSError):  # a closed or detached stream
        return False
