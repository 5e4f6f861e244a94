"""How DAGER calls a language model: forward() from the trace's inputs, its logits, the input one layer receives."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from torch import nn

from rankaudit.verify import AttackUnsupported


class _Captured(Exception):
    """Raised from a forward pre-hook once the layer's input is in hand: nothing after it needs to run."""


@dataclass
class LanguageModelCall:
    """How to call a language model's forward() with token ids, and what its other inputs get."""

    model: nn.Module
    token_input: str
    positional: bool
    other_inputs: dict[str, str] = field(default_factory=dict)  # name -> same | mask | positions | zeros
    switches: dict = field(default_factory=dict)

    def __call__(self, ids: torch.Tensor):
        kwargs = dict(self.switches)
        for name, kind in self.other_inputs.items():
            if kind == "same":
                kwargs[name] = ids
            elif kind == "mask":
                kwargs[name] = torch.ones_like(ids)
            elif kind == "positions":
                kwargs[name] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            else:
                kwargs[name] = torch.zeros_like(ids)
        if self.positional:
            return self.model(ids, **kwargs)
        return self.model(**{self.token_input: ids}, **kwargs)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return first_tensor(self(ids))


def first_tensor(output) -> torch.Tensor:
    """The logits among a model's outputs: an entry named `logits`, else the first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict):
        if isinstance(output.get("logits"), torch.Tensor):
            return output["logits"]
        output = list(output.values())
    for value in output:
        if isinstance(value, torch.Tensor):
            return value
    raise AttackUnsupported("output", "forward() returned no tensor to compute a loss from")


def layer_input(call: LanguageModelCall, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The input `module` receives when the model reads `ids` (the forward stops there)."""
    captured = {}

    def hook(_, args, kwargs):
        captured["x"] = args[0] if args else next(iter(kwargs.values()))
        raise _Captured

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            call(ids)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "x" not in captured:
        raise AttackUnsupported(type(module).__name__, "the model's forward() never called this layer")
    return captured["x"]


def is_causal(call: LanguageModelCall, vocab_size: int, positions: int, device) -> bool:
    """A decoder: changing the last token leaves the first position's output unchanged, while changing the first
    token changes the last position's (a model that treats each position alone is no decoder)."""
    if positions < 2:
        return False
    generator = torch.Generator().manual_seed(12345)
    ids = torch.randint(vocab_size, (1, positions), generator=generator).to(device)
    last_changed, first_changed = ids.clone(), ids.clone()
    last_changed[0, -1] = (last_changed[0, -1] + 1) % vocab_size
    first_changed[0, 0] = (first_changed[0, 0] + 1) % vocab_size
    with torch.no_grad():
        logits, after_last, after_first = (call.logits(x) for x in (ids, last_changed, first_changed))
    if logits.dim() < 3 or logits.shape[1] != positions:
        return False
    return bool(torch.equal(logits[:, 0], after_last[:, 0]) and not torch.equal(logits[:, -1], after_first[:, -1]))


def forward_call(model: nn.Module, specs, forward_kwargs: dict) -> LanguageModelCall:
    """A LanguageModelCall from the trace's input specs: token ids to the token input, ones to masks, positions
    to position ids, zeros to other ids; use_cache=False where forward() takes it, then the file's FORWARD_KWARGS."""
    token = next(spec for spec in specs if spec.role == "tokens" and not spec.same_as)
    others = {}
    for spec in specs:
        if spec is token:
            continue
        if spec.same_as:
            others[spec.name] = "same"
        elif spec.role == "mask":
            others[spec.name] = "mask"
        elif spec.name.endswith("position_ids"):
            others[spec.name] = "positions"
        else:
            others[spec.name] = "zeros"
    parameters = inspect.signature(model.forward).parameters
    switches = {}
    if "use_cache" in parameters:
        switches["use_cache"] = False
    if "return_dict" in parameters:
        switches["return_dict"] = True
    switches.update(forward_kwargs or {})
    return LanguageModelCall(model, token.name, token.positional, others, switches)
