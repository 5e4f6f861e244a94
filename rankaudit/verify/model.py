"""The real model a verifier attacks: the device it runs on, its weights, and whether it shares a gradient at all."""

from __future__ import annotations

import contextlib
import contextvars
import re
from pathlib import Path

import torch
from torch import nn

from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.model.load import CompiledModel, load_model
from rankaudit.settings.files import input_file
from rankaudit.verify.registry import WEIGHTS_FIX

# Keys a training checkpoint commonly keeps its state dict under (PyTorch Lightning, timm, torchvision's
# references, Flower and NVFlare examples), tried in this order when the file is not a state dict itself.
CHECKPOINT_KEYS = ("state_dict", "model_state_dict", "model", "net", "module", "weights")
# How many mismatched names an error lists before it counts the rest.
NAMED_IN_ERRORS = 3

# --weights for the verifiers now running (run.run_verifiers sets it around them): one home, read by
# build_real_model, so that every verifier and every defended run builds the model at the same deployed weights.
_deployed_weights: contextvars.ContextVar[str | None] = contextvars.ContextVar("deployed_weights", default=None)


@contextlib.contextmanager
def deployed_weights(weights_file: str | None):
    """Within this block, build_real_model loads ``weights_file`` (None: the model file's own or seeded weights)."""
    token = _deployed_weights.set(weights_file)
    try:
        yield
    finally:
        _deployed_weights.reset(token)


# The model's keyword arguments for the verifiers now running (--model-arg, model-args; run.run_verifiers sets them
# from the analysis): the real model is the one the analysis judged.
_model_arguments: contextvars.ContextVar[dict | None] = contextvars.ContextVar("model_arguments", default=None)


@contextlib.contextmanager
def model_arguments(arguments: dict | None):
    """Within this block, the verifiers build the model with ``arguments`` (None or empty: without any)."""
    token = _model_arguments.set(dict(arguments) if arguments else None)
    try:
        yield
    finally:
        _model_arguments.reset(token)


def current_model_arguments() -> dict | None:
    """The keyword arguments the verifiers now running build the model with, or None."""
    return _model_arguments.get()


def deployed_weights_file() -> str | None:
    """The --weights file the verifiers now run at, or None."""
    return _deployed_weights.get()


def resolve_device(requested: str) -> str:
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but no CUDA device is available", "use --device auto or --device cpu")
    return requested


def build_real_model(
    spec: str, input_shape: tuple[int, ...], seed: int, weights_file: str | None = None
) -> tuple[nn.Module, str]:
    """The model with real weights on the CPU, and where its weights came from.

    With ``weights_file`` (default: --weights, see deployed_weights) the deployed weights replace whatever the
    model file built. Otherwise: a file that loads its own weights builds the same parameters whatever the seed;
    one that relies on PyTorch's random initialisation does not. Building twice tells the two apart without
    guessing.
    """
    weights_file = weights_file if weights_file is not None else deployed_weights_file()
    if weights_file is not None:
        state = read_state_dict(weights_file)
        torch.manual_seed(seed)
        model = load_model(spec, input_shape, device="cpu", model_args=current_model_arguments()).module
        load_weights(model, state, weights_file)
        return model.double().eval(), f"the weights in {Path(weights_file).name}"
    torch.manual_seed(seed)
    model = load_model(spec, input_shape, device="cpu", model_args=current_model_arguments()).module
    torch.manual_seed(seed + 1)
    again = load_model(spec, input_shape, device="cpu", model_args=current_model_arguments()).module
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
    from rankaudit.model import supervise

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
    shares nothing, an option it cannot meet (exit 2), not an internal error."""
    if not any(p.requires_grad for p in model.parameters()):
        what = "all of its parameters are frozen" if any(True for _ in model.parameters()) else "it has no parameters"
        raise UsageError(
            f"{verifier} attacks the shared gradient, but the model shares none: {what}",
            "make parameters trainable (requires_grad), or use --verify rank (an empty gradient has rank 0)",
        )


def weights_phrase(weights: str) -> str:
    """How a measured line names the weights it ran at: "at the weights in ckpt.pt", "at the seeded
    initialisation" (PyTorch's default, seeded), "at the weights the model file loads"."""
    if weights.startswith("the weights in "):
        return f"at {weights}"
    if weights.startswith("random"):
        return "at the seeded initialisation"
    return "at the weights the model file loads"


def read_state_dict(weights_file: str) -> dict[str, torch.Tensor]:
    """The tensors of a state dict file, or of the state dict a checkpoint dict holds (CHECKPOINT_KEYS).

    Loaded with weights_only=True: a checkpoint is data, and no code in it runs. A missing file is a usage error
    (exit 2); a file that holds no state dict is one the verifiers cannot run at (exit 3)."""
    path = Path(weights_file)
    input_file(path, "--weights", WEIGHTS_FIX)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and weights-only refusals all mean "not a plain tensor file"
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = re.sub(r"\x1b\[[0-9;]*m", "", reason)  # torch's own message sets words in bold for a terminal
        raise ModelLoadError(
            f"--weights {weights_file} could not be read as tensors ({reason[:160]})",
            "save the weights with torch.save(model.state_dict(), path)",
        ) from exc
    state = _tensors_of(loaded)
    if state is None and isinstance(loaded, dict):
        state = next((_tensors_of(loaded[key]) for key in CHECKPOINT_KEYS if _tensors_of(loaded.get(key))), None)
    if not state:
        kind = f"a dict with keys {_names(list(loaded))}" if isinstance(loaded, dict) else type(loaded).__name__
        raise ModelLoadError(
            f"--weights {weights_file} holds no state dict ({kind})",
            "save torch.save(model.state_dict(), path), or a checkpoint dict holding it under "
            + " or ".join(f"'{key}'" for key in CHECKPOINT_KEYS[:3]),
        )
    broken = [
        name
        for name, tensor in state.items()
        if (tensor.is_floating_point() or tensor.is_complex()) and not bool(torch.isfinite(tensor).all())
    ]
    if broken:  # a run at NaN or infinite weights measures nothing: every gradient and readout is NaN
        raise ModelLoadError(
            f"--weights {weights_file} holds NaN or infinite values (in {_names(broken)}); the verifiers cannot run "
            "at them",
            "save the weights of a model whose training did not diverge",
        )
    return state


def _tensors_of(value) -> dict[str, torch.Tensor] | None:
    """A state dict: a non-empty mapping of names to tensors (a leading "module." of DataParallel dropped)."""
    if not isinstance(value, dict) or not value or not all(isinstance(v, torch.Tensor) for v in value.values()):
        return None
    keys = [str(key) for key in value]
    if all(key.startswith("module.") for key in keys):
        return {key.removeprefix("module."): tensor for key, tensor in zip(keys, value.values())}
    return dict(zip(keys, value.values()))


def _names(names: list[str]) -> str:
    shown = ", ".join(str(name) for name in names[:NAMED_IN_ERRORS])
    more = len(names) - NAMED_IN_ERRORS
    return shown + (f" and {more} more" if more > 0 else "")


def load_weights(model: nn.Module, state: dict[str, torch.Tensor], weights_file: str) -> None:
    """Copy ``state`` into ``model``: every parameter and buffer the model has, each at its shape, or exit 3 naming
    the first few that differ (a checkpoint of another architecture must not run as if it were this one)."""
    expected = model.state_dict()
    if isinstance(model, CompiledModel) and not any(name.startswith("model.") for name in state):
        state = {f"model.{name}": tensor for name, tensor in state.items()}  # saved from the compiled model itself
    missing = [name for name in expected if name not in state]
    unexpected = [name for name in state if name not in expected]
    if missing or unexpected:
        parts = ([f"missing {_names(missing)}"] if missing else []) + (
            [f"not in the model {_names(unexpected)}"] if unexpected else []
        )
        raise ModelLoadError(
            f"--weights {weights_file} does not match the model's keys: " + "; ".join(parts),
            "save the state dict of this model class (same layer names), or pick the matching --model-arg",
        )
    wrong = [
        f"{name} {tuple(state[name].shape)} vs {tuple(tensor.shape)}"
        for name, tensor in expected.items()
        if tuple(state[name].shape) != tuple(tensor.shape)
    ]
    if wrong:
        raise ModelLoadError(
            f"--weights {weights_file} does not match the model's shapes (file vs model): {_names(wrong)}",
            "save the state dict of this model at the same --input-shape and --model-arg settings",
        )
    with torch.no_grad():
        model.load_state_dict({name: tensor.to(expected[name].dtype) for name, tensor in state.items()})
