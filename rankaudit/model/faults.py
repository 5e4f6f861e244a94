"""The model's own failures as rankaudit's one-line errors: over the memory limit, its exception, its exit."""

from __future__ import annotations

import os

import click

import rankaudit
from rankaudit.errors import ModelEndedProcess
from rankaudit.model import supervise


def out_of_memory(exc: BaseException):
    """Over the memory limit: exit 3 naming the phase it happened in (the innermost, else the one in force)."""
    if not supervise.is_out_of_memory(exc):
        return None
    from rankaudit.errors import OutOfMemory

    phase = getattr(exc, "rankaudit_phase", None) or supervise.current_phase()
    return OutOfMemory(phase, supervise.describe_memory_limit())


def model_fault(exc: BaseException):
    from rankaudit.model import load

    return load.model_fault(exc)


def ended_process(exc: SystemExit) -> ModelEndedProcess:
    """The model's SystemExit as one line: its code and the line that raised it (the deepest frame not of
    rankaudit, click or the standard library; the deepest of all when every frame is)."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame.f_code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    ours = (
        os.path.dirname(os.path.abspath(rankaudit.__file__)),
        os.path.dirname(click.__file__),
        os.path.dirname(os.__file__),
    )
    foreign = [frame for frame in frames if not os.path.abspath(frame[0]).startswith(ours)]
    where = (foreign or frames or [None])[-1]
    at = f" at {supervise.source_location(*where)}" if where is not None else ""
    phase = supervise.take_exit_phase()
    during = f" during {phase}" if phase else ""
    return ModelEndedProcess(
        f"the model file ended the process (SystemExit({exc.code!r}){at}){during}; no report was written",
        'a model file must not end the process: remove the exit call, or guard it with `if __name__ == "__main__":`',
    )
