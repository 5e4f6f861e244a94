"""Result -> a readable terminal table with the critical row marked and the verdict spelled out."""

from __future__ import annotations

import re

from rankaudit import __version__
from rankaudit.result import LayerRow, Result

HEADERS = ("", "layer", "op", "|x|", "|W|", "|z|", "V", "RA_i", "")
RIGHT_ALIGNED = {3, 4, 5, 6, 7}
VERDICT_COLOR = {"exposed": "31", "partial": "33", "boundary": "33", "protected": "32"}  # ANSI red, yellow, green


def _paint(text: str, code: str, color: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if color and text else text


def _notes(row: LayerRow) -> str:
    notes = []
    if row.critical:
        notes.append("<- critical")
    if row.dense:
        notes.append("dense (always recoverable)")
    if row.side:
        notes.append("side branch (gate or statistic)")
    if row.folded:
        notes.append("|W| includes " + ", ".join(row.folded))
    return "; ".join(notes)


def _conclusion_lines(result: Result, warn: str, color: bool) -> list[str]:
    """The two closing lines: the bound, which gives the verdict, and R-GAP's index, one sentence each."""
    from rankaudit.findings import per_sample_view, ra_sentence, whole_sentence
    from rankaudit.levels import percent

    bound = result.identifiability
    if bound is None:
        return [result.summary]
    verdict = _paint(result.verdict, f"1;{warn}", color)
    cut = ", ".join(bound.bottleneck[:6]) + (" ..." if len(bound.bottleneck) > 6 else "")
    # An empty cut (nothing shared to cut through) is said in words, never printed as "min cut: " (issue 23).
    cut = f"min cut: {cut}" if cut else "no cut: nothing is shared"
    if bound.sample is not None and per_sample_view(result):
        sample = bound.sample
        head = (
            f"Bound (each sample): rank <= {sample.rank_bound:,} of {sample.unknowns:,} unknowns per sample "
            f"({percent(sample.recoverable_fraction)} recoverable; protected needs at most "
            f"{percent(bound.max_recoverable)}): {verdict}. {result.meaning[:1].upper() + result.meaning[1:]}."
        )
        return [head, whole_sentence(result) + f" {cut[:1].upper() + cut[1:]}.", ra_sentence(result)]
    head = (
        f"Bound: rank <= {bound.rank_bound:,} of {bound.unknowns:,} unknowns "
        f"({percent(bound.recoverable_fraction)} recoverable; protected needs at most "
        f"{percent(bound.max_recoverable)}; {cut}): {verdict}. "
        f"{result.meaning[:1].upper() + result.meaning[1:]}."
    )
    return [head, ra_sentence(result)]


def _round_header(result: Result) -> str:
    """The round on the header line; nothing for FedSGD, whose header the batch size already says."""
    from rankaudit.round import describe

    return "" if result.round is None or result.round.fedsgd else f"  {describe(result.round)}"


def _round_lines(result: Result) -> list[str]:
    """The round's three caps (spec §12) and which one binds."""
    bound = result.identifiability
    if bound is None or bound.round is None:
        return []
    from rankaudit.levels import percent

    caps = bound.round
    return [
        f"Round: rank <= min(n = {caps.unknowns:,} unknowns, |θ_s| = {caps.update_values:,} update values, "
        f"Σ_c Σ_k R(B_k) = {caps.steps_bound:,}) = {bound.rank_bound:,}, ρ = {percent(bound.recoverable_fraction)}: "
        f"{caps.explanation}."
    ]


def _readout_lines(result: Result) -> list[str]:
    """Spec §14's static bias readout: each shared layer that can hand a sample over exactly, and the fix."""
    lines = []
    for finding in result.bias_readout:
        lines += ["", f"Sample readout: {finding.message}.", f"  Fix: {finding.fix}."]
    return lines


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(d) for d in shape)


_BLOCK_SUMMARY = {
    "positions": "weights applied at several positions, so ∇a cannot be read off",
    "shared-weights": "a later layer shares weights over positions",
    "widens": "a later layer widens (W Wᵀ singular)",
    "activation": "an activation other than ReLU/LeakyReLU on the way",
    "branch": "a branch or merge on the way",
}


def _label_lines(result: Result, verbose: bool = False) -> list[str]:
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


def _input_text(result: Result) -> str:
    """3x32x32 for one float input; token ids and several inputs say what each one is."""
    if len(result.inputs) <= 1 and all(info.role == "data" for info in result.inputs):
        return _shape(result.input_shape)
    parts = []
    for info in result.inputs:
        what = {"tokens": "token ids", "mask": "mask", "ids": "ids"}.get(info.role, info.dtype)
        name = f"{info.name} " if len(result.inputs) > 1 else ""
        parts.append(f"{name}{_shape(info.shape)} {what} ({info.dtype})")
    return ", ".join(parts)


def _input_rows(result: Result) -> list[tuple[str, ...]]:
    """Token inputs start their unknowns at the embedding: a row that says so, above the counted layers."""
    rows = []
    for info in result.inputs:
        if info.role == "tokens" and info.unknowns_at and info.unknowns:
            rows.append(
                (
                    "",
                    info.unknowns_at,
                    "Embedding",
                    "-",
                    "-",
                    f"{result.batch_size * info.unknowns}",
                    "-",
                    "-",
                    f"input: {info.name} -> unknowns start here",
                )
            )
    return rows


_BUILDS = {
    "meta-parameters": "parameters on the meta device, the constructor's own arithmetic on the CPU",
    "meta": "everything on the meta device (building with CPU arithmetic failed)",
}


def _token_lines(result: Result) -> list[str]:
    tokens = result.token_leakage
    if tokens is None:
        return []
    if tokens.exposed:
        head = f"Token leakage: exposed by the embedding's gradient: {'; '.join(e.reason for e in tokens.embeddings if e.exposed)}."
    else:
        head = f"Token leakage: not through the embedding: {'; '.join(e.reason for e in tokens.embeddings)}."
    return ["", head]


def _span_lines(result: Result) -> list[str]:
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


def _verbose_lines(result: Result) -> list[str]:
    from rankaudit.levels import count

    lines = [
        "",
        f"Traced with {result.tracer} in {result.seconds:.3f} s; {count(len(result.layers), 'counted layer')}, "
        f"{count(len(result.blocks), 'residual block')}.",
    ]
    if result.build in _BUILDS:
        lines.append(f"Built with {_BUILDS[result.build]}.")
    if result.call_notes:
        lines.append(
            f"forward() called with {', '.join(result.call_notes)} (the logits carry the loss; caches "
            "and other outputs are not counted)."
        )
    for block in result.blocks:
        shortcut = ", ".join(block.shortcut_layers) or "identity"
        lines.append(f"  block {block.name}: main {', '.join(block.main_layers)}; shortcut {shortcut} ({block.kind})")
    uncounted = [(row.name, row.reported_params) for row in result.layers if row.reported_params]
    for name, params in uncounted:
        lines.append(f"  {name}: {params} parameters reported, not counted")
    return lines


def _number(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _baseline_lines(attack: dict) -> list[str]:
    """The input attack's PSNR beside what a guess that reads no gradient scores, and its best image (issue 21)."""
    best = attack.get("best") or {}
    lines = [
        f"  baselines (read no gradient): flat grey {_number(attack['grey_psnr_median'])} dB, each image's own "
        f"mean colour {_number(attack['mean_colour_psnr_median'])} dB (medians); "
        f"{attack['recovered_samples']} of {len(attack['samples'])} image(s) beat both: {attack['outcome']}"
    ]
    if best:
        ssim = "" if best.get("ssim") is None else f", SSIM {best['ssim']:.3f}"
        lines.append(
            f"  best image {best['index']}: PSNR {_number(best['psnr'])} dB{ssim} (grey "
            f"{_number(best['grey_psnr'])}, mean colour {_number(best['mean_colour_psnr'])} dB: "
            f"{'recovered' if best['recovered'] else 'failed'}); "
            f"median PSNR {_number(attack['median_psnr'])} dB"
        )
    return lines


def _bias_lines(readout: dict | None) -> list[str]:
    """--verify bias (and the readout --verify rgap runs first): the samples the update hands over exactly."""
    from rankaudit.levels import count

    if not readout:
        return []
    setup = readout.get("setup_seconds") or 0.0
    took = f"{readout['seconds']:.2f} s" + (f" after {setup:.1f} s of torch.func's first use" if setup >= 0.5 else "")
    lines = [
        "",
        f"Bias readout ({readout['batch']}, {readout['device']}, {took}): "
        f"{readout['headline']}; {readout['judgement']}.",
    ]
    if readout.get("internal_error"):
        lines.append(f"  {readout['internal_error']}")
    for layer in readout["layers"]:
        reads = "the input itself" if layer["reads_input"] else "features"
        lines.append(
            f"  {layer['name']} ({layer['op']}, {layer['units']} units, {layer['live_units']} live, reads "
            f"{reads}): {count(len(layer['units_read']), 'unit')} read a sample exactly; "
            f"{layer['units_firing_for_one_sample']} passed a gradient for one sample alone"
        )
    psnrs = [s for s in readout["per_sample"] if s["psnr_measured"]]
    if psnrs:
        shown = ", ".join(f"{s['index']}: {'exact' if s['read_exactly'] else _number(s['psnr'])}" for s in psnrs)
        lines.append(f"  nearest ratio per sample, PSNR dB: {shown}")
    lines += [f"  skipped {entry}" for entry in readout["skipped"]]
    return lines + [f"  {note}" for note in readout["notes"]] + [f"  inputs: {readout['inputs']}"]


def _verification_lines(result: Result) -> list[str]:
    from rankaudit.levels import count

    lines = _bias_lines(result.verification.get("bias"))
    rgap = result.verification.get("rgap")
    if rgap:
        name = {"rgap": "R-GAP", "fedavg-inversion": "FedAvg inversion"}.get(rgap["attack"], "inverting gradients")
        lines += [
            "",
            f"Verification ({name}, {count(len(rgap['samples']), 'image')}, {rgap['device']}, {rgap['seconds']:.1f} s): "
            f"median MSE {_number(rgap['median_mse'])}, median PSNR {_number(rgap['median_psnr'])} dB; "
            f"{rgap['judgement']}.",
        ] + [f"  {note}" for note in rgap.get("notes", [rgap["note"]])]
        if "outcome" in rgap:
            lines += _baseline_lines(rgap)
        if rgap["layers"]:
            lines.append("  layer            unknowns    rank  deficit  residual  condition")
            for layer in rgap["layers"]:
                lines.append(
                    f"  {layer['name']:<15} {layer['unknowns']:>9} {layer['rank']:>7} {layer['local_deficit']:>8}"
                    f"  {_number(layer['residual']):>8}  {_number(layer['condition']):>9}"
                )
        for sample in rgap["samples"]:
            client = f" (client {sample['client']})" if "client" in sample and len(rgap.get("clients", [])) > 1 else ""
            beside = ""
            if "recovered" in sample:
                beside = (
                    f" (grey {_number(sample['grey_psnr'])}, mean colour {_number(sample['mean_colour_psnr'])}"
                    f" dB: {'recovered' if sample['recovered'] else 'failed'})"
                )
            lines.append(
                f"  image {sample['index']}{client}: MSE {_number(sample['mse'])}, PSNR "
                f"{_number(sample['psnr'])} dB{beside}, {sample['seconds']:.2f} s"
            )
        for client in rgap.get("clients", []) if len(rgap.get("clients", [])) > 1 else []:
            lines.append(f"  client {client['client']}: median PSNR {_number(client['median_psnr'])} dB")
    gdbr = result.verification.get("gdbr")
    if gdbr:
        lines += [
            "",
            f"Verification (GDBR from {gdbr['shared_layer']}'s gradient, batch {gdbr['batch_size']}, "
            f"{gdbr['trials']} trials, {gdbr['seconds']:.1f} s): InsAcc {gdbr['ins_acc']:.1%}, "
            f"ClsAcc {gdbr['cls_acc']:.1%} (medians; features from {gdbr['features_from']}).",
            f"  An equal-count guess that reads no gradient scores InsAcc {gdbr['chance_ins_acc']:.1%} on these "
            "batches: "
            + (
                "GDBR beats it."
                if gdbr["beats_chance"]
                else "GDBR does no better, so this run does not show label leakage."
            ),
            f"  recovered {gdbr['recovered']}",
            f"  true      {gdbr['true']}",
        ]
    lines.extend(_rank_lines(result.verification.get("rank")))
    lines.extend(_dager_lines(result.verification.get("dager")))
    lines.extend(_dp_attack_lines(result.verification.get("dp")))
    return lines


def _deployment_lines(result: Result, width: int = 118) -> list[str]:
    """`rankaudit DIR`: each setting read and its source, wrapped; the reader's notes one per line."""
    read = result.deployment
    if read is None:
        return []
    items = [f"{setting} {value} ({source})" for setting, value, source in read.settings]
    lines, line = [], f"Read from the {'Flower app' if read.kind == 'flower' else 'NVFlare job'} {read.root}:"
    for item in items:
        if len(line) + len(item) + 2 > width:
            lines.append(line + ";" if not line.endswith(":") else line)
            line = "  " + item
        else:
            line += (" " if line.endswith(":") else "; ") + item
    lines.append(line)
    return lines + [f"  note: {note}" for note in read.notes]


def _dp_lines(result: Result) -> list[str]:
    """The DP section (spec §13): what the noise bounds, beside (not instead of) the structural verdict."""
    from rankaudit.findings import dp_sentence

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
    return lines


def _dp_attack_lines(attack: dict | None) -> list[str]:
    """--verify dp: the informed attack's success rate beside the bound it must not exceed."""
    if not attack:
        return []
    low, high = attack["interval"]
    where = (
        "at or below the bound"
        if attack["below_bound"]
        else "the interval straddles the bound"
        if not attack["internal_error"]
        else "ABOVE the bound"
    )
    lines = [
        "",
        f"Verification (informed attack on the DP noise, {attack['candidates']} candidates, "
        f"{attack['trials']:,} trials, {attack['device']}, {attack['seconds']:.1f} s): success "
        f"{attack['success_rate']:.3f} (95 % interval [{low:.3f}, {high:.3f}]) against the bound "
        f"B(1/{attack['candidates']}) = {attack['bound']:.3f} and the prior {attack['prior']:.3g}: {where}.",
    ]
    if attack["internal_error"]:
        lines.append(f"  {attack['internal_error']}")
    return lines + [f"  {note}" for note in attack["notes"]]


def _dager_lines(dager: dict | None) -> list[str]:
    """--verify dager: the token set recovered from one layer's gradient, then the decoder's sequences."""
    if not dager:
        return []
    layers = ", ".join(dager.get("layers") or [dager["layer"]])
    lines = [
        "",
        f"Verification (DAGER's span test on the gradient of {layers}, batch {dager['batch_size']} x "
        f"{dager['positions']} tokens, {dager['device']}, {dager['seconds']:.1f} s): rank {dager['rank']} "
        f"of d_in {dager['d_in']}; token precision {dager['token_precision']:.3f}, recall "
        f"{dager['token_recall']:.3f} ({dager['recovered_tokens']} recovered, {dager['true_tokens']} true, "
        f"{dager['candidates_tested']:,} candidates in {dager['span_seconds']:.2f} s); {dager['judgement']}.",
    ]
    extension = dager.get("extension")
    if extension and "seconds" in extension:
        lines.append(
            f"  Decoder: greedy extension with the gradient of {extension['layer']}: "
            f"{extension['exact_sequences']} of {extension['sequences']} sequences recovered exactly "
            f"({extension['note']})."
        )
    elif extension:
        lines.append(f"  Decoder: {extension['note']}.")
    elif not dager["decoder"]:
        lines.append("  Encoder: the token set only (DAGER's search for an encoder's sequences is not implemented).")
    lines += [f"  {note}" for note in dager["notes"]]
    return lines


def _rank_gap(rank: dict) -> str:
    if rank["gap"] is not None:
        return _number(rank["gap"])
    return "n/a" if rank["rank"] == 0 else "inf"  # JSON has no infinity: None stands for it above rank 0


def _worst_sample_lines(rank: dict) -> list[str]:
    """Spec §14, measured: each sample's rank(J_i) against R_s, and the worst sample first."""
    from collections import Counter

    from rankaudit.levels import percent

    lines = []
    ranks = rank.get("per_sample_rank") or []
    bound = rank.get("sample_bound")
    if len(ranks) > 1 or bound:
        counts = ", ".join(
            f"{value} x {count}" if count > 1 else str(value)
            for value, count in sorted(Counter(ranks).items(), reverse=True)
        )
        lines.append(
            f"  each sample: rank(J_i) {counts}"
            + (f" (per-sample bound R_s = {bound['rank_bound']} of {bound['unknowns']})" if bound else "")
        )
    worst = rank.get("worst")
    if worst and worst.get("hidden_energy") is not None:
        psnr, ssim = worst.get("visible_psnr"), worst.get("visible_ssim")
        if rank.get("rank") == 0:  # an empty gradient: no visible-part figure (issue 23)
            shown = "nothing visible (rank 0)"
        else:
            shown = "visible part " + ("∞ dB (nothing hidden)" if psnr is None else f"{psnr:.1f} dB")
            shown += f", SSIM {ssim:.3f}" if ssim is not None else ""
        measured = sum(1 for e in rank.get("worst_first") or [] if e.get("hidden_energy") is not None)
        lines.append(
            f"  worst sample: {worst['index']} hides {percent(worst['hidden_energy'])} of its energy "
            f"({shown}); {rank.get('hiding_under_1_percent')} of {measured} hide under 1 %"
        )
    return lines


def _hidden_lines(rank: dict) -> list[str]:
    """Spec §11, measured: the median hidden energy and what the visible part looks like, in one line."""
    from rankaudit.levels import percent

    inputs = [entry for sample in rank.get("samples", []) for entry in sample.get("inputs", [])]
    if not inputs or rank.get("hidden_energy_median") is None:
        return []
    what = "the images'" if any(entry.get("visible_ssim") is not None for entry in inputs) else "the inputs'"
    psnr = rank.get("visible_psnr_median")
    ssim = rank.get("visible_ssim_median")
    if rank.get("rank") == 0:
        shown = "nothing visible"  # an empty gradient: no figure of an all-zero projection
    else:
        shown = f"visible part {psnr:.1f} dB PSNR" if psnr is not None else "visible part ∞ dB PSNR (nothing hidden)"
        shown += f", SSIM {ssim:.3f}" if ssim is not None else ""
    line = (
        f"  hidden: {percent(rank['hidden_energy_median'])} of {what} energy (median of {len(inputs)}); "
        f"{shown}: {rank.get('visible_reading')} (first order, without an image prior)"
    )
    if len(inputs) > 1:
        line += "; per input: " + ", ".join(
            "n/a" if e.get("hidden_energy") is None else percent(e["hidden_energy"]) for e in inputs
        )
    return [line]


def _rank_precision(rank: dict) -> str:
    """Which arithmetic settled the rank (issue 16): float32 only when it showed full rank with a margin."""
    used = set(rank.get("precisions") or [rank.get("precision")]) - {None}
    return f" in {' and '.join(sorted(used))}" if used else ""


def _rank_lines(rank: dict | None) -> list[str]:
    """--verify rank: one line, and a line for each warning that applies."""
    from rankaudit.levels import count

    if not rank:
        return []
    samples = len(rank["samples"])
    inputs = (
        f"{samples} image{'s' if samples != 1 else ''}"
        if rank["batch_size"] == 1
        else f"one batch of {rank['batch_size']}"
    )
    if rank.get("round"):
        shown = rank["round"]
        inputs = (
            f"∂u/∂X, the update of {count(shown['steps'], 'local step')} over {shown['clients']} x "
            f"{count(shown['local_samples'], 'sample')}"
        )
    else:
        inputs = f"∂g/∂x, {inputs}"
    lines = [
        "",
        f"Rank check ({inputs}): rank {rank['rank']} / {rank['unknowns']} unknowns, "
        f"deficit {rank['deficit']}, gap {_rank_gap(rank)}, "
        f"{rank['seconds']:.1f} s on {rank['device']}{_rank_precision(rank)}: {rank['agreement']}.",
    ]
    lines.extend(_worst_sample_lines(rank))
    lines.extend(_hidden_lines(rank))
    if rank.get("internal_error"):
        lines.append(f"  {rank['internal_error']}")
    if not rank["reliable"]:
        lines.append("  the gap is under 1e3: this rank depends on the tolerance and is not reliable")
    if len({sample["rank"] for sample in rank["samples"]}) > 1:
        lines.append(
            "  ranks per image: "
            + ", ".join(str(sample["rank"]) for sample in rank["samples"])
            + " (the headline is the largest, the generic rank)"
        )
    if rank.get("directions"):
        lines.append(
            f"  {len(rank['directions'])} invisible input directions saved, e.g. "
            f"{rank['directions'][0]['png'] or rank['directions'][0]['npy']}"
        )
    return lines


_ATTACK_NAMES = {"rgap": "R-GAP", "inverting-gradients": "inverting gradients", "gdbr": "GDBR"}


def _defense_value(row: dict, which: str) -> str:
    value = row.get(which)
    if row.get("metric") == "ins_acc":
        return "n/a" if value is None else f"{value:.1%}"
    psnr = row.get(f"psnr_{which}")
    return _number(value) + (f" ({psnr:.0f} dB)" if psnr is not None else "")


def _defense_verdict(row: dict) -> str:
    if not row.get("degrades"):
        return "no"
    if row.get("fails_with") and not row.get("fails_without"):
        return "yes, attack fails"
    return "yes"


def _defense_lines(result: Result) -> list[str]:
    rows = result.verification.get("defenses") or []
    training = result.verification.get("adadefense_training")
    if not rows and not training:
        return []
    lines = []
    if rows:
        lines += [
            "",
            "Defenses (the same attack on the same images/batches, without and with each defense; the attack "
            "sees only what the client shares):",
        ]
        cells = [("defense", "attack", "metric", "without", "with", "degrades?")]
        for row in rows:
            metric = "InsAcc" if row.get("metric") == "ins_acc" else "median MSE (PSNR)"
            cells.append(
                (
                    row.get("label") or row.get("defense", "?"),
                    _ATTACK_NAMES.get(row.get("attack"), str(row.get("attack"))),
                    metric,
                    _defense_value(row, "without"),
                    _defense_value(row, "with"),
                    _defense_verdict(row),
                )
            )
        widths = [max(len(line[i]) for line in cells) for i in range(6)]
        for line in cells:
            lines.append(
                "  "
                + "  ".join(
                    cell.rjust(widths[i]) if i in (3, 4) else cell.ljust(widths[i]) for i, cell in enumerate(line)
                ).rstrip()
            )
        seen = set()
        for row in rows:
            attack = _ATTACK_NAMES.get(row.get("attack"), str(row.get("attack")))
            # Notes about the attack itself are the same in every row of that attack: print them once.
            texts = [f"  {attack}: {note}" for note in row.get("attack_notes") or []]
            texts += [f"  {row.get('label')} vs {attack}: {note}" for note in row.get("notes") or []]
            for text in texts:
                if text not in seen:
                    seen.add(text)
                    lines.append(text)
    if training:
        lines += [
            "",
            f"AdaDefense's cost in training: FedAvg, {training['rounds']} rounds x {training['clients']} "
            f"clients, {training.get('model', 'a small MLP')} on {training.get('data', 'digits')}: test "
            f"accuracy {training['accuracy_without']:.1%} without, {training['accuracy_with']:.1%} with the "
            "stand-in.",
        ]
    return lines


# Past this many layer rows the table hides rows that repeat an earlier row (same name up to its numbers, same op
# and counts): a model of many identical blocks prints its first block and one line for the rest (-v prints all).
MAX_TABLE_ROWS = 40
# Names shown for a group of caveats or a list of layers before "and N more" (-v lists all).
SHOWN_NAMES = 3


def _row_pattern(row: LayerRow) -> tuple:
    """What makes a row worth printing again: its name with the numbers taken out, its op and its counts."""
    return (
        re.sub(r"\d+", "#", row.name),
        row.op,
        row.inputs,
        row.weights,
        row.outputs,
        row.virtual,
        row.ra_i,
        row.dense,
        row.side,
        tuple(re.sub(r"\d+", "#", name) for name in row.folded),
    )


def _visible_rows(result: Result, verbose: bool) -> list[LayerRow | tuple[int, str, str]]:
    """The rows to print: every row, or (past MAX_TABLE_ROWS) the critical row and each first of its pattern, with
    (hidden count, first hidden, last hidden) standing for each run of repeats."""
    if verbose or len(result.layers) <= MAX_TABLE_ROWS:
        return list(result.layers)
    seen, shown, run = set(), [], []

    def close_run():
        # One hidden row would cost the line that says so: print it instead.
        shown.extend(run if len(run) == 1 else [(len(run), run[0].name, run[-1].name)] if run else [])
        run.clear()

    for row in result.layers:
        pattern = _row_pattern(row)
        if pattern in seen and not row.critical:
            run.append(row)
            continue
        seen.add(pattern)
        close_run()
        shown.append(row)
    close_run()
    return shown


def _hidden_rows_text(count: int, first: str, last: str) -> str:
    return (
        f"   ... {count:,} more rows, {first} to {last}, each repeating a row above (the same op and counts, "
        "the name up to its numbers; -v lists every row)"
    )


def _names(names: list[str], verbose: bool) -> str:
    """A list of names, cut to the first SHOWN_NAMES and a count of the rest unless verbose."""
    if verbose or len(names) <= SHOWN_NAMES + 1:
        return ", ".join(names)
    return ", ".join(names[:SHOWN_NAMES]) + f" and {len(names) - SHOWN_NAMES:,} more"


def _caveat_lines(result: Result, verbose: bool) -> list[str]:
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


def render_one(result: Result, color: bool = False, verbose: bool = False) -> str:
    lines = [
        f"rankaudit {__version__}  {result.model} ({result.model_name})  input {_input_text(result)}  "
        f"batch {result.batch_size}  traced with {result.tracer}  {result.parameters:,} parameters"
        + _round_header(result),
        *_deployment_lines(result),
        "",
    ]
    visible = _visible_rows(result, verbose)
    cells = (
        [HEADERS]
        + _input_rows(result)
        + [
            (
                ">" if row.critical else "",
                row.name,
                row.op,
                f"{row.inputs}",
                f"{row.weights}",
                f"{row.outputs}",
                f"{row.virtual}",
                f"{row.ra_i}",
                _notes(row),
            )
            if isinstance(row, LayerRow)
            else row
            for row in visible
        ]
    )
    widths = [max(len(line[i]) for line in cells if len(line) == len(HEADERS)) for i in range(len(HEADERS))]
    warn = VERDICT_COLOR.get(result.verdict, "0")
    for index, line in enumerate(cells):
        if len(line) != len(HEADERS):
            lines.append(_hidden_rows_text(*line))
            continue
        padded = [cell.rjust(widths[i]) if i in RIGHT_ALIGNED else cell.ljust(widths[i]) for i, cell in enumerate(line)]
        text = "  ".join(padded).rstrip()
        if index == 0:
            text = _paint(text, "1", color)
        elif line[0] == ">":
            text = _paint(text, f"1;{warn}", color)
        lines.append(text)
    lines.append("")
    lines.extend(_conclusion_lines(result, warn, color))
    lines.extend(_round_lines(result))
    lines.extend(_readout_lines(result))
    if verbose:
        lines.extend(_verbose_lines(result))
    lines.extend(_label_lines(result, verbose))
    lines.extend(_token_lines(result))
    lines.extend(_span_lines(result))
    lines.extend(_dp_lines(result))
    lines.extend(_verification_lines(result))
    lines.extend(_defense_lines(result))
    lines.extend(_caveat_lines(result, verbose))
    if result.policy is not None:
        lines.append("")
        if result.policy.passed:
            from rankaudit.findings import carried_by_sentence

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
            lines.append("Policy: FAIL: " + "; ".join(result.policy.reasons))
    return "\n".join(lines) + "\n"


def render(results: list[Result], color: bool = False, verbose: bool = False) -> str:
    return "\n".join(render_one(result, color, verbose) for result in results)
