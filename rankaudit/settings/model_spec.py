"""What the user says of the model: MODEL.py[:NAME] and the per-sample input shape, parsed and checked (no torch)."""

from __future__ import annotations

import re
from pathlib import Path

from rankaudit.errors import UsageError

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def split_model_spec(spec: str) -> tuple[Path, str | None]:
    """`path/to/model.py:Name` -> (path, "Name"); a bare path -> (path, None)."""
    path_text, name = spec, None
    head, sep, tail = spec.rpartition(":")
    if sep and _IDENTIFIER.match(tail) and head:
        path_text, name = head, tail
    path = Path(path_text)
    if not path.exists():
        raise UsageError(
            f"model file '{path_text}' does not exist",
            "give the path of a Python file that defines the model, e.g. examples/cnn6.py",
        )
    if path.is_dir():
        raise UsageError(
            f"'{path_text}' is a directory, not a model file", "give the path of a Python file, e.g. examples/cnn6.py"
        )
    return path, name


_SHAPE = re.compile(r"^\s*[(\[]?\s*(\d+(?:\s*[,x×]\s*\d+)*)\s*,?\s*[)\]]?\s*$")


# Larger than any real input, small enough that sizes stay within torch's 64-bit arithmetic with a batch on top.
MAX_DIMENSION = 2**31 - 1
MAX_SAMPLE_VALUES = 2**40


def check_shape_size(shape: tuple[int, ...], where: str) -> tuple[int, ...]:
    """A shape rankaudit can trace: each dimension and the values per sample within the limits above (exit 2)."""
    values = 1
    for dimension in shape:
        values *= dimension
    if any(dimension > MAX_DIMENSION for dimension in shape) or values > MAX_SAMPLE_VALUES:
        shown = "x".join(str(dimension) for dimension in shape)
        raise UsageError(
            f"the input shape {shown} ({where}) has {values:.3g} values per sample, above the {MAX_SAMPLE_VALUES:.3g} "
            f"(and {MAX_DIMENSION:,} per dimension) rankaudit analyses",
            "give the shape of one real sample, without the batch dimension, e.g. 3,224,224",
        )
    return shape


def parse_input_shape(text: str) -> tuple[int, ...]:
    """'3,32,32', '3x32x32' or '(3, 32, 32)' -> (3, 32, 32); per sample, without the batch dimension."""
    match = _SHAPE.match(text)
    shape = tuple(int(d) for d in re.split(r"\s*[,x×]\s*", match.group(1))) if match else ()
    if not shape or any(d <= 0 for d in shape):
        raise UsageError(
            f"malformed input shape '{text}'",
            "give positive integers per sample without the batch dimension, e.g. --input-shape 3,32,32",
        )
    return check_shape_size(shape, "--input-shape")
