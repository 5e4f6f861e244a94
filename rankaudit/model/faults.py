"""The model's own failures as rankaudit's one-line errors: over the memory limit, its exception, its exit."""

from __future__ import annotations

import os

import click

import rankaudit
from rankaudit.errors import ModelEndedProcess, ModelLoadError
from rankaudit.model import supervise


def out_of_memory(exc: BaseException):
    """Over the memory limit: exit 3 naming the phase it happened in (the innermost, else the one in force)."""
    if not supervise.is_out_of_memory(exc):
        return None
    from rankaudit.errors import OutOfMemory

    phase = getattr(exc, "rankaudit_phase", None) or supervise.current_phase()
    return OutOfMemory(phase, supervise.describe_memory_limit(), exc)


MODEL_MODULE_PREFIX = "rankaudit_model_"  # the module name a model file runs under: how its frames are found
MODEL_PACKAGES: set[str] = set()  # top-level packages of model files that run under their package name


def _is_model_module(name: str) -> bool:
    return name.startswith(MODEL_MODULE_PREFIX) or name.split(".")[0] in MODEL_PACKAGES


def model_fault(exc: BaseException, phase: str | None = None) -> ModelLoadError | None:
    """An exception raised inside a model file's own code (a frame of a module execute_file ran), as the model's
    error: exit 3 with the file:line and the exception, not an internal error of rankaudit's. None when
    no frame of a model file is on its traceback (or its cause's): then it is ours. ``phase``: what rankaudit was
    running the model for, said in the line (the input it gave may be what the model did not expect)."""
    seen, current = set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        location, frame = None, current.__traceback__
        while frame is not None:
            if _is_model_module(str(frame.tb_frame.f_globals.get("__name__", ""))):
                location = (frame.tb_frame.f_code.co_filename, frame.tb_lineno)
            frame = frame.tb_next
        if location is not None:
            filename, line = location
            try:
                filename = os.path.relpath(filename)
            except ValueError:
                pass
            message = str(current).strip().splitlines()[0] if str(current).strip() else ""
            text = f"{type(current).__name__}: {message}" if message else type(current).__name__
            during = f" during {phase}" if phase else ""
            return ModelLoadError(
                f"the model's code raised {text} (at {filename}:{line}){during}",
                "fix the model at that line, or give it the input its forward() takes (rankaudit ran it on real "
                "inputs; --debug shows the traceback)",
            )
        current = current.__cause__ or current.__context__
    return None


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
