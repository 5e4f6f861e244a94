"""The guard's two halves: what only the model can measure, and the decision made from those measurements where the
model's code need not run (docs/guard.md, "Where the decision is made").

``measure`` runs the model: at the received weights (and, without the training's own records, at the sent ones)
what each readout layer reads from each sample and each sample's signal at each unit, what a hidden layer's
features determine of the sample, and the optional visible-energy figure. It returns them as plain arrays
(``Measurements``), which `rankaudit guard` hands from its model worker to the process that decides.

``MeasuredInputs`` gives those tables back to the readout search (rankaudit.guard.readout.find_readouts) in the
deciding process, with one thing taken from no measurement: a layer whose weight rows have the sample's size reads
the sample itself, so its vectors are the samples the decider loaded, and its readouts are formed from the update
alone. A model that forges its measurements can then hide a hidden layer's readout (its features are its own to
compute) but never a readout of the input.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from rankaudit.guard.batch import as_model_input
from rankaudit.guard.pairs import IDENTICAL_PSNR
from rankaudit.guard.readout import LayerInputs, bias_of, find_readouts, weight_layer
from rankaudit.result import GuardReadout


@dataclass
class Architecture:
    """The audited model's state-dict names, shapes and dtypes, without its code or its weights: what the received
    weights are checked against. ``state_dict()`` gives meta tensors (no memory) of those shapes."""

    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, str]

    @classmethod
    def of(cls, model: nn.Module) -> Architecture:
        state = model.state_dict()
        return cls(
            {name: tuple(int(n) for n in value.shape) for name, value in state.items()},
            {name: str(value.dtype).removeprefix("torch.") for name, value in state.items()},
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            name: torch.empty(shape, dtype=getattr(torch, self.dtypes[name]), device="meta")
            for name, shape in self.shapes.items()
        }


@dataclass
class Measurements:
    """What the model measured for one update, as plain data (arrays as rankaudit.guard.measure.packed gives them,
    or float64 tensors when the decision is made in the process that measured)."""

    layers: list[str]  # the readout layers, in the model's order
    vectors: dict[str, tuple]  # layer -> (N, d): what it reads from each sample at the received weights
    signals: dict[str, tuple]  # layer -> (N, units): each sample's signal at each unit
    why_not: dict[str, str]  # layer -> why it is not checkable
    later_vectors: dict[str, tuple] = field(default_factory=dict)  # the same at the sent weights
    later_signals: dict[str, tuple] = field(default_factory=dict)
    watched: bool = False  # the tables are the training's own records (rankaudit.guard.watch)
    steps: int = 0  # the training steps those records hold (each rounds the weights it writes)
    figures: dict[str, dict[int, float]] = field(default_factory=dict)  # layer -> sample -> PSNR its features show
    figure_notes: dict[str, list[str]] = field(default_factory=dict)
    energy: dict | None = None


def _numpy(tables: dict[str, torch.Tensor], as_bytes: bool = True) -> dict[str, tuple[tuple[int, ...], bytes]]:
    if not as_bytes:  # the decision runs in this process: the float64 tables themselves, not a copy of their bytes
        return {name: value.detach().cpu().to(torch.float64) for name, value in tables.items()}
    return {name: packed(value) for name, value in tables.items()}


def packed(value: torch.Tensor) -> tuple[tuple[int, ...], bytes]:
    """(shape, float64 bytes): an array the worker's answer carries as plain bytes (no numpy reconstructor)."""
    array = np.ascontiguousarray(value.detach().cpu().to(torch.float64).numpy())
    return tuple(int(n) for n in array.shape), array.tobytes()


def unpacked(value: tuple[tuple[int, ...], bytes] | torch.Tensor) -> torch.Tensor:
    """The float64 tensor ``packed`` gave (or the table itself, from a measurement made in this process); one whose
    bytes do not fill its shape is refused."""
    if isinstance(value, torch.Tensor):
        return value
    shape, data = value
    if len(data) != 8 * int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"an array of shape {shape} with {len(data)} bytes")
    return torch.from_numpy(np.frombuffer(data, dtype=np.float64).reshape(shape).copy())


def measure(
    model: nn.Module,
    received: dict[str, torch.Tensor],
    sent: dict[str, torch.Tensor],
    samples: torch.Tensor,
    labels: torch.Tensor | None,
    settings,
    *,
    watched: tuple | None = None,
    judge_now: bool = False,
    as_bytes: bool = True,
) -> tuple[Measurements, LayerInputs]:
    """The model's measurements for the update ``sent − received`` (both named like the model's state dict).
    ``judge_now``: also what each hidden layer's features determine of every sample some readout reads (the
    deciding process cannot run the model to ask later). ``as_bytes``: tables as plain bytes, for another process;
    False keeps them as tensors, for a decision made in this one."""
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    shared = [name for name in trainable if name in sent]
    inputs = LayerInputs(model, received, shared)
    found, signals, _, why_not = inputs.vectors(samples, labels, watched)
    measured = Measurements(
        layers=[name for name, _ in inputs.layers],
        vectors=_numpy(found, as_bytes),
        signals=_numpy(signals, as_bytes),
        why_not=dict(why_not),
        watched=watched is not None,
    )
    if watched is None:
        at_sent = LayerInputs(model, {**received, **sent}, shared)
        later_vectors, later_signals = at_sent.vectors(samples, labels)[:2]
        measured.later_vectors = _numpy(later_vectors, as_bytes)
        measured.later_signals = _numpy(later_signals, as_bytes)
    if settings.energy_budget > 0 and labels is not None:
        from rankaudit.guard.energy import visible_energy

        measured.energy = visible_energy(
            inputs.net,
            as_model_input(inputs.net, samples),
            labels,
            shared,
            min_hidden=settings.min_hidden,
            budget=settings.energy_budget,
        )
    if judge_now and settings.check_features:
        view = MeasuredInputs(measured, received, samples, judge=live_judge(inputs))
        view.find(received, sent, labels, settings.min_psnr, check_features=True)
    return measured, inputs


def live_judge(inputs: LayerInputs):
    from rankaudit.guard.features import determined_by_layer

    modules = dict(inputs.layers)
    return lambda pending, samples, min_psnr=None: determined_by_layer(
        inputs.net, {name: modules[name] for name in pending}, samples, pending, min_psnr
    )


class _View:
    """One set of tables in the form find_readouts reads (LayerInputs' ``layers``, ``vectors`` and ``determined``)."""

    def __init__(self, layers, vectors, signals, reads_input, why_not, determined, later=None):
        self.layers = [(name, None) for name in layers]
        self._tables = (vectors, signals, reads_input, why_not)
        self.determined = determined
        self.later = later

    def vectors(self, samples, labels=None, watched=None):
        return self._tables


class MeasuredInputs:
    """The measurements, as the deciding process uses them: input layers read from its own samples."""

    def __init__(self, measured: Measurements, received: dict[str, torch.Tensor], samples: torch.Tensor, judge=None):
        self.measured = measured
        self.judge = judge
        self._samples = samples
        count = len(samples)
        tensor = {name: unpacked(value) for name, value in measured.vectors.items()}
        signals = {name: unpacked(value) for name, value in measured.signals.items()}
        later_vectors = {name: unpacked(value) for name, value in measured.later_vectors.items()}
        later_signals = {name: unpacked(value) for name, value in measured.later_signals.items()}
        inputs = input_layers(received, samples)
        reads_input, plain, extra = {}, {}, []
        for name in measured.layers:
            if name in measured.why_not:
                continue
            flat = inputs.get(name)
            if name not in tensor or name not in signals:
                plain[name] = f"its measurements are missing ({name or 'the model'})"
            elif flat is not None and tensor[name].shape == flat.shape and bool(torch.equal(tensor[name], flat)):
                reads_input[name] = True
                tensor[name] = later_vectors[name] = flat  # the decider's own samples, not the measurement
            else:
                reads_input[name] = False
        why_not = {**measured.why_not, **plain}
        # Input-shaped layers the measurements do not show reading the samples: checked on the samples as well.
        extra = [name for name in inputs if not reads_input.get(name)]

        def unit_table(tables, name):
            units = received[f"{name}.bias" if name else "bias"].shape[0]
            table = tables.get(name)
            ok = table is not None and tuple(table.shape) == (count, units) and bool(torch.isfinite(table).all())
            return table if ok else torch.zeros(count, units, dtype=torch.float64)

        later = _View(measured.layers, later_vectors, later_signals, reads_input, why_not, self.determined)
        self.view = _View(
            measured.layers, tensor, signals, reads_input, why_not, self.determined, later if later_vectors else None
        )
        self.inputs_view = None
        if extra:
            own = {name: inputs[name] for name in extra}
            self.inputs_view = _View(
                extra,
                own,
                {name: unit_table(signals, name) for name in extra},
                dict.fromkeys(extra, True),
                {},
                self.determined,
                _View(extra, own, {name: unit_table(later_signals, name) for name in extra}, {}, {}, None),
            )

    def signals(self) -> dict[str, torch.Tensor]:
        """{layer: (N, units)}: each sample's signal at each unit, as measured (the training's own, when watched)."""
        return {name: unpacked(value) for name, value in self.measured.signals.items()}

    def determined(
        self, pending: dict[str, list[int]], samples: torch.Tensor, min_psnr: float | None = None
    ) -> tuple[dict[str, dict[int, float]], dict[str, list[str]]]:
        """What each layer's features determine of each of its samples ({layer: samples} in; {layer: {sample: PSNR}}
        and {layer: notes} out): measured now (in the model's process), else from the measurements; a sample they
        do not cover counts as read. Each (layer, sample) is measured once per decision: the figure depends on the
        received weights and the sample alone, so a re-read of an altered update (drop, noise) reuses it."""
        figures, notes = {}, {}
        if self.judge is not None:
            new = {
                name: [i for i in indices if i not in self.measured.figures.get(name, {})]
                for name, indices in pending.items()
            }
            said: dict[str, list[str]] = {}
            if any(new.values()):
                found, said = self.judge({name: indices for name, indices in new.items() if indices}, samples, min_psnr)
                for name, values in found.items():
                    self.measured.figures.setdefault(name, {}).update(values)
                for name, lines in said.items():
                    self.measured.figure_notes.setdefault(name, []).extend(lines)
            for name, indices in pending.items():
                known = self.measured.figures.get(name, {})
                figures[name] = {index: known[index] for index in indices}
                notes[name] = said.get(name, [])
            return figures, notes
        for name, indices in pending.items():
            known = self.measured.figures.get(name, {})
            missing = [index for index in indices if index not in known]
            notes[name] = list(self.measured.figure_notes.get(name, []))
            if missing:
                notes[name].append(
                    f"what the features of samples {missing} determine was not measured: they count as read"
                )
            figures[name] = {index: known.get(index, IDENTICAL_PSNR) for index in indices}
        return figures, notes

    def find(
        self,
        received: dict[str, torch.Tensor],
        sent: dict[str, torch.Tensor],
        labels: torch.Tensor | None,
        min_psnr: float,
        *,
        check_features: bool,
        samples: torch.Tensor | None = None,
    ) -> tuple[list[GuardReadout], list[str], list[str], list[str]]:
        """find_readouts over the measured layers, and over the input-shaped ones on the decider's samples."""
        samples = self._samples if samples is None else samples
        watched = () if self.measured.watched else None
        found = find_readouts(
            self.view,
            received,
            sent,
            samples,
            min_psnr,
            labels=labels,
            check_features=check_features,
            watched=watched,
            at_sent=self.view.later,
            steps=self.measured.steps,
        )
        if self.inputs_view is None:
            return found
        readouts, checked, skipped, notes = found
        more, more_checked, _, more_notes = find_readouts(
            self.inputs_view, received, sent, samples, min_psnr, labels=labels, at_sent=self.inputs_view.later
        )
        return (
            more + readouts,
            checked + [name for name in more_checked if name not in checked],
            skipped,
            notes + more_notes,
        )


def input_layers(received: dict[str, torch.Tensor], samples: torch.Tensor) -> dict[str, torch.Tensor]:
    """{layer: the samples as its (N, d) vectors} for every weight with a bias whose rows have the sample's size,
    found from the received weights' names and shapes alone: such a layer, given the sample, reads the sample."""
    size = samples[0].numel() if len(samples) else 0
    found = {}
    for name, weight in received.items():
        layer = weight_layer(name)
        if layer is None or weight.dim() < 2 or not weight.is_floating_point():
            continue
        bias = received.get(bias_of(layer))
        if bias is None or tuple(bias.shape) != (weight.shape[0],) or weight[0].numel() != size:
            continue
        found[layer] = samples.detach().to(weight.dtype).reshape(len(samples), -1).to(torch.float64)
    return found
