"""The real model a verifier attacks: the device it runs on, its weights, and whether it shares a gradient at all."""

from __future__ import annotations

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.load import load_model


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is available", "use --device auto or --device cpu")
    return requested


def build_real_model(spec: str, input_shape: tuple[int, ...], seed: int) -> tuple[nn.Module, str]:
    """The model with real weights on the CPU, and where its weights came from.

    A file that loads its own weights builds the same parameters whatever the seed; one that relies on
    PyTorch's random initialisation does not. Building twice tells the two apart without guessing.
    """
    torch.manual_seed(seed)
    model = load_model(spec, input_shape, device="cpu").module
    torch.manual_seed(seed + 1)
    again = load_model(spec, input_shape, device="cpu").module
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    has_params = any(True for _ in model.parameters())
    weights = (
        "loaded by the model file" if same and has_params else f"random (PyTorch's default initialisation, seed {seed})"
    )
    _limit_first_forward(model, spec)
    return model.double().eval(), weights


def _limit_first_forward(model: nn.Module, spec: str) -> None:
    """The model's first forward on real tensors runs under --timeout: a forward that loops only off the meta
    device (where the trace ran) is stopped there, exit 3, rather than hanging the verifier."""
    from rankaudit import supervise

    state = {}

    def enter(module, args, kwargs=None):
        state["outer"] = supervise.open_limited(f"the first forward of {spec} on real inputs")

    def leave(module, args, output):
        if "outer" in state:
            supervise.close_limited(state.pop("outer"))
        before.remove()
        after.remove()

    before = model.register_forward_pre_hook(enter)
    after = model.register_forward_hook(leave, always_call=True)


def require_trainable(model: nn.Module, verifier: str) -> None:
    """An attack on the shared gradient needs one: a model with no trainable parameter (frozen, or none at all)
    shares nothing, an option it cannot meet (exit 2), not an internal error (issue 23)."""
    if not any(p.requires_grad for p in model.parameters()):
        what = "all of its parameters are frozen" if any(True for _ in model.parameters()) else "it has no parameters"
        raise UsageError(
            f"{verifier} attacks the shared gradient, but the model shares none: {what}",
            "make parameters trainable (requires_grad), or use --verify rank (an empty gradient has rank 0)",
        )
