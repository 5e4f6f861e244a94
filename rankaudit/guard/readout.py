"""The guard's exact checks on one update: the received weights against the audited model, then every bias unit's
readouts compared with the client's own samples (docs/method.md, "The client-side guard").

For a Linear (or a convolution with one output position) whose weight and bias updates are both sent, unit k's
weight-row update over its bias update is one sample's input to the layer when only that sample passed a gradient
through the unit (Qian et al.; rankaudit.verify.attacks.bias measures the same readout on a simulated round). A
server that crafts the layer as an imprint module (Fowl et al., "Robbing the Fed": every row the same direction,
the biases thresholds on it) makes unit k fire for every sample above its threshold; sorted by bias, the difference
of two neighbouring units' row updates over the difference of their bias updates is then the one sample that falls
between the two thresholds. Both are read off the update the client is about to send and compared with what the
layer reads from each of the client's samples at the received weights: a match within the tolerance is a sample
the server reads exactly.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rankaudit.result import GuardReadout
from rankaudit.verify.attacks.bias import SILENT_BIAS, nearest_rows, readout_layers, sample_vectors

# How many differing names an architecture reason lists before it counts the rest.
NAMED = 3
# Samples per forward pass of the check: bounds its memory whatever the client's local data set. 128 was the
# fastest of 32 to 256 on a CPU (larger chunks fall out of cache: 256 took 1.8x as long).
CHUNK = 128


def _listed(names: list[str]) -> str:
    more = len(names) - NAMED
    return ", ".join(names[:NAMED]) + (f" and {more} more" if more > 0 else "")


def architecture_difference(model: nn.Module, received: dict[str, torch.Tensor]) -> str | None:
    """None when ``received`` has exactly the audited model's state-dict names, shapes and dtypes; else what
    differs, in one phrase (the server changed the model the audit covered)."""
    expected = model.state_dict()
    missing = [name for name in expected if name not in received]
    extra = [name for name in received if name not in expected]
    parts = []
    if missing:
        parts.append(f"missing {_listed(missing)}")
    if extra:
        parts.append(f"not in the audited model {_listed(extra)}")
    shapes = [
        f"{name} {tuple(received[name].shape)} (audited {tuple(tensor.shape)})"
        for name, tensor in expected.items()
        if name in received and tuple(received[name].shape) != tuple(tensor.shape)
    ]
    if shapes:
        parts.append(f"shapes differ: {_listed(shapes)}")
    dtypes = [
        f"{name} {received[name].dtype} (audited {tensor.dtype})".replace("torch.", "")
        for name, tensor in expected.items()
        if name in received
        and tuple(received[name].shape) == tuple(tensor.shape)
        and received[name].dtype != tensor.dtype
    ]
    if dtypes:
        parts.append(f"dtypes differ: {_listed(dtypes)}")
    return "; ".join(parts) if parts else None


def named_like_model(model: nn.Module, arrays: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Arrays keyed "0", "1", ... (a list of arrays, as Flower's from_numpy_ndarrays keys them) renamed in the
    order of the model's state dict when their count matches; any other keys are returned as they are."""
    expected = list(model.state_dict())
    if list(arrays) == [str(i) for i in range(len(arrays))] and len(arrays) == len(expected):
        return dict(zip(expected, arrays.values()))
    return dict(arrays)


class LayerInputs:
    """What each readout layer reads from each of the client's samples at the received weights: one forward pass
    in the model's own precision (a readout matches to 1e-3, far above float32's rounding), the model as the client
    trains it (eval mode: dropout off), and one backward pass from the first readout layer on."""

    def __init__(self, model: nn.Module, received: dict[str, torch.Tensor], shared: list[str]):
        self.net = copy.deepcopy(model).eval()
        with torch.no_grad():
            state = self.net.state_dict()
            state.update({name: value.to(state[name].dtype) for name, value in received.items() if name in state})
            self.net.load_state_dict(state)
        # No graph through the weights: the backward only asks which units pass a gradient.
        self.net.requires_grad_(False)
        self.layers = readout_layers(self.net, shared)
        self.dtype = next((p.dtype for p in self.net.parameters() if p.is_floating_point()), torch.float32)

    def vectors(self, samples: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, bool], dict[str, str]]:
        """({layer: (N, d) vectors}, {layer: reads the input itself}, {layer: why it is not checked}).

        A layer is checked where an exact readout can exist: one of its units passes no gradient for some sample
        (a ReLU-like gate after it), or the batch is one sample. Without a gate every sample reaches every unit
        (the logits under a softmax, say) and a readout only approximates a sample, however close; finding which
        units pass a gradient needs no labels (any projection of the output has the same zeros behind a gate).
        The samples go through in chunks of CHUNK (eval mode: a chunk's outputs do not depend on the others)."""
        x = samples.detach().to(self.dtype)
        parts = [self._chunk(x[start : start + CHUNK]) for start in range(0, len(x), CHUNK)]
        found, reads_input, why_not = {}, {}, {}
        flat = x.reshape(len(x), -1)
        for name, _ in self.layers:
            calls, pieces = parts[0][name][0], [part[name][1] for part in parts]
            if calls != 1:
                why_not[name] = f"called {calls} times per forward pass: its update sums the calls"
                continue
            if any(piece is None for piece in pieces):
                why_not[name] = "reads several vectors per sample (positions), not one"
                continue
            gated = any(part[name][2] for part in parts)
            if len(x) > 1 and not gated:
                why_not[name] = "every sample passes a gradient through every unit (no gate after it): no exact readout"
                continue
            vectors = torch.cat(pieces)
            found[name] = vectors.to(torch.float64)
            reads_input[name] = vectors.shape == flat.shape and bool(torch.equal(vectors, flat))
        return found, reads_input, why_not

    def _chunk(self, x: torch.Tensor) -> dict[str, tuple[int, torch.Tensor | None, bool]]:
        """{layer: (calls per forward pass, its (n, d) vectors or None, whether some unit passes no gradient for
        some sample)} for one chunk of samples: one forward pass, and one backward from the first checkable layer."""
        from rankaudit.verify.client import logits_of

        seen: dict[str, list[tuple[torch.Tensor, torch.Tensor | None]]] = {name: [] for name, _ in self.layers}

        def record(name, module, args, out):
            one_vector = args[0].dim() == 2 if isinstance(module, nn.Linear) else out.shape[2:].numel() == 1
            if one_vector and not out.requires_grad:  # the first checkable layer: the graph starts at its output
                out.requires_grad_()
            seen[name].append((args[0].detach(), out if one_vector else None))

        hooks = [
            module.register_forward_hook(lambda mod, args, out, name=name: record(name, mod, args, out))
            for name, module in self.layers
        ]
        try:
            with torch.enable_grad():
                output = logits_of(self.net(x))
                outputs = [out for name, _ in self.layers for _, out in seen[name] if out is not None]
                direction = torch.randn(output.shape, generator=torch.Generator().manual_seed(0), dtype=output.dtype)
                grads = (
                    torch.autograd.grad((output * direction).sum(), outputs, allow_unused=True)
                    if output.requires_grad and outputs
                    else [None] * len(outputs)
                )
        finally:
            for hook in hooks:
                hook.remove()
        result, at = {}, 0
        for name, module in self.layers:
            calls = seen[name]
            checkable = sum(out is not None for _, out in calls)
            gradients, at = grads[at : at + checkable], at + checkable
            if len(calls) != 1 or calls[0][1] is None:
                result[name] = (len(calls), None, False)
                continue
            vectors = sample_vectors(module, calls[0][0])
            gated = gradients[0] is None or bool((gradients[0] == 0).any())
            result[name] = (1, None if vectors is None else vectors.detach(), gated)
        return result


def _matches(candidates: torch.Tensor, table: torch.Tensor) -> tuple[list[int], list[float]]:
    """For each candidate row, the nearest sample vector and the relative error to it: searched in float32 (an
    exact readout sits orders of magnitude nearer its sample than any other), the error recomputed in float64."""
    best, _ = nearest_rows(candidates.to(torch.float32), table.to(torch.float32))
    chosen = table[best]
    errors = (candidates - chosen).norm(dim=1) / chosen.norm(dim=1).clamp_min(1e-300)
    return best.tolist(), errors.tolist()


def _live(bias_update: torch.Tensor) -> torch.Tensor:
    scale = float(bias_update.abs().max()) if len(bias_update) else 0.0
    return bias_update.abs() > SILENT_BIAS * scale if scale > 0 else torch.zeros_like(bias_update, dtype=torch.bool)


def layer_readouts(
    name: str,
    weight_update: torch.Tensor,
    bias_update: torch.Tensor,
    received_bias: torch.Tensor,
    vectors: torch.Tensor,
    reads_input: bool,
    tolerance: float,
) -> list[GuardReadout]:
    """Every exact readout of one layer: each unit's ratio, then each pair of neighbours (units sorted by their
    received bias) whose difference isolates one sample; in float64."""
    rows = weight_update.reshape(len(weight_update), -1).to(torch.float64)
    bias = bias_update.to(torch.float64)
    table = vectors.to(torch.float64)
    found = []
    live = torch.nonzero(_live(bias)).flatten()
    if len(live):
        best, errors = _matches(rows[live] / bias[live, None], table)
        for unit, sample, error in zip(live.tolist(), best, errors):
            if error <= tolerance:
                found.append(GuardReadout(name, [unit], "ratio", sample, error, reads_input))
    order = torch.argsort(received_bias.detach().to(torch.float64).cpu(), stable=True).to(rows.device)
    if len(order) > 1:
        low, high = order[:-1], order[1:]
        row_steps, bias_steps = rows[high] - rows[low], bias[high] - bias[low]
        kept = torch.nonzero(_live(bias_steps)).flatten()
        if len(kept):
            best, errors = _matches(row_steps[kept] / bias_steps[kept, None], table)
            for pair, sample, error in zip(kept.tolist(), best, errors):
                if error <= tolerance:
                    units = sorted((int(low[pair]), int(high[pair])))
                    found.append(GuardReadout(name, units, "neighbours", sample, error, reads_input))
    return found


def find_readouts(
    inputs: LayerInputs,
    received: dict[str, torch.Tensor],
    sent: dict[str, torch.Tensor],
    samples: torch.Tensor,
    tolerance: float,
    *,
    check_features: bool = True,
) -> tuple[list[GuardReadout], list[str], list[str]]:
    """(readouts, layers checked, layers skipped with why) for the update ``sent − received``."""
    vectors, reads_input, why_not = inputs.vectors(samples)
    readouts, checked, skipped = [], [], []
    for name, _ in inputs.layers:
        prefix = f"{name}." if name else ""
        if name in why_not:
            skipped.append(f"{name or 'the model'}: {why_not[name]}")
            continue
        if not reads_input[name] and not check_features:
            skipped.append(f"{name}: reads features, and check-features is off")
            continue
        weight, bias = f"{prefix}weight", f"{prefix}bias"
        weight_update = sent[weight].detach().cpu().to(torch.float64) - received[weight].detach().cpu().to(
            torch.float64
        )
        bias_update = sent[bias].detach().cpu().to(torch.float64) - received[bias].detach().cpu().to(torch.float64)
        checked.append(name)
        readouts += layer_readouts(
            name, weight_update, bias_update, received[bias], vectors[name].cpu(), reads_input[name], tolerance
        )
    return readouts, checked, skipped
