"""The guard's decision on one update, and its action: send, block, or send with the offending rows dropped or
noised; one JSON line per decision (docs/guard.md).

The frameworks' adapters (rankaudit.guard.flower, rankaudit.guard.nvflare) and the command (rankaudit.guard.local)
call Guard.decide with the weights the client received, the weights it is about to send, and the samples it trained
on. It runs its two halves (rankaudit.guard.measure): the model's measurements, then decide_measured, which the
command also calls on its own, in a process where the model's code never ran; everything the guard decides is decided
there.
"""

from __future__ import annotations

import json
import logging
import math
import time

import torch
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.guard.batch import error_line
from rankaudit.guard.measure import Architecture, MeasuredInputs, Measurements, live_judge, measure
from rankaudit.guard.readout import architecture_difference, named_like_model
from rankaudit.guard.rows import row_readouts, unread_parameters
from rankaudit.guard.watch import numbers_among
from rankaudit.result import GuardDecision, GuardReadout
from rankaudit.settings.guard_options import GuardSettings

LOGGER = logging.getLogger("rankaudit.guard")
LOGGER.addHandler(logging.NullHandler())  # a library's logger: the application (or the framework's adapter) shows it
# After a drop or noise action the update is checked again; what still reads a sample after this many passes
# is blocked.
ALTER_PASSES = 3
# How many readouts a decision's reasons spell out before they count the rest.
REASONS_SPELLED = 4


def _words(readout: GuardReadout) -> str:
    if readout.kind == "ratio" and readout.scale_open:
        how = f"unit {readout.units[0]}'s weight-row update, at the scale its bias update's float rounding leaves open,"
    elif readout.kind == "ratio":
        how = f"unit {readout.units[0]}'s weight-row update over its bias update"
    elif readout.kind == "row":
        how = f"unit {readout.units[0]}'s weight-row update (no bias), at its best scale and offset,"
    elif readout.kind == "row-pair":
        i, j = readout.units
        how = f"units {i} and {j} combined (row {i} - {readout.scale:.3g} x row {j}, no bias), at its best scale and offset,"
    else:
        i, j = readout.units
        how = f"units {i} and {j} combined (row {i} - {readout.scale:.3g} x row {j}, over the same of their biases)"
    if readout.undone is not None:
        how += f", with {readout.undone},"
    if readout.bias_rate is not None:
        how += f", the biases' update times {readout.bias_rate:.3g} (their own learning rate),"
    if readout.received_share is not None:
        how += f", with {readout.received_share:.3g} times the received weights added back (what weight decay took),"
    if readout.reads_input:
        return f"{readout.layer}: {how} is sample {readout.sample} at {readout.psnr:.1f} dB"
    return (
        f"{readout.layer}: {how} is sample {readout.sample}'s features at {readout.psnr:.1f} dB, which show the "
        f"sample at {readout.sample_psnr:.1f} dB"
    )


def best_by_sample(readouts: list[GuardReadout]) -> dict[int, GuardReadout]:
    """Each sample's readout that shows the sample itself best."""
    best: dict[int, GuardReadout] = {}
    for readout in readouts:
        if readout.sample not in best or readout.sample_psnr > best[readout.sample].sample_psnr:
            best[readout.sample] = readout
    return {sample: best[sample] for sample in sorted(best)}


def _reasons(readouts: list[GuardReadout]) -> list[str]:
    ordered = list(best_by_sample(readouts).values())
    reasons = [_words(readout) for readout in ordered[:REASONS_SPELLED]]
    if len(ordered) > REASONS_SPELLED:
        reasons.append(f"and {len(ordered) - REASONS_SPELLED} more samples read")
    return reasons


def _feature_note(readouts: list[GuardReadout], min_psnr: float, feature_action: str) -> str:
    best = best_by_sample(readouts)
    samples = ", ".join(map(str, list(best)[:REASONS_SPELLED])) + (" ..." if len(best) > REASONS_SPELLED else "")
    layers = ", ".join(sorted({readout.layer for readout in readouts}))
    shown = max(readout.sample_psnr for readout in readouts)
    return (
        f"{layers}: the features of sample{'s' if len(best) > 1 else ''} {samples} are read, but they show each "
        f"sample at {shown:.1f} dB at most, under {min_psnr:g} dB (feature-action {feature_action})"
    )


def _altered(
    received: dict[str, torch.Tensor],
    sent: dict[str, torch.Tensor],
    readouts: list[GuardReadout],
    action: str,
    noise_scale: float,
    generator: torch.Generator,
    whole_layers: bool = False,
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``sent`` with each offending unit's weight row and bias entry set back to the received value (drop) or
    given Gaussian noise of ``noise_scale`` times that row's own update norm (noise); every unit of a layer whose
    readout was a sample's features, and with ``whole_layers`` every unit of any layer a readout was found in."""
    out = {name: value.detach().clone() for name, value in sent.items()}
    changed = set()
    rows = {(readout.layer, unit) for readout in readouts for unit in readout.units}
    # A deeper layer's features move with every local step, and the check compares with those at the received
    # weights: a later step's readout of that layer can escape it, so such a layer goes as a whole. Without the
    # steps' own records, which units a step's sample sits in is known only at the received and sent weights: a
    # sample read in one pair of units can still be read in another pair of the same layer, so the layer goes.
    for readout in readouts:
        if whole_layers or not readout.reads_input:
            weight = f"{readout.layer}.weight" if readout.layer else "weight"
            rows |= {(readout.layer, unit) for unit in range(len(sent[weight]))}
    rows = sorted(rows)
    for layer, unit in rows:
        prefix = f"{layer}." if layer else ""
        for name in (f"{prefix}weight", f"{prefix}bias"):
            if name not in sent:  # a layer without a bias
                continue
            update = sent[name][unit].to(torch.float64) - received[name][unit].to(torch.float64)
            if action == "drop":
                out[name][unit] = received[name][unit]
            else:
                std = noise_scale * float(update.norm()) / math.sqrt(max(update.numel(), 1))
                noise = torch.randn(update.shape, generator=generator, dtype=torch.float64) * std
                out[name][unit] = (sent[name][unit].to(torch.float64) + noise).to(out[name].dtype)
            changed.add(name)
    return out, changed


class Guard:
    """The client-side guard for one audited model: ``decide`` on each update before it is sent.

    ``model``: the audited architecture (any weights; the received ones are loaded into a copy). ``settings``:
    rankaudit.settings.guard_options.GuardSettings (block by default)."""

    # Where each decision's line goes besides the settings' log file; a framework's adapter sets None and writes the
    # line into the framework's own log instead, so that each decision is logged once.
    logger: logging.Logger | None = LOGGER

    def __init__(self, model: nn.Module, settings: GuardSettings | None = None):
        self.model = model
        self.settings = settings or GuardSettings()
        self.generator = torch.Generator()
        if self.settings.seed is None:
            self.generator.seed()  # non-deterministic: from the operating system's entropy
        else:
            self.generator.manual_seed(self.settings.seed)
        self.watching = None

    def watch(self, net: nn.Module):
        """``with guard.watch(net): train(net)``: the per-sample tables the next ``decide`` needs, recorded during
        the client's own training steps (rankaudit.guard.watch), so that it does not compute them again."""
        from rankaudit.guard.watch import Watch

        self.watching = Watch(net)
        return self.watching

    def decide(
        self,
        received: dict[str, torch.Tensor],
        sent: dict[str, torch.Tensor],
        samples: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        round_number: int | None = None,
    ) -> tuple[GuardDecision, dict[str, torch.Tensor] | None]:
        """(the decision, the weights to send: ``sent`` itself, an altered copy, or None when blocked)."""
        started = time.perf_counter()
        received = {
            k: _with_values(f"received {k}", v)
            for k, v in named_like_model(self.model, _state("received", received)).items()
        }
        sent = {k: _with_values(f"sent {k}", v) for k, v in named_like_model(self.model, _state("sent", sent)).items()}
        samples = _with_values("samples", samples, keep_device=True)
        if samples.dim() == 0 or not len(samples):
            raise UsageError("the guard was given no samples", "give it the samples this update was computed on")
        # The sum first: it is finite when every value is (a NaN or an infinity carries through it), and costs a
        # fifth of the value-by-value test, which runs only when the sum is not finite.
        if (
            samples.is_floating_point()
            and not bool(torch.isfinite(samples.sum()))
            and not bool(torch.isfinite(samples).all())
        ):
            # A NaN in a sample makes every readout compared with it NaN: nothing would be named, and the update sent.
            bad = torch.nonzero(~torch.isfinite(samples.reshape(len(samples), -1)).all(dim=1)).flatten().tolist()
            raise UsageError(
                f"the samples given to the guard hold NaN or infinite values (samples {bad[:8]})",
                "give it the samples as the model trained on them (missing values filled in as the training fills them)",
            )
        labels = None if labels is None else _with_values("labels", labels)
        if labels is not None and (labels.dim() == 0 or len(labels) != len(samples)):
            unbatched = samples.dim() == 1 and labels.numel() == 1
            raise UsageError(
                f"the guard was given {labels.numel() if labels.dim() == 0 else len(labels)} labels for "
                f"{len(samples)} samples"
                + (f" (the samples have no batch dimension: shape {tuple(samples.shape)})" if unbatched else ""),
                "give the samples batch first (one sample: samples[None])"
                if unbatched
                else "give one label per sample, in the samples' order (or no labels)",
            )
        architecture = Architecture.of(self.model)
        measured, judge = None, None
        notes: list[str] = []
        # Weights to send of other names, shapes or kinds: the model does not run on them, and nothing is measured.
        if architecture_difference(architecture, received) is None and _changed_by_update(received, sent) is None:
            watched = self.watching.tables(samples) if self.watching is not None else None
            if watched is None and self.watching is not None and self.watching.untied and not self.watching.steps:
                notes.append(
                    "the watch saw the layers train but not the model's own call (net.forward(x) called directly, or "
                    "a batch that is not a tensor): the steps could not be tied to the samples, and the update was "
                    "read without them; call the model as net(batch) inside the watch"
                )
            if watched is None and self.watching is not None:
                # The steps ran on samples the guard was not given (augmented copies: flipped, cropped, noised). The
                # update shows those, as trained: they are what is checked.
                trained = self.watching.trained_samples()
                if trained is not None and trained.is_floating_point() and not bool(torch.isfinite(trained).all()):
                    trained = None  # steps on values the model fills in itself: read against the samples given
                found = self.watching.tables(trained) if trained is not None else None
                if found is not None:
                    origin = numbers_among(trained, samples)
                    if origin is None:
                        notes.append(
                            f"the training ran on {len(trained)} samples that are not all among the {len(samples)} "
                            "given (augmented copies): they were checked as trained, numbered in the order the "
                            "training first ran them"
                        )
                        labels = None
                    else:
                        notes.append(
                            f"the training ran on {len(trained)} of the {len(samples)} samples given and on no others "
                            "(a last batch dropped, or samples drawn with replacement): those were checked, numbered "
                            f"in the order the training first ran them (given samples {origin[:8]}"
                            f"{' ...' if len(origin) > 8 else ''})"
                        )
                        labels = None if labels is None else labels[torch.tensor(origin)]
                    watched, samples = found, trained
            # A new copy of the model for each decision: one kept from the last would carry state the state dict
            # does not hold (a buffer that is not persistent, an attribute, a swapped submodule) from round to round.
            try:
                measured, inputs = measure(
                    self.model, received, sent, samples, labels, self.settings, watched=watched, as_bytes=False
                )
            except (RuntimeError, IndexError, KeyError, TypeError, ValueError, NotImplementedError) as exc:
                raise UsageError(
                    f"the model could not run on the samples given to the guard, of shape {tuple(samples.shape)} "
                    f"({error_line(exc)})",
                    "give the samples as the model's forward() takes them, batch first, as the training ran them",
                ) from exc
            if watched is not None:
                measured.steps = sum(1 for step in self.watching.steps if step["signals"])
            judge = live_judge(inputs)
        self.watching = None
        return self.decide_measured(
            architecture,
            measured,
            received,
            sent,
            samples,
            labels,
            round_number=round_number,
            started=started,
            judge=judge,
            notes=notes,
        )

    def decide_measured(
        self,
        architecture: Architecture,
        measured: Measurements | None,
        received: dict[str, torch.Tensor],
        sent: dict[str, torch.Tensor],
        samples: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        round_number: int | None = None,
        started: float | None = None,
        judge=None,
        notes: list[str] | None = None,
    ) -> tuple[GuardDecision, dict[str, torch.Tensor] | None]:
        """The decision half: from the audited architecture, the model's measurements (None when the architecture
        differs: nothing was measured), the weights and the samples; no model code runs here. ``judge``: what a
        hidden layer's features determine, measured on demand where the model is at hand."""
        started = time.perf_counter() if started is None else started
        settings = self.settings
        base = dict(samples=int(len(samples)), min_psnr=settings.min_psnr, round=round_number)
        difference = architecture_difference(architecture, received)
        which = "received weights"
        if difference is None:
            changed = _changed_by_update(received, sent)
            if changed is not None:
                which, difference = "weights to send", changed
        if difference is None and measured is None:
            difference = "no measurements were made at them"
        if difference is not None:
            decision = GuardDecision(
                action="block",
                exact_samples=[],
                reasons=[f"the {which} are not the audited model's: {difference}"],
                readouts=[],
                layers_checked=[],
                skipped=[],
                architecture=difference,
                seconds=time.perf_counter() - started,
                **base,
            )
            return self._logged(decision), None
        inputs = MeasuredInputs(measured, received, samples, judge=judge)
        readouts, checked, skipped, found_notes = self._find(inputs, received, sent, samples, labels)
        notes = list(notes or []) + found_notes
        energy = measured.energy
        leaking = [readout for readout in readouts if readout.leaks]
        features = [readout for readout in readouts if not readout.leaks]
        exact = sorted({readout.sample for readout in leaking})
        feature_samples = sorted({readout.sample for readout in features} - set(exact))
        reasons = _reasons(leaking)
        if features:
            line = _feature_note(features, settings.min_psnr, settings.feature_action)
            (notes if settings.feature_action == "send" else reasons).append(line)
        low_energy = bool(energy and energy.get("measured") and energy["below"])
        if low_energy:
            reasons.append(
                f"at these weights sample {energy['worst_sample']} hides only {energy['hidden']:.1%} of its energy "
                f"(under {settings.min_hidden:.0%}); {len(energy['below'])} of {len(samples)} samples are under it"
            )
        if settings.energy_budget > 0 and labels is None:
            notes.append("the visible-energy check needs the samples' labels, and none were given: not measured")
        action, to_send, changed = "send", sent, set()
        acted_on = features if settings.feature_action != "send" else []
        if low_energy or (leaking and settings.action == "block") or (acted_on and settings.feature_action == "block"):
            action, to_send = "block", None
            if low_energy and settings.action != "block":
                notes.append(
                    f"{settings.action} alters rows that read samples; low visible energy is the whole "
                    "update's: blocked"
                )
        elif leaking or acted_on:
            action, to_send, changed, altered = self._alter(inputs, received, sent, samples, labels, readouts)
            notes += altered
        decision = GuardDecision(
            action=action,
            exact_samples=exact,
            reasons=reasons,
            readouts=readouts,
            layers_checked=checked,
            skipped=skipped,
            architecture=None,
            seconds=time.perf_counter() - started,
            energy=energy,
            changed=sorted(changed),
            notes=notes,
            feature_samples=feature_samples,
            psnr={sample: readout.sample_psnr for sample, readout in best_by_sample(readouts).items()},
            **base,
        )
        return self._logged(decision), to_send

    def _find(self, inputs, received, sent, samples, labels):
        """(readouts, layers checked, layers skipped with why, notes): the measured layers' readouts, and those of
        the weight matrices sent without a bias."""
        settings = self.settings
        readouts, checked, skipped, notes = inputs.find(
            received, sent, labels, settings.min_psnr, check_features=settings.check_features
        )
        rows, rows_checked, unchecked, named = row_readouts(
            received, sent, samples, settings.min_psnr, inputs.signals()
        )
        # A layer whose bias did not move is read by its rows: a line that it could not be measured no longer holds.
        skipped = [line for line in skipped if line.split(":", 1)[0] not in rows_checked]
        skipped = skipped + ([unchecked] if unchecked else [])
        accounted = {*checked, *rows_checked, *named, *(line.split(":", 1)[0] for line in skipped)}
        unread = unread_parameters(sent, accounted)
        checked = checked + [layer for layer in rows_checked if layer not in checked]
        return rows + readouts, checked, skipped + ([unread] if unread else []), notes

    def _offending(self, readouts: list[GuardReadout]) -> tuple[list[GuardReadout], list[GuardReadout]]:
        """(readouts the action alters, feature readouts dropped by feature-action drop)."""
        leaking = [readout for readout in readouts if readout.leaks]
        dropped = [r for r in readouts if not r.leaks] if self.settings.feature_action == "drop" else []
        return leaking, dropped

    def _alter(self, inputs, received, sent, samples, labels, readouts):
        """Drop or noise the offending rows, read what is left with the same test, and block what still reads a
        sample (or, under feature-action drop, a sample's features)."""
        settings, changed, current = self.settings, set(), sent
        watched = bool(inputs.measured.watched)
        leaking, dropped = self._offending(readouts)
        action = settings.action if leaking else "drop"
        for _ in range(ALTER_PASSES):
            current, touched = _altered(
                received, current, leaking, settings.action, settings.noise_scale, self.generator, not watched
            )
            changed |= touched
            current, touched = _altered(received, current, dropped, "drop", settings.noise_scale, self.generator)
            changed |= touched
            found = self._find(inputs, received, current, samples, labels)[0]
            leaking, dropped = self._offending(found)
            if not leaking and not dropped:
                return action, current, changed, []
        return (
            "block",
            None,
            changed,
            [
                f"after {ALTER_PASSES} passes of {action}, {len({r.sample for r in leaking + dropped})} samples were "
                f"still read at {settings.min_psnr:g} dB or above: blocked"
            ],
        )

    def _logged(self, decision: GuardDecision) -> GuardDecision:
        line = json.dumps(log_record(decision), sort_keys=False)
        if self.settings.log:
            with open(self.settings.log, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")
        if self.logger is not None:
            self.logger.log(logging.INFO if decision.action == "send" else logging.WARNING, "rankaudit guard: %s", line)
        return decision


def _changed_by_update(received: dict[str, torch.Tensor], sent: dict[str, torch.Tensor]) -> str | None:
    """What the weights to send change of the received model's form, in one phrase, or None: names it does not
    have, shapes, and integers where it holds floats (int8 sent, say: no readout here reads them as the server
    will). A weight left out of what is sent changes nothing (a partial update)."""
    extra = sorted(set(sent) - set(received))
    changed_shape = [
        f"{name} (shape {tuple(sent[name].shape)})"
        for name in received
        if name in sent and sent[name].shape != received[name].shape
    ]
    not_float = [
        f"{name} (sent as {str(sent[name].dtype).removeprefix('torch.')})"
        for name in received
        if name in sent and received[name].is_floating_point() and not sent[name].is_floating_point()
    ]
    changed = extra + changed_shape + not_float
    return f"the update changes {', '.join(changed[:3])}" if changed else None


def _state(what: str, weights) -> dict:
    """The weights as {name: values}: a state dict as it is, a model's own state dict; anything else is refused with
    one line."""
    if isinstance(weights, nn.Module):
        return weights.state_dict()
    if isinstance(weights, dict) or hasattr(weights, "items"):
        return dict(weights.items())
    raise UsageError(
        f"the guard was given the {what} weights as {type(weights).__name__}",
        "give a state dict ({name: tensor}, as model.state_dict() returns it)",
    )


def _with_values(what: str, value, keep_device: bool = False) -> torch.Tensor:
    """``value`` as a tensor, on the CPU unless ``keep_device`` (arrays and lists taken as they are, a list of
    tensors stacked); one that is not numbers, or holds no values (on the meta device), is refused with one line."""
    if value is None:
        raise UsageError(f"the guard was given no {what}", f"give the {what} as a tensor or an array")
    try:
        if isinstance(value, (list, tuple)) and value and all(isinstance(item, torch.Tensor) for item in value):
            tensor = torch.stack([item.detach() for item in value])
        else:
            tensor = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise UsageError(
            f"the guard was given {what} it cannot read as numbers ({error_line(exc)})",
            "give a tensor or a numeric array, batch first",
        ) from None
    if tensor.device.type == "meta":
        raise UsageError(f"the guard was given {what} on the meta device (no values)", "give it real tensors or arrays")
    return tensor if keep_device else tensor.detach().cpu()


def log_record(decision: GuardDecision) -> dict:
    """The one JSON line a decision logs: action, samples read and at what PSNR, the layers they were read in,
    seconds."""
    return {
        "round": decision.round,
        "action": decision.action,
        "exact_samples": decision.exact_samples,
        "psnr": {str(sample): decision.psnr[sample] for sample in decision.exact_samples},
        "layers": sorted({readout.layer for readout in decision.readouts if readout.leaks}),
        "samples": decision.samples,
        "seconds": round(decision.seconds, 4),
        "reasons": decision.reasons + decision.notes,
    }
