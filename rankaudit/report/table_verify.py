"""The text table's --verify sections: each attack's and check's measured lines, and the defenses compared."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from rankaudit.findings.meaning import energy_percent
from rankaudit.report import records
from rankaudit.result import Result
from rankaudit.settings.levels import count, percent


def _number(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _baseline_lines(attack: dict) -> list[str]:
    """The input attack's PSNR beside what a guess that reads no gradient scores, and its best image."""
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


def _rgap_lines(rgap: dict) -> list[str]:
    """--verify rgap: R-GAP, inverting gradients or the FedAvg inversion, per layer and per image."""
    name = {"rgap": "R-GAP", "fedavg-inversion": "FedAvg inversion"}.get(rgap["attack"], "inverting gradients")
    lines = [
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
    return lines


def _gdbr_lines(gdbr: dict) -> list[str]:
    """--verify gdbr: the label counts recovered from one layer's gradient beside an equal-count guess."""
    return [
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


def _generic_lines(name: str, record) -> list[str]:
    """A verifier with no section here (one registered after this file was written): its record's plain fields."""
    shown = records.read(name, record)
    about = f": {shown.help}" if shown.help else ""
    lines = ["", f"Verification (--verify {name}){about}"]
    if shown.judgement:
        lines.append(f"  {shown.judgement}.")
    if shown.internal_error:
        lines.append(f"  {shown.internal_error}")
    lines += [f"  {key}: {value}" for key, value in shown.fields]
    lines += [f"  {note}." for note in shown.notes]
    if shown.json_only:
        lines.append(f"  in the JSON only: {', '.join(shown.json_only)}")
    return lines


def verification_lines(result: Result) -> list[str]:
    """Each --verify section the run measured, in SECTIONS' order, then any other verifier's record."""
    lines = []
    for name, section in SECTIONS.items():
        record = result.verification.get(name)
        if record:
            lines += section(record)
    for name in records.without_section(result.verification, SECTIONS):
        lines += _generic_lines(name, result.verification[name])
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


def _fisher_lines(fisher: dict | None) -> list[str]:
    """--verify fisher: each sample's MSE floor and PSNR ceiling for unbiased reconstructions and for the attacker
    who fills what the update cannot see with the reference mean, and the least σ for each."""
    if not fisher:
        return []
    worst = fisher["worst"]
    lines = [
        "",
        f"Verification (Fisher information under the DP noise, {count(len(fisher['samples']), 'sample')}, "
        f"{fisher['device']}, {fisher['seconds']:.1f} s): at σ {fisher['noise_multiplier']:g} an unbiased "
        f"reconstruction's per-coordinate MSE is at least {_floor(fisher['median_mse_floor'])} (median; worst "
        f"sample {worst['index']}: {_floor(worst['mse_floor'])}), its PSNR at most "
        f"{_ceiling(fisher['median_psnr_ceiling'])} (worst {_ceiling(worst['psnr_ceiling'])}); the least σ keeping "
        f"every sample's PSNR ceiling at or below {fisher['psnr_target']:g} dB: {fisher['least_noise']:.3g}.",
    ]
    prior = fisher.get("worst_prior")
    if prior is not None:
        lines.append(
            f"  With the reference mean filling what the update cannot see: MSE at least "
            f"{_floor(fisher['median_prior_mse_floor'])} (median; worst sample {prior['index']}: "
            f"{_floor(prior['prior_mse_floor'])}), PSNR at most {_prior_ceiling(fisher['median_prior_psnr_ceiling'])} "
            f"(worst {_prior_ceiling(prior['prior_psnr_ceiling'])}); the least σ keeping {fisher['psnr_target']:g} dB: "
            f"{fisher['least_noise_with_prior']:.3g}."
        )
    lines += [
        f"  covers: {fisher['covers']}",
        f"  {fisher['estimator']}; {fisher['weights']}",
        "  sample  label        dFIL  MSE floor  PSNR ceiling  rel. SE" + ("   rank  with prior" if prior else ""),
    ]
    for number, sample in enumerate(fisher["samples"]):
        row = (
            f"  {number:>6}  {sample['label']:>5}  {sample['dfil']:>10.3g}  {_floor(sample['mse_floor']):>9}  "
            f"{_ceiling(sample['psnr_ceiling']):>12}  "
            + ("  exact" if sample.get("exact") else f"{sample['relative_se']:>7.1%}")
        )
        if prior is not None:
            rank = f"{sample['rank']}" + ("" if sample["rank_exact"] else "+")
            row += f"  {rank:>5}  {_prior_ceiling(sample['prior_psnr_ceiling']):>10}"
        lines.append(row)
    return lines + [f"  {note}" for note in fisher["notes"]]


def _floor(value: float | None) -> str:
    return "infinite" if value is None else f"{value:.3g}"


def _ceiling(value: float | None) -> str:
    # None: no unbiased reconstruction exists (the update carries no information about the sample)
    return "none" if value is None else f"{value:.1f} dB"


def _prior_ceiling(value: float | None) -> str:
    # None: the error can be zero (a sample equal to the reference mean, about which the update says nothing)
    return "unbounded" if value is None else f"{value:.1f} dB"


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
    """method.md: each sample, measured: each sample's rank(J_i) against R_s, and the worst sample first."""
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
        if rank.get("rank") == 0:  # an empty gradient: no visible-part figure
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


def _energy_lines(rank: dict) -> list[str]:
    """method.md: energy, measured: the worst sample's hidden energy at the weights used, on the energy levels, and the
    certified share the mean must reach."""
    energy = rank.get("energy")
    if not energy:
        return []
    line = f"  {energy['line']}"
    certified, expected = energy.get("certified_hidden_energy"), energy.get("expected_hidden_energy")
    readings = []
    if certified is not None and energy.get("below_certified") is not None:
        readings.append(
            f"{energy['below_certified']} of {energy['samples']} under the certified {energy_percent(certified)} "
            f"(which {percent(energy.get('certificate_quantile') or 0.9)} of samples keep)"
        )
    if expected is not None and energy.get("stderr") is not None:
        readings.append(
            f"mean {percent(energy['mean_hidden_energy'])} ± {percent(energy['stderr'])} against the expected "
            f"{percent(expected)}"
        )
    if readings:
        line += "; " + ", ".join(readings) + ("" if energy.get("consistent") is not False else " (inconsistent)")
    return [line]


def _hidden_lines(rank: dict) -> list[str]:
    """method.md: verdicts, measured: the median hidden energy and what the visible part looks like, in one line."""
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
    """Which arithmetic settled the rank: float32 only when it showed full rank with a margin."""
    used = set(rank.get("precisions") or [rank.get("precision")]) - {None}
    return f" in {' and '.join(sorted(used))}" if used else ""


def _partial_rank_lines(rank: dict) -> list[str]:
    """--verify rank stopped before the exact answer (matrix-free): the rank from below, the hidden share from above."""
    samples = rank["samples"]
    hidden = rank.get("hidden_share_at_most")
    shown = "" if hidden is None else f"; each sample hides at most {percent(hidden)} of its energy"
    lines = [
        "",
        f"Rank check (∂g/∂x, {count(len(samples), 'image')}, matrix-free, stopped: {rank['stopped_because']}): "
        f"rank ≥ {rank['rank_at_least']} / {rank['unknowns']} unknowns{shown}, {rank['seconds']:.1f} s on "
        f"{rank.get('device', 'n/a')}: {rank['agreement']}.",
    ]
    if rank.get("internal_error"):
        lines.append(f"  {rank['internal_error']}")
    if len(samples) > 1:
        lines.append(
            "  per image: "
            + ", ".join(
                f"rank {'' if s['exact'] else '≥ '}{s['rank_at_least']}"
                + ("" if s["hidden_share_at_most"] is None else f", hidden ≤ {percent(s['hidden_share_at_most'])}")
                for s in samples
            )
        )
    return lines


def _rank_lines(rank: dict | None) -> list[str]:
    """--verify rank: one line, and a line for each warning that applies."""
    if not rank:
        return []
    if rank.get("exact") is False:
        return _partial_rank_lines(rank)
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
    lines.extend(_energy_lines(rank))
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


# Each verifier's own section, in the order the table prints them (the bias readout first: rgap runs it first).
SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "bias": _bias_lines,
    "rgap": _rgap_lines,
    "gdbr": _gdbr_lines,
    "rank": _rank_lines,
    "fisher": _fisher_lines,
    "dager": _dager_lines,
    "dp": _dp_attack_lines,
}


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


def defense_lines(result: Result) -> list[str]:
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
