"""Result -> a readable terminal table with the critical row marked and the verdict spelled out."""
from __future__ import annotations

from rankaudit import __version__
from rankaudit.result import LayerRow, Result

HEADERS = ("", "layer", "op", "|x|", "|W|", "|z|", "V", "RA_i", "")
RIGHT_ALIGNED = {3, 4, 5, 6, 7}


def _notes(row: LayerRow) -> str:
    notes = []
    if row.critical:
        notes.append("<- critical")
    if row.dense:
        notes.append("dense (always recoverable)")
    if row.folded:
        notes.append("|W| includes " + ", ".join(row.folded))
    return "; ".join(notes)


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


_BLOCK_SUMMARY = {
    "positions": "weights applied at several positions, so ∇a cannot be read off",
    "shared-weights": "a later layer shares weights over positions",
    "widens": "a later layer widens (W Wᵀ singular)",
    "activation": "an activation other than ReLU/LeakyReLU on the way",
    "branch": "a branch or merge on the way",
}


def _label_lines(result: Result) -> list[str]:
    leakage = result.label_leakage
    if leakage is None:
        return []
    leaking = leakage.leaking
    if leaking:
        head = (f"Label leakage: {leakage.risk}. The gradient of any one of {', '.join(leaking)} reveals the "
                "batch's labels (GDBR gradient bridge / iDLG), even with the other layers' gradients withheld.")
    else:
        head = "Label leakage: low. No shared layer's gradient bridges to the logits."
    lines = ["", head]
    blocked: dict[str, list[str]] = {}
    for bridge in leakage.layers:
        if bridge.shared and not bridge.bridge:
            where = "" if bridge.blocked_by == bridge.name else f" (at {bridge.blocked_by})"
            blocked.setdefault(bridge.kind, []).append(bridge.name + where)
    for kind, names in blocked.items():
        lines.append(f"  blocked, {_BLOCK_SUMMARY[kind]}: {', '.join(names)}")
    return lines


def render_one(result: Result) -> str:
    lines = [f"rankaudit {__version__}  {result.model} ({result.model_name})  input {_shape(result.input_shape)}  "
             f"batch {result.batch_size}  traced with {result.tracer}  {result.parameters:,} parameters", ""]
    cells = [HEADERS] + [(">" if row.critical else "", row.name, row.op, f"{row.inputs}", f"{row.weights}",
                          f"{row.outputs}", f"{row.virtual}", f"{row.ra_i}", _notes(row)) for row in result.layers]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADERS))]
    for line in cells:
        padded = [cell.rjust(widths[i]) if i in RIGHT_ALIGNED else cell.ljust(widths[i]) for i, cell in enumerate(line)]
        lines.append("  ".join(padded).rstrip())
    lines.append("")
    meaning = result.meaning[:1].upper() + result.meaning[1:]
    if result.ra_i is None:
        lines.append(f"RA-i undefined (every layer dense): {result.verdict}. {meaning}.")
    else:
        lines.append(f"RA-i {result.ra_i} at {result.critical_layer}: {result.verdict}. {meaning}.")
    lines.extend(_label_lines(result))
    if result.caveats:
        lines.append("")
        lines.append("Caveats:")
        for caveat in result.caveats:
            lines.append(f"  {caveat.code} {caveat.node}: {caveat.message}")
    if result.policy is not None:
        lines.append("")
        if result.policy.passed:
            lines.append(f"Policy: pass (--fail-on {result.policy.fail_on}"
                         + (f", --min-ra {result.policy.min_ra})" if result.policy.min_ra is not None else ")"))
        else:
            lines.append("Policy: FAIL: " + "; ".join(result.policy.reasons))
    return "\n".join(lines) + "\n"


def render(results: list[Result]) -> str:
    return "\n".join(render_one(result) for result in results)
