"""What the user says of the model: MODEL.py[:NAME] and the per-sample input shape, parsed and checked (no torch)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rankaudit.errors import UsageError
from rankaudit.settings.limits import shown

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


PATH_MAX, NAME_MAX = 4096, 255  # Linux's limits on a path and on one of its names, in bytes


def check_path(text: str, what: str) -> str:
    """A path the system can open and Python can name: not longer than PATH_MAX (a name not over NAME_MAX), and in
    the file system's encoding (a name with bytes that are not UTF-8 cannot be imported as a module). UsageError
    otherwise, naming the path shortened."""
    try:  # the name's bytes as the system holds them: under the C locale a UTF-8 name arrives escaped, not broken
        encoded = os.fsencode(text)
        encoded.decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise UsageError(
            f"the {what} path {os.fsencode(text).decode('utf-8', 'backslashreplace')[:200]} is not valid UTF-8",
            "rename the file (or its folder) to a UTF-8 name",
        ) from None
    if len(encoded) >= PATH_MAX or any(len(part) > NAME_MAX for part in encoded.split(b"/")):
        raise UsageError(
            f"the {what} path {text[:60]}... is {len(encoded)} bytes long, longer than the system opens "
            f"({PATH_MAX - 1} in all, {NAME_MAX} per name)",
            "give a shorter path (a relative one, or a symbolic link to the file)",
        )
    return text


def split_model_spec(spec: str) -> tuple[Path, str | None]:
    """`path/to/model.py:Name` -> (path, "Name"); a bare path -> (path, None)."""
    path_text, name = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and _IDENTIFIER.match(tail) and head:
        path_text, name = head, tail
    path = Path(check_path(path_text, "model file"))
    if not path.exists():
        raise UsageError(
            f"model file '{path_text}' does not exist",
            "give the path of a Python file that defines the model, e.g. examples/cnn6.py",
        )
    if path.is_dir():
        raise UsageError(
            f"'{path_text}' is a directory, not a model file", "give the path of a Python file, e.g. examples/cnn6.py"
        )
    if not path.is_file():  # a device (a link to /dev/zero would be read without end), a pipe, a socket
        raise UsageError(
            f"'{path_text}' is not a regular file (it is {_kind(path)})",
            "give the path of a Python file, e.g. examples/cnn6.py",
        )
    return path, name


def _kind(path: Path) -> str:
    import stat

    mode = path.stat().st_mode
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return f"a device, {os.path.realpath(path)}"
    return "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a file"


_SHAPE = re.compile(r"^\s*[(\[]?\s*(\d+(?:\s*[,x×]\s*\d+)*)\s*,?\s*[)\]]?\s*$")


# Larger than any real input, small enough that sizes stay within torch's 64-bit arithmetic with a batch on top.
MAX_DIMENSION = 2**31 - 1
MAX_SAMPLE_VALUES = 2**40


def _count(values: int) -> str:
    digits = len(str(values))
    return f"{values:.3g}" if digits < 300 else f"over 10^{digits - 1}"  # float() of 10^400 overflows


def check_shape_size(shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    """A shape rankaudit can trace: each dimension and the values per sample within the limits above (exit 2)."""
    values = 1
    for dimension in shape:
        values *= dimension
    if any(dimension > MAX_DIMENSION for dimension in shape) or values > MAX_SAMPLE_VALUES:
        given = "x".join(shown(dimension) for dimension in shape)
        raise UsageError(
            f"the input shape {given} ({where}) has {_count(values)} values per sample, above the "
            f"{MAX_SAMPLE_VALUES:.3g} "
            f"(and {MAX_DIMENSION:,} per dimension) rankaudit analyses",
            "give the shape of one real sample, without the batch dimension, e.g. 3,224,224",
        )
    return shape


def parse_input_shape(text: str) -> tuple[int, ...]:
    """'3,32,32', '3x32x32' or '(3, 32, 32)' -> (3, 32, 32); per sample, without the batch dimension."""
    match = _SHAPE.match(text)
    digits = re.split(r"\s*[,x×]\s*", match.group(1)) if match else []
    if any(len(d.lstrip("0")) > 300 for d in digits):  # int() of 5,000 digits is refused
        raise UsageError(
            f"--input-shape has a dimension of {len(max(digits, key=len))} digits: more values per sample, above "
            f"the {MAX_SAMPLE_VALUES:.3g} (and {MAX_DIMENSION:,} per dimension) rankaudit analyses",
            "give the shape of one real sample, without the batch dimension, e.g. 3,224,224",
        )
    shape = tuple(int(d) for d in digits)
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(
            f"malformed input shape '{text}'",
            "give positive integers per sample without the batch dimension, e.g. --input-shape 3,32,32",
        )
    return check_shape_size(shape, "--input-shape")
