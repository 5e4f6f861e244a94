"""The text table's lines below the rows: the bound and verdict, the round, leakage, DP, caveats and the policy."""

from __future__ import annotations

from rankaudit.findings.meaning import (
    carried_by_sentence,
    dp_sentence,
    energy_sentence,
    per_sample_view,
    ra_sentence,
    whole_sentence,
)
from rankaudit.findings.next_step import next_step
from rankaudit.result import Result
from rankaudit.settings.levels import percent

# Names shown for a group of caveats or a list of layers before "and N more" (-v lists all).
SHOWN_NAMES = 3


def conclusion_lines(result: Result, verdict: str) -> list[str]:
    """The two closing lines: the bound, which gives the verdict, and R-GAP's index, one sentence each. `verdict`
    is the verdict as the table prints it (in colour or not)."""
    bound = result.identifiability
    if bound is None:
        return [result.summary]
    cut = ", ".join(bound.bottleneck[:6]) + (" ..." if len(bound.bottleneck) > 6 else "")
    # An empty cut (nothing shared to cut through) is said in words, never printed as "min cut: ".
    cut = f"min cut: {cut}" if cut else "no cut: nothing is shared"
    if bound.sample is not None and per_sample_view(result):
        sample = bound.sample
        head = (
            f"Bound (each sample): rank <= {sample.rank_bound:,} of {sample.unknowns:,} unknowns per sample "
            f"({percent(sample.recoverable_fraction)} of its directions recoverable): {verdict}. "
            f"{result.meaning[:1].upper() + result.meaning[1:]}."
        )
        lines = [head, energy_sentence(result), whole_sentence(result) + f" {cut[:1].upper() + cut[1:]}."]
        return [line for line in lines if line] + [ra_sentence(result)]
    head = (
        f"Bound: rank <= {bound.rank_bound:,} of {bound.unknowns:,} unknowns "
        f"({percent(bound.recoverable_fraction)} of the directions recoverable; {cut}): {verdict}. "
        f"{result.meaning[:1].upper() + result.meaning[1:]}."
    )
    return [line for line in (head, energy_sentence(result)) if line] + [ra_sentence(result)]


def round_lines(result: Result) -> list[str]:
    """The round's three caps (method.md: the round) and which one binds; what the verdict covers (server rounds, BatchNorm)."""
    bound = result.identifiability
    covers = [f"Covers: {bound.sample.covers}"] if bound is not None and bound.sample and bound.sample.covers else []
    if bound is None or bound.round is None:
        return covers
    caps = bound.round
    return covers + [
        f"Round: rank <= min(n = {caps.unknowns:,} unknowns, |θ_s| = {caps.update_values:,} update values, "
        f"Σ_c Σ_k R(B_k) = {caps.steps_bound:,}) = {bound.rank_bound:,}, ρ = {percent(bound.recoverable_fraction)}: "
        f"{caps.explanation}."
    ]


def readout_lines(result: Result) -> list[str]:
    """The per-sample section's static bias readout: each shared layer that can hand a sample over exactly, and the fix."""
    lines = []
    for finding in result.bias_readout:
        lines += ["", f"Sample readout: {finding.message}.", f"  Fix: {finding.fix}."]
    return lines


_BLOCK_SUMMARY = {
    "positions": "weights applied at several positions, so ∇a cannot be read off",
    "shared-weights": "a later layer shares weights over positions",
    "widens": "a later layer widens (W Wᵀ singular)",
    "activation": "an activation other than ReLU/LeakyReLU on the way",
    "branch": "a branch or merge on the way",
}


def label_lines(result: Result, verbose: bool = False) -> list[str]:
    leakage = result.label_leakage
    if leakage is None:
        return []
    leaking = leakage.leaking
    if leaking:
        head = (
            f"Label leakage: {leakage.risk}. The gradient of any one of {', '.join(leaking)} reveals the "
            "batch's labels (GDBR gradient bridge / iDLG), even with the other layers' gradients withheld."
        )
    else:
        head = "Label leakage: low. No shared layer's gradient bridges to the logits."
    lines = ["", head]
    blocked: dict[str, list[str]] = {}
    for bridge in leakage.layers:
        if bridge.shared and not bridge.bridge:
            where = "" if bridge.blocked_by == bridge.name else f" (at {bridge.blocked_by})"
            blocked.setdefault(bridge.kind, []).append(bridge.name + where)
    for kind, names in blocked.items():
        lines.append(f"  blocked, {_BLOCK_SUMMARY[kind]}: {_names(names, verbose)}")
    return lines


def token_lines(result: Result) -> list[str]:
    tokens = result.token_leakage
    if tokens is None:
        return []
    if tokens.exposed:
        head = f"Token leakage: exposed by the embedding's gradient: {'; '.join(e.reason for e in tokens.embeddings if e.exposed)}."
    else:
        head = f"Token leakage: not through the embedding: {'; '.join(e.reason for e in tokens.embeddings)}."
    return ["", head]


def span_lines(result: Result) -> list[str]:
    tokens = result.token_leakage
    if tokens is None or not tokens.layers:
        return []
    state = "exposed" if tokens.span_exposed else "not exposed"
    lines = ["", f"Token leakage through the layers reading per-token vectors (DAGER's span test): {state}."]
    cells = [("layer", "d_in", "d_out", "B·n", "candidates", "")]
    for layer in tokens.layers:
        status = (
            "exposed"
            if layer.exposed
            else ("frozen" if not layer.trainable else "withheld" if not layer.shared else "safe")
        )
        cells.append(
            (
                layer.name,
                str(layer.d_in),
                str(layer.d_out),
                str(layer.tokens_per_batch),
                f"{layer.candidates:,}",
                status,
            )
        )
    widths = [max(len(row[i]) for row in cells) for i in range(6)]
    for row in cells:
        lines.append(
            "  "
            + "  ".join(
                cell.rjust(widths[i]) if 0 < i < 5 else cell.ljust(widths[i]) for i, cell in enumerate(row)
            ).rstrip()
        )
    exposing = [layer for layer in tokens.layers if layer.exposed]
    if exposing:
        lines.append(f"  {exposing[0].reason}.")
    if tokens.safe_tokens_per_batch is not None:
        lines.append(
            f"  Safe budget: at least {tokens.safe_tokens_per_batch} tokens per shared gradient (batch "
            f"{tokens.safe_batch_size} at {max(layer.positions for layer in tokens.layers)} tokens per sequence), "
            f"and only if they give {tokens.safe_tokens_per_batch} distinct vectors ("
            + (
                "repeated tokens count once"
                if not any(layer.position_dependent for layer in tokens.layers)
                else "a token repeated at the same position counts once"
            )
            + "): from there the exact span test fails on every shared layer; optimisation attacks that "
            "go past the rank condition are not ruled out."
        )
    else:
        lines.append("  No such layer's gradient is sent.")
    return lines


def dp_lines(result: Result) -> list[str]:
    """The DP section (method.md: DP): what the noise bounds, beside (not instead of) the structural verdict."""
    dp = result.dp
    if dp is None:
        return []
    unit = "a sample" if dp.level == "sample" else "a client's update"
    rate = f"q {dp.sample_rate:.4g}" + (f" ({dp.sample_rate_source})" if dp.sample_rate_source else "")
    steps = f"T {dp.steps:,}" + (f" ({dp.steps_source})" if dp.steps_source else "")
    lines = [
        "",
        f"{dp_sentence(dp)}.",
        f"  σ {dp.noise_multiplier:g}, clip {dp.clip:g}; {rate}; {steps}",
        f"  the unit is {unit}; {dp.accountant}, {dp.seconds:.2f} s",
        *(f"  note: {note}" for note in dp.notes),
        "  prior κ      " + "  ".join(f"{key:>7}" for key in dp.bounds),
        "  bound B(κ)   " + "  ".join(f"{value:>7.3g}" for value in dp.bounds.values()),
    ]
    if dp.max_reconstruction is not None:
        verdict = "within" if dp.within_limit else "ABOVE"
        lines.append(
            f"  B({dp.prior:g}) = {dp.reconstruction_bound:.3g}: {verdict} --max-reconstruction "
            f"{dp.max_reconstruction:g}"
        )
    fisher = result.verification.get("fisher")
    if fisher:
        lines += ["  the two lines side by side:", *_two_lines(dp, fisher)]
    return lines


def _two_lines(dp, fisher: dict) -> list[str]:
    """ReRo (any attacker, the gate's line) beside the Fisher floor (unbiased attackers, at the weights measured)."""

    def ceiling(value, none="none"):
        return none if value is None else f"{value:.1f} dB"

    rows = [
        ("line", "covers", "figure"),
        (
            "reconstruction bound",
            "any attacker, any prior, any weights",
            f"B({dp.prior:g}) = {dp.reconstruction_bound:.3g} (the gate's line)",
        ),
        (
            "Fisher floor",
            f"unbiased attackers, {fisher['weights']}",
            f"PSNR at most {ceiling(fisher['median_psnr_ceiling'])} (median), {ceiling(fisher['worst']['psnr_ceiling'])}"
            f" (worst); σ {fisher['least_noise']:.3g} keeps {fisher['psnr_target']:g} dB",
        ),
    ]
    if fisher.get("worst_prior") is not None:
        rows.append(
            (
                "Fisher floor with a prior",
                f"attackers who fill what the update cannot see with the mean, {fisher['weights']}",
                f"PSNR at most {ceiling(fisher['median_prior_psnr_ceiling'], 'unbounded')} (median), "
                f"{ceiling(fisher['worst_prior']['prior_psnr_ceiling'], 'unbounded')} (worst); σ "
                f"{fisher['least_noise_with_prior']:.3g} keeps {fisher['psnr_target']:g} dB",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return [f"    {row[0].ljust(widths[0])}  {row[1].ljust(widths[1])}  {row[2]}" for row in rows]


def _names(names: list[str], verbose: bool) -> str:
    """A list of names, cut to the first SHOWN_NAMES and a count of the rest unless verbose."""
    if verbose or len(names) <= SHOWN_NAMES + 1:
        return ", ".join(names)
    return ", ".join(names[:SHOWN_NAMES]) + f" and {len(names) - SHOWN_NAMES:,} more"


def caveat_lines(result: Result, verbose: bool) -> list[str]:
    """Caveats grouped by rule and op, with a count and the first names (-v: one line each, as found)."""
    if not result.caveats:
        return []
    if verbose:
        return ["", "Caveats:", *(f"  {c.code} {c.node}: {c.message}" for c in result.caveats)]
    groups: dict[tuple[str, str], list] = {}
    for caveat in result.caveats:
        groups.setdefault((caveat.code, caveat.op), []).append(caveat)
    head = (
        "Caveats:"
        if len(groups) == len(result.caveats)
        else f"Caveats ({len(result.caveats):,}, grouped by rule and op; -v lists each):"
    )
    lines = ["", head]
    for (code, _), members in groups.items():
        first = members[0]
        if len(members) == 1:
            lines.append(f"  {code} {first.node}: {first.message}")
            continue
        same = all(member.message.replace(member.node, first.node) == first.message for member in members)
        names = _names([member.node for member in members], verbose)
        lines.append(f"  {code} × {len(members):,} ({names}): {'' if same else 'the first: '}{first.message}")
    return lines


def policy_lines(result: Result) -> list[str]:
    """The last line: the policy passes (with what carries the pass) or fails (with each reason)."""
    if result.policy is None:
        return []
    lines = [""]
    if result.policy.passed:
        carried = carried_by_sentence(result)
        lines.append(
            f"Policy: pass (--fail-on {result.policy.fail_on}"
            + (f", --min-ra {result.policy.min_ra}" if result.policy.min_ra is not None else "")
            + (
                f", --max-recoverable {result.policy.max_recoverable:g}"
                if result.policy.max_recoverable is not None
                else ""
            )
            + ")"
            + (f": {carried}" if carried else "")
        )
    else:
        step = next_step(result)
        lines.append(
            "Policy: FAIL: " + "; ".join(result.policy.reasons) + (f". Next step: `{step.command}`" if step else "")
        )
    return lines


def next_step_lines(result: Result) -> list[str]:
    """Under the header, where a failing run is read first: the command to run next, and why (the policy line at
    the end repeats the command)."""
    step = next_step(result)
    if step is None:
        return []
    return [
        f"Next step ({result.verdict}, the policy fails): {step.command}",
        f"  {step.why[:1].upper()}{step.why[1:]}.",
    ]
