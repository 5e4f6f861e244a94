"""What the trace feeds forward(): one InputSpec per input, the call's switches, and the errors for missing inputs."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rankaudit.errors import TraceError, UsageError

# What an input of forward() carries. Token ids are no continuous unknowns: the unknowns start at the
# embedding's output. Masks and other ids (positions, segment types) carry none.
ROLE_DATA, ROLE_TOKENS, ROLE_MASK, ROLE_IDS = "data", "tokens", "mask", "ids"


@dataclass
class InputSpec:
    """One tensor the trace feeds to forward(), per sample (the batch dimension is added)."""

    name: str  # forward()'s parameter name
    shape: tuple[int, ...]
    dtype: torch.dtype
    role: str  # data | tokens | mask | ids
    positional: bool = False  # the single unnamed input: passed positionally
    same_as: str | None = None  # fed the same ids as another input (an encoder-decoder's decoder_input_ids)

    @property
    def carries_unknowns(self) -> bool:
        return self.role in (ROLE_DATA, ROLE_TOKENS)


def forward_parameters(model: nn.Module) -> tuple[dict[str, inspect.Parameter], bool]:
    """forward()'s named parameters, and whether it takes **kwargs."""
    try:
        parameters = dict(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}, True
    var_keyword = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    return {n: p for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}, var_keyword


_POSITION_IDS = ("position_ids", "token_type_ids", "cache_position", "type_ids")


def _role(name: str, dtype: torch.dtype) -> str:
    lowered = name.lower()
    if "mask" in lowered:
        return ROLE_MASK
    if dtype.is_floating_point or dtype.is_complex:
        return ROLE_DATA
    if lowered.endswith(_POSITION_IDS):
        return ROLE_IDS
    return ROLE_TOKENS


def input_specs(model: nn.Module, input_shape, input_dtype=None) -> list[InputSpec]:
    """What to feed forward(): one spec per input, from INPUT_SHAPE / INPUT_DTYPE (or the command line)."""
    parameters, var_keyword = forward_parameters(model)

    def dtype_for(name: str) -> torch.dtype:
        if isinstance(input_dtype, dict):
            return input_dtype.get(name, torch.float32)
        return input_dtype or torch.float32  # one dtype: every input has it

    if isinstance(input_shape, dict):
        unknown = [name for name in input_shape if name not in parameters and not var_keyword]
        if unknown:
            raise UsageError(
                f"INPUT_SHAPE names {', '.join(unknown)}, which forward() does not take "
                f"(it takes {', '.join(parameters) or 'nothing'})",
                "name the inputs as forward()'s parameters are named",
            )
        if isinstance(input_dtype, dict):
            stray = [name for name in input_dtype if name not in input_shape]
            if stray:
                raise UsageError(
                    f"INPUT_DTYPE names {', '.join(stray)}, which INPUT_SHAPE does not",
                    "give a dtype for inputs that INPUT_SHAPE lists",
                )
        specs = [
            InputSpec(name, tuple(shape), dtype_for(name), _role(name, dtype_for(name)))
            for name, shape in input_shape.items()
        ]
    else:
        name = next(iter(parameters), "input")
        dtype = (
            next(iter(input_dtype.values()), torch.float32)
            if isinstance(input_dtype, dict)
            else input_dtype or torch.float32
        )
        role = ROLE_TOKENS if not (dtype.is_floating_point or dtype.is_complex) else ROLE_DATA
        specs = [InputSpec(name, tuple(input_shape), dtype, role, positional=True)]
    if not any(spec.carries_unknowns for spec in specs):
        raise UsageError(
            "no input carries unknowns (" + ", ".join(f"{s.name}: {s.role}" for s in specs) + ")",
            "give the data input a float dtype, or the token ids an integer dtype and a name other than a mask's",
        )
    tokens = next((spec for spec in specs if spec.role == ROLE_TOKENS), None)
    config = getattr(model, "config", None)
    if (
        tokens is not None
        and "decoder_input_ids" in parameters
        and "decoder_input_ids" not in [s.name for s in specs]
        and getattr(config, "is_encoder_decoder", False)
    ):
        # An encoder-decoder needs decoder inputs: the same ids, so the decoder's lookup is the encoder's.
        specs.append(InputSpec("decoder_input_ids", tokens.shape, tokens.dtype, ROLE_TOKENS, same_as=tokens.name))
    return specs


def forward_switches(model: nn.Module, forward_kwargs: dict | None) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments for forward(): no cache (only the logits carry the loss), named outputs, then the
    model file's FORWARD_KWARGS, which win."""
    parameters, var_keyword = forward_parameters(model)
    wrapped = model
    while (
        var_keyword and callable(getattr(wrapped, "get_base_model", None)) and wrapped.get_base_model() is not wrapped
    ):
        # A wrapper that passes **kwargs on (peft's PeftModel): the switches are the wrapped model's.
        wrapped = wrapped.get_base_model()
        inner, var_keyword = forward_parameters(wrapped)
        parameters = {**inner, **parameters}
    switches: dict[str, Any] = {}
    if "use_cache" in parameters:
        switches["use_cache"] = False
    if "return_dict" in parameters:
        switches["return_dict"] = True
    switches.update(forward_kwargs or {})
    return switches, [f"{key}={value!r}" for key, value in switches.items()]


TOKEN_DTYPE_FIX = (
    "an embedding got float input: token ids need an integer dtype; set INPUT_DTYPE = torch.long "
    "in the model file or pass --input-dtype int64"
)


def wants_token_ids(exc: BaseException) -> bool:
    return "'indices'" in str(exc) and ("Long" in str(exc) or "Int" in str(exc))


def meta_example(spec: InputSpec) -> torch.Tensor:
    return torch.empty((1,) + tuple(spec.shape), dtype=spec.dtype, device="meta")


def check_inputs_given(missing: list[str], specs: list[InputSpec]):
    if not missing:
        return
    given = ", ".join(spec.name for spec in specs)
    shapes = ", ".join(f'"{name}": (...)' for name in [s.name for s in specs] + missing)
    raise TraceError(
        f"forward() also needs {', '.join(missing)} (rankaudit feeds {given})",
        f"set INPUT_SHAPE to a dict naming every input, e.g. {{{shapes}}}, with INPUT_DTYPE for the "
        "integer ones, or wrap the model in a module whose forward takes one tensor",
    )
