"""--verify bias: the bias readout measured (method.md: each sample; Qian, Nassar & Hansen, Proposition 1) on the real update.

For a Linear (or a convolution whose output is one position) whose weight and bias updates are both sent, unit k's
update rows are u_W[k] = Σ c_(i,t) x_(i,t) and u_b[k] = Σ c_(i,t), summed over the samples i and local steps t in
which the unit passed a gradient (c = −η·δ for plain SGD, other non-zero weights for momentum). When only one
sample passed a gradient through the unit (over a round: in every step, that same sample or none), the ratio
u_W[k] / u_b[k] is that sample's input to the layer, exactly; for the first layer that is the sample itself. A
ReLU-like activation after the layer makes such units common (a unit is silent for every sample it does not fire
for); the readout is checked on every such layer, and the matching alone decides what was read.

Closed form: one simulated update (rankaudit.verify.client, the round's local training), one ratio per unit, and
one distance per (unit, sample) pair. The match is exact when the relative error ‖ratio − input‖ / ‖input‖ is below
EXACT_RELATIVE_ERROR. Ground truth, for the report and the tests: which samples each unit passed a gradient for
(per-sample bias gradients at every step's weights).
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn

from rankaudit.result import BiasReadout, BiasReadoutLayer, BiasReadoutSample
from rankaudit.settings.round import Round

EXACT_RELATIVE_ERROR = 1e-6
# A unit whose bias update is at most this share of its layer's largest is silent: its ratio divides by rounding.
SILENT_BIAS = 1e-12


def readout_layers(model: nn.Module, shared: list[str]) -> list[tuple[str, nn.Module]]:
    """Linears and single-group convolutions whose weight and trainable bias are both in ``shared``."""
    names = set(shared)
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) or module.bias is None:
            continue
        if isinstance(module, nn.Linear) or module.groups == 1:
            prefix = f"{name}." if name else ""
            if f"{prefix}weight" in names and f"{prefix}bias" in names:
                found.append((name, module))
    return found


def sample_vectors(module: nn.Module, value: torch.Tensor) -> torch.Tensor | None:
    """The per-sample vectors a layer reads from its input ``value`` (batch first), shaped (batch, d); None when it
    reads several vectors per sample (a Linear over positions, a convolution with more than one output position)."""
    if isinstance(module, nn.Linear):
        return value if value.dim() == 2 else None
    if isinstance(module, nn.Conv2d) and not isinstance(module.padding, str):
        patches = nn.functional.unfold(
            value, module.kernel_size, dilation=module.dilation, padding=module.padding, stride=module.stride
        )
        return patches[:, :, 0] if patches.shape[2] == 1 else None
    if isinstance(module, (nn.Conv1d, nn.Conv3d)):
        spatial = value.shape[2:]
        out = [
            (size + 2 * pad - dil * (kernel - 1) - 1) // stride + 1
            for size, pad, dil, kernel, stride in zip(
                spatial, module.padding, module.dilation, module.kernel_size, module.stride
            )
        ]
        if isinstance(module.padding, str) or any(o != 1 for o in out) or any(module.padding):
            return None
        # No padding and one output position: the kernel reads the leading corner of the input.
        corner = value[
            (
                slice(None),
                slice(None),
                *(slice(0, 1 + d * (k - 1), d) for d, k in zip(module.dilation, module.kernel_size)),
            )
        ]
        return corner.reshape(value.shape[0], -1)
    return None


class _Features:
    """Each readout layer's inputs for a batch at given weights, and the gradient of the batch's loss at its
    outputs (row i non-zero where the unit passed a gradient for sample i): one forward and one backward."""

    def __init__(self, net: nn.Module, layers: list[tuple[str, nn.Module]], loss: str):
        self.net, self.layers, self.loss = net, layers, loss
        self.buffers = {name: b.detach() for name, b in net.named_buffers()}
        self.fixed = {name: p.detach() for name, p in net.named_parameters()}
        self.seen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None  # recording inside __call__
        for name, module in layers:
            module.register_forward_hook(lambda mod, args, out, name=name: self._record(name, args[0], out))

    def _record(self, name: str, value: torch.Tensor, output: torch.Tensor):
        if self.seen is not None:
            self.seen[name].append((value.detach(), output))

    def __call__(
        self, weights: dict[str, torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor
    ) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """{layer: [(input, ∂L/∂output) per call]}."""
        from torch.func import functional_call

        from rankaudit.verify.client import mean_loss

        self.seen = {name: [] for name, _ in self.layers}
        try:
            with torch.enable_grad():
                values = {name: value.detach().requires_grad_() for name, value in weights.items()}
                output = functional_call(self.net, ({**self.fixed, **values}, self.buffers), (inputs,))
                outputs = [out for name, _ in self.layers for _, out in self.seen[name]]
                grads = torch.autograd.grad(mean_loss(output, labels, self.loss), outputs, allow_unused=True)
            found, at = {}, 0
            for name, _ in self.layers:
                found[name] = []
                for value, out in self.seen[name]:
                    grad = grads[at] if grads[at] is not None else torch.zeros_like(out)
                    found[name].append((value, grad.detach()))
                    at += 1
            return found
        finally:
            self.seen = None


def read_out(
    model: nn.Module,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    round_: Round,
    loss: str,
    shared: list[str],
    *,
    device: str | torch.device = "cpu",
) -> BiasReadout:
    """The bias readout on the update of ``round_`` (FedSGD included) from ``inputs`` (C x N x ...) with ``labels``
    (C x N), in float64 on ``device``; samples are numbered c·N + i."""
    import copy

    from rankaudit.verify.client import LocalTraining, check_local_training

    # torch.func's first use in a process imports torch._dynamo and sets up its transforms (2-3 s on two CPU
    # cores): done on a scalar and timed apart from the readout, which is the closed form's cost.
    importing = time.perf_counter()
    torch.func.grad(lambda t: (t * t).sum())(torch.ones(1))

    started = time.perf_counter()
    device = torch.device(device)
    net = copy.deepcopy(model).to(device=device, dtype=torch.float64).eval()
    x = inputs.detach().to(device=device, dtype=torch.float64)
    labels = labels.to(device)
    clients, samples = x.shape[:2]
    layers = readout_layers(net, shared)
    training = LocalTraining(net, round_, loss, shared)
    # A round no client's float32 training survives is the model's op or the flag's --lr, as rank and rgap say it.
    check_local_training(net, round_, loss, x, labels, "--verify bias")
    with torch.no_grad():
        paths = [training.trajectory(x[c], labels[c]) for c in range(clients)]
    start = paths[0][0]
    # Only the readout layers' updates are read.
    read = [f"{name}.{kind}" if name else kind for name, _ in layers for kind in ("weight", "bias")]
    update = {name: sum(path[-1][name] - start[name] for path in paths) for name in read}
    if not all(bool(torch.isfinite(value).all()) for value in update.values()):
        from rankaudit.errors import UsageError

        raise UsageError(
            "the simulated update is not finite (the local training diverged at these weights)",
            "lower --lr or --local-epochs",
        )
    features = _Features(net, layers, loss)
    notes = []
    if round_.optimizer != "sgd":
        notes.append(
            f"{round_.optimizer}'s update is not a weighted sum of gradients: a ratio reads a sample only "
            "where the optimizer's per-coordinate scaling happens to agree"
        )
    # Every (sample, step) a layer read: the sample's vector at that step's weights.
    table: dict[str, list[tuple[int, int, torch.Tensor]]] = {name: [] for name, _ in layers}
    reads_input: dict[str, bool] = {}
    fired: dict[str, dict[int, set[int]]] = {name: {} for name, _ in layers}
    skipped = []
    why_not: dict[str, str] = {}
    for c in range(clients if layers else 0):
        for step, part in enumerate(training.batches()):
            seen = features(paths[c][step], x[c][part], labels[c][part])
            for name, module in layers:
                if len(seen[name]) != 1:
                    why_not[name] = f"called {len(seen[name])} times per forward pass: its update sums the calls"
                    continue
                value, at_output = seen[name][0]
                vectors = sample_vectors(module, value)
                if vectors is None:
                    why_not[name] = "reads several vectors per sample (positions), not one"
                    continue
                if name not in reads_input:
                    flat = x[c][part].reshape(len(vectors), -1)
                    reads_input[name] = vectors.shape == flat.shape and bool(torch.equal(vectors, flat))
                first = c * samples + part.start
                for offset, vector in enumerate(vectors):
                    table[name].append((first + offset, step, vector))
                # Ground truth: δ of each unit for each sample, exact zeros behind a ReLU.
                active = at_output.reshape(len(vectors), -1) != 0
                for offset, unit in torch.nonzero(active).tolist():
                    fired[name].setdefault(unit, set()).add(first + offset)
    results, claims, nearest = [], {}, []
    for name, module in layers:
        prefix = f"{name}." if name else ""
        if name in why_not:
            skipped.append(f"{name or 'the model'}: {why_not[name]}")
            continue
        weight_update = update[f"{prefix}weight"].reshape(update[f"{prefix}weight"].shape[0], -1)
        bias_update = update[f"{prefix}bias"]
        scale = float(bias_update.abs().max())
        live = [k for k in range(len(bias_update)) if scale > 0 and abs(float(bias_update[k])) > SILENT_BIAS * scale]
        candidates = weight_update[live] / bias_update[live, None] if live else weight_update[:0]
        indices = torch.tensor([entry[0] for entry in table[name]])
        steps = [entry[1] for entry in table[name]]
        vectors = torch.stack([entry[2] for entry in table[name]])
        closest, errors = nearest_rows(candidates, vectors)
        read_units = []
        for row, unit in enumerate(live):
            best, error = int(closest[row]), float(errors[row])
            if error < EXACT_RELATIVE_ERROR:
                sample = int(indices[best])
                read_units.append(
                    {
                        "unit": unit,
                        "sample": sample,
                        "relative_error": error,
                        "step": steps[best] if not reads_input.get(name) else None,
                        "fired_for": len(fired[name].get(unit, ())),
                    }
                )
                claims.setdefault(sample, []).append((name, unit, error))
        isolating = sorted(unit for unit, who in fired[name].items() if len(who) == 1)
        results.append(
            BiasReadoutLayer(
                name=name,
                op=type(module).__name__,
                units=len(bias_update),
                live_units=len(live),
                reads_input=bool(reads_input.get(name)),
                units_read=read_units,
                samples_read=sorted({entry["sample"] for entry in read_units}),
                units_firing_for_one_sample=len(isolating),
            )
        )
        if reads_input.get(name):
            nearest += _nearest_psnr(candidates, x)
    per_sample = []
    for index in range(clients * samples):
        best = min(claims.get(index, []), key=lambda claim: claim[2], default=None)
        psnrs = [entry for entry in nearest if entry[0] == index]
        top = max(psnrs, key=lambda entry: math.inf if entry[1] is None else entry[1], default=None)
        per_sample.append(
            BiasReadoutSample(
                index=index,
                read_exactly=best is not None,
                layer=best[0] if best else None,
                unit=best[1] if best else None,
                relative_error=best[2] if best else None,
                psnr=None if top is None else top[1],
                psnr_measured=top is not None,
            )
        )
    read = [s.index for s in per_sample if s.read_exactly]
    if not layers:
        notes.append(
            "no Linear or single-position convolution sends both its weight and its bias update: nothing to read"
        )
    return BiasReadout(
        samples=clients * samples,
        samples_read=read,
        layers=results,
        per_sample=per_sample,
        skipped=skipped,
        seconds=time.perf_counter() - started,
        device=str(device),
        setup_seconds=started - importing,
        threshold=EXACT_RELATIVE_ERROR,
        notes=notes,
    )


def _nearest_psnr(candidates: torch.Tensor, x: torch.Tensor) -> list[tuple[int, float | None]]:
    """For a layer that reads the input: each sample's PSNR against its nearest ratio (None: identical)."""
    from rankaudit.verify.image_quality import psnr

    if not len(candidates):
        return []
    flat = x.reshape(-1, x[0, 0].numel())
    nearest, _ = nearest_rows(flat, candidates, relative_to_rows=True)
    return [
        (index, psnr(flat[index].cpu().numpy(), candidates[int(nearest[index])].cpu().numpy()))
        for index in range(len(flat))
    ]


# ---- the verifier: --verify bias, and the readout --verify rgap runs first on a batch or a round ----------------


def verify_bias(
    result,
    spec: str,
    *,
    seed: int = 0,
    device: str = "auto",
    data: str | None = None,
    shared_layers=None,
    withheld_layers=None,
) -> dict:
    """The bias readout on the real update of the analysed batch (FedSGD at -b B) or round; fills
    result.verification['bias'] and returns it."""
    import dataclasses

    from rankaudit.errors import UsageError
    from rankaudit.verify.attacks.fedavg import check_attack_round_size
    from rankaudit.verify.client import round_labels
    from rankaudit.verify.inputs import real_inputs
    from rankaudit.verify.model import build_real_model, resolve_device
    from rankaudit.verify.rank import jacobian as rank

    if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
        raise UsageError(
            "--verify bias matches each unit's ratio to the samples' real-valued inputs, and this model "
            "takes several inputs or token ids",
            "verify a model with a single float input",
        )
    round_ = result.round if result.round is not None else Round(batch_size=result.batch_size)
    check_attack_round_size(round_, tuple(result.input_shape), 1, 1, "--verify bias")  # one simulated round
    device = resolve_device(device)
    model, weights = build_real_model(spec, result.input_shape, seed)
    shared = rank.shared_parameter_names(model, shared_layers, withheld_layers)
    flat, source = real_inputs(result, data, round_.clients * round_.samples, seed)
    inputs = flat.reshape(round_.clients, round_.samples, *flat.shape[1:])
    labels, loss = round_labels(model, inputs, seed)
    readout = read_out(model, inputs, labels, round_, loss, shared, device=device)
    verification = dataclasses.asdict(readout)
    verification.update(bias_summary(result, readout))
    verification.update(
        weights=weights, inputs=source, loss=loss, seconds=round(readout.seconds, 3), batch=_batch_words(round_)
    )
    result.verification["bias"] = verification
    return verification


def _batch_words(round_: Round) -> str:
    if round_.fedsgd:
        return f"one gradient of a batch of {round_.batch_size}"
    clients = f", {round_.clients} clients summed" if round_.clients > 1 else ""
    return (
        f"a round of N = {round_.samples}, B = {round_.batch_size}, E = {round_.local_epochs} "
        f"({round_.steps} local steps{clients})"
    )


def _first_few(values: list[int], shown: int = 6) -> str:
    text = ", ".join(str(v) for v in values[:shown])
    return text + (f", ... ({len(values)} in all)" if len(values) > shown else "")


def bias_summary(result, readout: BiasReadout) -> dict:
    """The headline, the judgement against the per-sample verdict, and an internal error where they contradict.

    A sample read exactly by a layer that reads the input is determined by the update: rank(J_i) = |x| for it
    (x_i = u_W[k] / u_b[k] is a smooth inverse), so a per-sample bound R_s < |x| is wrong for this model."""
    images = sorted({entry["sample"] for layer in readout.layers if layer.reads_input for entry in layer.units_read})
    features = sorted(set(readout.samples_read) - set(images))
    count = len(readout.samples_read)
    if count:
        where = "; ".join(
            f"{layer.name} unit{'s' if len(layer.units_read) > 1 else ''} "
            + _first_few([entry["unit"] for entry in layer.units_read])
            + f" -> sample{'s' if len(layer.samples_read) > 1 else ''} "
            + _first_few(layer.samples_read)
            for layer in readout.layers
            if layer.units_read
        )
        headline = (
            f"{count} of {readout.samples} sample{'s' if readout.samples != 1 else ''} read out exactly ({where})"
        )
    else:
        live = sum(layer.live_units for layer in readout.layers)
        headline = (
            f"no sample read out exactly ({live} live unit{'s' if live != 1 else ''} checked, each one "
            "mixing several samples)"
            if readout.layers
            else "no readout layer: nothing to read"
        )
    sample = getattr(result.identifiability, "sample", None) if result.identifiability is not None else None
    single = result.round is None or (result.round.fedsgd and result.round.batch_size == 1)
    single = single and result.batch_size == 1
    # The per-sample level (method.md: each sample); without it only a single-sample audit's verdict speaks of one sample.
    level = getattr(sample, "level", None) or (result.verdict if single else None)
    internal_error = None
    if images and level in ("partial", "protected"):
        internal_error = (
            f"internal error: the bias readout determines sample{'s' if len(images) > 1 else ''} "
            f"{', '.join(map(str, images))} exactly, yet the per-sample verdict is {level} (a certified "
            "deficit): the per-sample bound is wrong for this model; please report it with this model "
            "file"
        )
    if images:
        judgement = (
            f"the update hands over {len(images)} image{'s' if len(images) > 1 else ''} exactly: "
            f"not protected for {'them' if len(images) > 1 else 'that sample'}"
        )
        judgement += (
            "; confirms exposed (each sample)"
            if level == "exposed"
            else f"; the verdict {result.verdict} speaks of the batch as a whole, not of any one sample"
            if level is None and result.verdict in ("partial", "protected")
            else ""
        )
    elif features:
        judgement = (
            f"the update hands over the features of {len(features)} sample"
            f"{'s' if len(features) > 1 else ''} exactly (a deeper layer): R-GAP or the optimisation "
            "attack takes them to the input"
        )
    else:
        judgement = (
            "no exact readout on this batch: the readout needs a unit that fires for one sample alone, "
            "which other data may give; this shows no protection"
        )
    return {
        "samples_read_count": count,
        "images_read": images,
        "features_read": features,
        "headline": headline,
        "judgement": judgement,
        "internal_error": internal_error,
    }


def nearest_rows(rows: torch.Tensor, table: torch.Tensor, *, relative_to_rows: bool = False):
    """For each row, the index of the table entry nearest relative to that entry's norm (to the row's own norm with
    ``relative_to_rows``, which is then the plain nearest), and that relative error recomputed directly (the
    expanded square below cancels; the direct difference does not)."""
    if not len(rows) or not len(table):
        return torch.zeros(len(rows), dtype=torch.long), torch.full((len(rows),), math.inf, dtype=rows.dtype)
    squares = (rows * rows).sum(1)[:, None] + (table * table).sum(1)[None, :] - 2 * rows @ table.T
    scale = (
        torch.ones(len(table), dtype=rows.dtype, device=rows.device)
        if relative_to_rows
        else (table * table).sum(1).clamp_min(1e-300)
    )
    best = (squares / scale[None, :]).argmin(dim=1)
    reference = rows if relative_to_rows else table[best]
    errors = (rows - table[best]).norm(dim=1) / reference.norm(dim=1).clamp_min(1e-300)
    return best.cpu(), errors.cpu()
