"""The per-sample input shape and dtype: parsed from the command line, read from INPUT_SHAPE and INPUT_DTYPE."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rankaudit.errors import UsageError

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


_DTYPES = {
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
    "int": torch.int32,
    "int16": torch.int16,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "bool": torch.bool,
    "float32": torch.float32,
    "float": torch.float32,
    "float64": torch.float64,
    "double": torch.float64,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


def parse_input_dtype(text: str) -> torch.dtype | dict[str, torch.dtype]:
    """'int64' (every input) or 'input_ids=int64,attention_mask=int64' (per named input) -> dtypes."""

    def one(word: str) -> torch.dtype:
        key = word.strip().lower().removeprefix("torch.")
        if key not in _DTYPES:
            raise UsageError(
                f"unknown input dtype '{word.strip()}'",
                "give one of " + ", ".join(sorted(_DTYPES)) + ", e.g. --input-dtype int64",
            )
        return _DTYPES[key]

    if "=" not in text:
        return one(text)
    dtypes = {}
    for part in text.split(","):
        name, sep, word = part.partition("=")
        if not sep or not name.strip():
            raise UsageError(
                f"malformed input dtype '{text}'",
                "give one dtype (--input-dtype int64) or NAME=DTYPE pairs "
                "(--input-dtype input_ids=int64,attention_mask=int64)",
            )
        dtypes[name.strip()] = one(word)
    return dtypes


def shape_from_file(value, path: Path) -> tuple[int, ...] | dict[str, tuple[int, ...]]:
    def valid(shape) -> bool:
        return isinstance(shape, (tuple, list)) and bool(shape) and all(isinstance(d, int) and d > 0 for d in shape)

    if valid(value):
        return check_shape_size(tuple(value), f"INPUT_SHAPE in {path}")
    if isinstance(value, dict) and value and all(isinstance(k, str) and valid(v) for k, v in value.items()):
        return {name: check_shape_size(tuple(shape), f"INPUT_SHAPE in {path}") for name, shape in value.items()}
    raise UsageError(
        f"INPUT_SHAPE in {path} is {value!r}, not a tuple of positive integers",
        "set INPUT_SHAPE = (C, H, W) per sample, without the batch dimension, or a dict "
        '{"input_ids": (128,), "attention_mask": (128,)} for a model with several inputs',
    )


def dtype_from_file(value, path: Path) -> torch.dtype | dict[str, torch.dtype] | None:
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        return parse_input_dtype(value)
    if isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, (torch.dtype, str)) for k, v in value.items()
    ):
        return {k: v if isinstance(v, torch.dtype) else parse_input_dtype(v) for k, v in value.items()}
    raise UsageError(
        f"INPUT_DTYPE in {path} is {value!r}, not a torch dtype",
        "set INPUT_DTYPE = torch.long for token ids (or a dict of dtypes per input name)",
    )


def combine_shapes(given, from_file):
    """A shape from the command line replaces the file's; for a file with several inputs it replaces each
    input's shape (they usually share the sequence length: --input-shape 16 for ids and mask alike)."""
    if given is None:
        return from_file
    if isinstance(given, tuple) and isinstance(from_file, dict):
        return {name: given for name in from_file}
    return given
