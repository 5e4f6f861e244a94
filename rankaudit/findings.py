"""Verdict, policy and model-level caveats from the counted Result."""
from __future__ import annotations

from rankaudit.ops import Role
from rankaudit.result import Caveat, LabelLeakage, LayerBridge, PolicyOutcome, Result
from rankaudit.trace import TracedModel

FAIL_ON_CHOICES = ("never", "exposed", "boundary")

MEANING = {
    "exposed": "the gradients over-determine the input of every layer: a server can reconstruct the client's "
               "input completely",
    "boundary": "the critical layer has exactly as many constraints as unknowns: a complete reconstruction is "
                "on the edge of possible",
    "protected": "some layer has more unknowns than constraints: a complete reconstruction is impossible, though "
                 "a partial one may still leak (protected is not the same as private)",
}
ALL_DENSE_MEANING = ("every layer is dense (no weight sharing): each layer's input is recoverable from its own "
                     "gradient, so a server can reconstruct the client's input completely")


def verdict_for(ra_i: int | None) -> str:
    """Spec §4: RA-i < 0 exposed, = 0 boundary, > 0 protected; no non-dense layer at all is exposed."""
    if ra_i is None or ra_i < 0:
        return "exposed"
    return "boundary" if ra_i == 0 else "protected"


def _model_caveats(result: Result, non_injective_ops: list[tuple[str, str | None]],
                   fallback_reason: str | None) -> list[Caveat]:
    caveats = []
    if non_injective_ops:
        names = [name for name, _ in non_injective_ops]
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        caveats.append(Caveat("RA102", names[0], "relu",
                              f"ReLU-like maps ({shown}) are monotonic but not injective: a zero output removes a "
                              "weight constraint, so every count here is an upper bound on what an attacker gets",
                              non_injective_ops[0][1]))
    if fallback_reason:
        caveats.append(Caveat("RA106", result.model_name, "trace",
                              f"traced with torch.export because {fallback_reason}"))
    return caveats


def evaluate_policy(result: Result, fail_on: str = "exposed", min_ra: int | None = None) -> PolicyOutcome:
    """Exit-code policy: fail on a verdict at or below `fail_on`, or on RA-i below `min_ra`."""
    reasons = []
    failing = {"never": (), "exposed": ("exposed",), "boundary": ("exposed", "boundary")}[fail_on]
    if result.verdict in failing:
        reasons.append(f"verdict is {result.verdict} (--fail-on {fail_on})")
    if min_ra is not None and (result.ra_i is None or result.ra_i < min_ra):
        shown = "undefined (every layer dense)" if result.ra_i is None else str(result.ra_i)
        reasons.append(f"RA-i {shown} is below the required minimum {min_ra} (--min-ra)")
    return PolicyOutcome(fail_on=fail_on, min_ra=min_ra, passed=not reasons, reasons=reasons)


def apply_findings(result: Result, traced: TracedModel, *, fail_on: str = "exposed", min_ra: int | None = None,
                   shared_layers: set[str] | None = None) -> Result:
    """Verdict, meaning, model-level caveats, label leakage and the policy outcome, added to `result`."""
    non_injective = [(traced.record(n).name, traced.record(n).source) for n in traced.order
                     if traced.record(n).counting.non_injective]
    result.verdict = verdict_for(result.ra_i)
    result.meaning = ALL_DENSE_MEANING if result.ra_i is None else MEANING[result.verdict]
    meaning = result.meaning[:1].upper() + result.meaning[1:]
    if result.ra_i is None:
        result.summary = f"RA-i undefined (every layer dense): {result.verdict}. {meaning}."
    else:
        result.summary = f"RA-i {result.ra_i} at {result.critical_layer}: {result.verdict}. {meaning}."
    result.caveats = _model_caveats(result, non_injective, traced.fallback_reason) + result.caveats
    result.label_leakage = label_leakage(traced, result, shared_layers)
    result.policy = evaluate_policy(result, fail_on, min_ra)
    return result


# ∇z ⊙ z = ∇a ⊙ a (GDBR Lemma 4) holds for positively homogeneous maps only: ReLU and LeakyReLU.
_BRIDGE_ACTIVATIONS = {"ReLU", "relu", "relu_", "LeakyReLU", "leaky_relu", "leaky_relu_"}
_BRIDGE_SHAPE_FAMILIES = {"reshape"}


def _single_position(traced: TracedModel, node_id: str) -> bool:
    """Weights applied at one position per sample: a Linear on a vector or a conv with a 1x1 output."""
    return traced.record(node_id).counting.dense_candidate


def _input_numel(traced: TracedModel, node_id: str) -> int:
    record = traced.record(node_id)
    return traced.record(record.inputs[0]).output_numel if record.inputs else 0


def _bridge_from(traced: TracedModel, layer_id: str) -> tuple[bool, bool, str | None, str, str]:
    """Walk from a shared layer to the logits; return (bridge, direct, blocked_by, kind, reason)."""
    record = traced.record(layer_id)
    if not _single_position(traced, layer_id):
        return (False, False, record.name, "positions", f"{record.name} applies its weights at several positions, so "
                "⟨∇W, W⟩ mixes them and ∇a of its output cannot be read off (GDBR Eq. 14/17 need one position)")
    outputs = set(traced.output_ids)
    node, passed_layers = layer_id, 0
    while node not in outputs:
        successors = traced.successors.get(node, [])
        if len(successors) != 1:
            return (False, False, traced.record(node).name, "branch",
                    f"the output of {traced.record(node).name} branches: the bridge follows a chain only")
        node = successors[0]
        step = traced.record(node)
        role = step.counting.role
        if role is Role.LAYER:
            if not _single_position(traced, node):
                return (False, False, step.name, "shared-weights", f"{step.name} ({step.op}) shares weights over positions: "
                        "no (W Wᵀ)⁻¹W bridge through it")
            width_in, width_out = _input_numel(traced, node), step.counting.out_features or step.output_numel
            if width_out > width_in:
                return (False, False, step.name, "widens", f"{step.name} widens {width_in} -> {width_out}: W Wᵀ is "
                        "singular, so (W Wᵀ)⁻¹W cannot carry the gradient on")
            passed_layers += 1
        elif role is Role.TRANSPARENT:
            if step.family not in _BRIDGE_SHAPE_FAMILIES and step.op not in _BRIDGE_ACTIVATIONS:
                return (False, False, step.name, "activation", f"{step.name} ({step.op}) lies on the bridge; only ReLU, "
                        "LeakyReLU and reshapes keep ∇z ⊙ z = ∇a ⊙ a")
        else:
            return (False, False, step.name, "branch", f"{step.name} merges two paths: the bridge follows a chain only")
    if passed_layers == 0:
        return (True, True, None, "direct", f"{record.name} produces the logits: the labels follow from the sign of its "
                "gradient (iDLG), no bridge needed")
    return (True, False, None, "bridge", f"a gradient bridge through {passed_layers} full-row-rank layer(s) reaches the "
            "logits: the batch's label counts follow from this gradient alone (GDBR)")


def label_leakage(traced: TracedModel, result: Result, shared: set[str] | None) -> LabelLeakage:
    """Per parametric layer: can its gradient alone reveal the labels? `shared` None means every layer's is sent."""
    bridges = []
    for node_id in traced.order:
        record = traced.record(node_id)
        if record.counting.role is not Role.LAYER or not record.counting.weights:
            continue
        bridge, direct, blocked_by, kind, reason = _bridge_from(traced, node_id)
        is_shared = shared is None or record.name in shared
        bridges.append(LayerBridge(record.name, is_shared, bridge, direct, blocked_by, kind, reason))
    risk = "high" if any(b.shared and b.bridge for b in bridges) else "low"
    return LabelLeakage(risk, bridges)
