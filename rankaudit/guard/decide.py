"""The guard's decision on one update, and its action: send, block, or send with the offending rows dropped or
noised; one JSON line per decision (docs/guard.md).

The frameworks' adapters (rankaudit.guard.flower, rankaudit.guard.nvflare) and the command (rankaudit.guard.local)
call Guard.decide with the weights the client received, the weights it is about to send, and the samples it trained
on; everything the guard decides is decided here.
"""

from __future__ import annotations

import json
import logging
import math
import time

import torch
from torch import nn

from rankaudit.guard.readout import LayerInputs, architecture_difference, find_readouts, named_like_model
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
    what = "" if readout.reads_input else " (its features)"
    if readout.kind == "ratio":
        how = f"unit {readout.units[0]}'s weight-row update over its bias update"
    else:
        how = f"the difference of neighbouring units {readout.units[0]} and {readout.units[1]} (an imprint readout)"
    return f"{readout.layer}: {how} is sample {readout.sample}{what}, relative error {readout.relative_error:.1e}"


def _reasons(readouts: list[GuardReadout]) -> list[str]:
    best: dict[int, GuardReadout] = {}
    for readout in readouts:
        if readout.sample not in best or readout.relative_error < best[readout.sample].relative_error:
            best[readout.sample] = readout
    ordered = [best[sample] for sample in sorted(best)]
    reasons = [_words(readout) for readout in ordered[:REASONS_SPELLED]]
    if len(ordered) > REASONS_SPELLED:
        reasons.append(f"and {len(ordered) - REASONS_SPELLED} more samples read exactly")
    return reasons


def _altered(
    received: dict[str, torch.Tensor],
    sent: dict[str, torch.Tensor],
    readouts: list[GuardReadout],
    action: str,
    noise_scale: float,
    generator: torch.Generator,
) -> tuple[dict[str, torch.Tensor], set[str]]:
    """``sent`` with each offending unit's weight row and bias entry set back to the received value (drop) or
    given Gaussian noise of ``noise_scale`` times that row's own update norm (noise); every unit of a layer whose
    readout was a sample's features."""
    out = {name: value.detach().clone() for name, value in sent.items()}
    changed = set()
    rows = {(readout.layer, unit) for readout in readouts for unit in readout.units}
    # A deeper layer's features move with every local step, and the check compares with those at the received
    # weights: a later step's readout of that layer can escape it, so such a layer goes as a whole.
    for readout in readouts:
        if not readout.reads_input:
            weight = f"{readout.layer}.weight" if readout.layer else "weight"
            rows |= {(readout.layer, unit) for unit in range(len(sent[weight]))}
    rows = sorted(rows)
    for layer, unit in rows:
        prefix = f"{layer}." if layer else ""
        for name in (f"{prefix}weight", f"{prefix}bias"):
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
        settings = self.settings
        received = {k: torch.as_tensor(v).detach().cpu() for k, v in named_like_model(self.model, received).items()}
        sent = {k: torch.as_tensor(v).detach().cpu() for k, v in named_like_model(self.model, sent).items()}
        base = dict(samples=int(len(samples)), tolerance=settings.tolerance, round=round_number)
        difference = architecture_difference(self.model, received)
        if difference is not None:
            decision = GuardDecision(
                action="block",
                exact_samples=[],
                reasons=[f"the received weights are not the audited model's: {difference}"],
                readouts=[],
                layers_checked=[],
                skipped=[],
                architecture=difference,
                seconds=time.perf_counter() - started,
                **base,
            )
            return self._logged(decision), None
        trainable = [name for name, p in self.model.named_parameters() if p.requires_grad]
        shared = [name for name in trainable if name in sent]
        inputs = LayerInputs(self.model, received, shared)
        readouts, checked, skipped = find_readouts(
            inputs, received, sent, samples, settings.tolerance, check_features=settings.check_features
        )
        energy = None
        if settings.energy_budget > 0 and labels is not None:
            from rankaudit.guard.energy import visible_energy

            energy = visible_energy(
                inputs.net,
                samples,
                labels,
                shared,
                min_hidden=settings.min_hidden,
                budget=settings.energy_budget,
            )
        exact = sorted({readout.sample for readout in readouts})
        reasons = _reasons(readouts)
        low_energy = bool(energy and energy.get("measured") and energy["below"])
        if low_energy:
            reasons.append(
                f"at these weights sample {energy['worst_sample']} hides only {energy['hidden']:.1%} of its energy "
                f"(under {settings.min_hidden:.0%}); {len(energy['below'])} of {len(samples)} samples are under it"
            )
        action, to_send, changed, notes = "send", sent, set(), []
        if settings.energy_budget > 0 and labels is None:
            notes.append("the visible-energy check needs the samples' labels, and none were given: not measured")
        if readouts or low_energy:
            action, to_send = "block", None
            if settings.action != "block" and low_energy:
                notes.append(
                    f"{settings.action} alters rows that read samples; low visible energy is the whole "
                    "update's: blocked"
                )
            elif settings.action != "block":
                action, to_send, changed, altered = self._alter(inputs, received, sent, samples, readouts)
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
            **base,
        )
        return self._logged(decision), to_send

    def _alter(self, inputs, received, sent, samples, readouts):
        """Drop or noise the offending rows, check again, and block what still reads a sample."""
        settings, changed, current, found = self.settings, set(), sent, readouts
        for _ in range(ALTER_PASSES):
            current, touched = _altered(received, current, found, settings.action, settings.noise_scale, self.generator)
            changed |= touched
            found, _, _ = find_readouts(
                inputs, received, current, samples, settings.tolerance, check_features=settings.check_features
            )
            if not found:
                return settings.action, current, changed, []
        return (
            "block",
            None,
            changed,
            [
                f"after {ALTER_PASSES} passes of {settings.action}, {len({r.sample for r in found})} samples were "
                "still read exactly: blocked"
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


def log_record(decision: GuardDecision) -> dict:
    """The one JSON line a decision logs: action, samples read exactly, the layers they were read in, seconds."""
    return {
        "round": decision.round,
        "action": decision.action,
        "exact_samples": decision.exact_samples,
        "layers": sorted({readout.layer for readout in decision.readouts}),
        "samples": decision.samples,
        "seconds": round(decision.seconds, 4),
        "reasons": decision.reasons + decision.notes,
    }
