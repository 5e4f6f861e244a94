"""The per-sample input dtype parsed from the command line, and the shape and dtype read from INPUT_SHAPE and INPUT_DTYPE."""

from __future__ import annotations

from pathlib import Path

import torch

from rankaudit.errors import UsageError
from rankaudit.settings.model_spec import check_shape_size

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
