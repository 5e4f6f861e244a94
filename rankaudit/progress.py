"""A small dependency-free progress bar for the terminal, drawn on stderr."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """Shows ``label [#####-----] 3/8 12.3s`` on one line, redrawn in place.

    It writes nothing when the stream is not a terminal, so logs, pipes and CI
    output stay clean, and nothing when ``enabled`` is false.  Use it as a
    context manager and call :meth:`update`, or pass the bar itself where code
    reports progress through an ``(done, total)`` callback.
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
        # Per-step callbacks can fire thousands of times a second; redrawing each time would
        # cost more than the work being reported.
        self.min_interval = float(min_interval)
        self._started = time.perf_counter()
        self._last_drawn_at: float | None = None
        self._drawn_state: tuple[int, int] | None = None

    def __enter__(self) -> ProgressBar:
        self._started = time.perf_counter()
        self._draw(force=True)
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
        """Draw the final state and move the cursor past the bar."""
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
