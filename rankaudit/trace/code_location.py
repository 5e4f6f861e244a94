"""Where in the model's own code a traced call was made or a failure raised, for records and one-line errors."""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import torch

_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_OWN_DIR = str(Path(__file__).resolve().parent.parent)  # the rankaudit package, every step


def is_user_file(filename: str) -> bool:
    resolved = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    return not (
        filename.startswith("<")
        or resolved.startswith(_TORCH_DIR)
        or resolved.startswith(_OWN_DIR)
        or "/site-packages/" in resolved
        or "/lib/python" in resolved
    )


def source_from_stack(stack: str | None) -> str | None:
    """The innermost frame of the model's own code in an fx/export stack trace."""
    if not stack:
        return None
    frames = [(f, int(line)) for f, line in _FRAME.findall(stack) if is_user_file(f)]
    if not frames:
        return None
    filename, line = frames[-1]
    return f"{relative_path(filename)}:{line}"


def relative_path(filename: str) -> str:
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd()))
    except ValueError:
        return filename


def where_raised(exc: BaseException) -> str:
    """file:line of the model's code that raised, for the one-line error."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    if frames:
        return f" (at {relative_path(frames[-1].filename)}:{frames[-1].lineno})"
    stack_hit = source_from_stack(str(exc))
    return f" (at {stack_hit})" if stack_hit else ""


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    return line if len(line) <= 240 else line[:237] + "..."
