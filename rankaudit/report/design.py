"""SuggestReport and model comparisons -> terminal tables and JSON (the design-review commands)."""

from __future__ import annotations

from dataclasses import asdict

from rankaudit import __version__
from rankaudit.bound.energy import NO_REFERENCE
from rankaudit.design.suggest import SuggestReport
from rankaudit.report.json import dumps as strict_json
from rankaudit.report.json import to_dict
from rankaudit.result import Result
from rankaudit.settings.levels import percent


def _shown(value) -> str:
    return "undefined" if value is None else str(value)


def _ra_text(ra_i: int | None, critical_layer: str | None) -> str:
    """R-GAP's index where it has a critical layer; without one (every layer dense) it is undefined, and says why."""
    if ra_i is None:
        return "RA-i undefined (every layer dense)"
    return f"RA-i {ra_i} at {critical_layer}"


def suggest_dict(report: SuggestReport, top: int | None = None) -> dict:
    return {
        "rankaudit_version": __version__,
        "model": report.model,
        "input_shape": list(report.input_shape),
        "batch_size": report.batch_size,
        "ra_i": report.ra_i,
        "critical_layer": report.critical_layer,
        "verdict": report.verdict,
        "unknowns": report.unknowns,
        "rank_bound": report.rank_bound,
        "certified_deficit": report.certified_deficit,
        "certifying_batch": report.certifying_batch,
        "protecting_batch": report.protecting_batch,
        "deficit_withheld": report.deficit_withheld,
        "max_recoverable": report.max_recoverable,
        "recoverable_fraction": report.recoverable_fraction,
        "certifying_withheld": report.certifying_withheld,
        "note": report.note,
        "skipped": report.skipped,
        "token_span_exposed": report.token_span_exposed,
        "tokens_per_batch": report.tokens_per_batch,
        "safe_tokens_per_batch": report.safe_tokens_per_batch,
        "safe_token_batch": report.safe_token_batch,
        "seconds": round(report.seconds, 3),
        "suggestions": [asdict(s) for s in report.suggestions[:top]],
        "round_review": _round_review_dict(report),
        "dp_noise": asdict(report.noise) if report.noise else None,
        "fisher": asdict(report.fisher) if report.fisher else None,
        "sample": asdict(report.sample) if report.sample else None,
        "readout_layers": report.readout_layers,
        "noise_is_the_way": report.noise_is_the_way,
        "spectrum": report.spectrum,
        "exposed_below": report.exposed_below,
        "certificate_quantile": report.certificate_quantile,
        "round_dp": _round_dp_dict(report.round_dp),
        "check_command": report.check_command or f"rankaudit check {report.model}",
        "shared_layers": report.shared_layers,
        "withheld_layers": report.withheld_layers,
    }


def _noise_lines(report: SuggestReport) -> list[str]:
    """suggest with DP options: the least noise multiplier meeting --max-reconstruction, and its ε; with
    --target-epsilon, the least one meeting that ε; each with the Opacus line that trains with it."""
    noise = report.noise
    if noise is None:
        return []
    sources = [f"  q: {noise.sample_rate_source}; T: {noise.steps_source}"] if noise.sample_rate_source else []
    sources += [f"  note: {note}" for note in noise.notes]
    lines = []
    if noise.target is not None:
        setting = (
            f"q {noise.sample_rate:.4g}, T {noise.steps:,}, prior {noise.prior:g}, --max-reconstruction "
            f"{noise.target:g}"
        )
        if noise.noise_multiplier is None:
            lines.append(
                f"DP noise ({setting}): no noise multiplier up to the search's ceiling meets it ({noise.search})."
            )
        else:
            epsilon = "no finite ε" if noise.epsilon is None else f"ε {noise.epsilon:.3g}"
            floor = " (the search's floor: less noise may meet it too)" if noise.at_floor else ""
            lines += [
                f"DP noise ({setting}): the least noise multiplier meeting it is σ = {noise.noise_multiplier:g}"
                f"{floor}, B(κ) {noise.bound:.3g}, {epsilon} at δ {noise.delta:g} ({noise.search}; {noise.accountant}).",
                *_opacus_lines(noise, noise.noise_multiplier),
            ]
    if noise.target_epsilon is not None:
        lines += _epsilon_lines(noise)
    return lines + sources


def _epsilon_lines(noise) -> list[str]:
    """--target-epsilon: the least σ whose ε at δ meets it, what it bounds, and Opacus's own call for that ε."""
    setting = f"q {noise.sample_rate:.4g}, T {noise.steps:,}, δ {noise.delta:g}"
    if noise.epsilon_noise is None:
        return [
            f"Target ε {noise.target_epsilon:g} ({setting}): no noise multiplier up to the search's ceiling meets it."
        ]
    floor = " (the search's floor: less noise may meet it too)" if noise.epsilon_at_floor else ""
    lines = [
        f"Target ε {noise.target_epsilon:g} ({setting}): the least noise multiplier meeting it is σ = "
        f"{noise.epsilon_noise:g}{floor} ({noise.accountant}); it bounds any reconstruction to B(κ) "
        f"{noise.epsilon_noise_bound:.3g} at prior {noise.prior:g}.",
        *_opacus_lines(noise, noise.epsilon_noise),
    ]
    if noise.level == "sample":
        epochs = max(1, round(noise.steps * noise.sample_rate))
        lines.append(
            "  or let Opacus find it: model, optimizer, train_loader = PrivacyEngine().make_private_with_epsilon("
            f"module=model, optimizer=optimizer, data_loader=train_loader, target_epsilon={noise.target_epsilon:g}, "
            f"target_delta={noise.delta:g}, epochs={epochs}, max_grad_norm={float(noise.clip)!r})  "
            f"# epochs = T·q: every local epoch of every server round, one accountant across them"
        )
    return lines


def _opacus_lines(noise, sigma: float) -> list[str]:
    """The line a client training with Opacus pastes (DP-SGD: the unit is a sample, Poisson sampling at q = B/N,
    as rankaudit's accountant reads it); client-level DP has no Opacus call."""
    if noise.level != "sample":
        return [
            f"  client level: clip each client's update to {noise.clip:g} and add Gaussian noise of std σ·C on the "
            "client before it is sent (Opacus adds noise per sample, not per update)"
        ]
    return [
        "  Opacus: model, optimizer, train_loader = PrivacyEngine().make_private(module=model, optimizer=optimizer, "
        f"data_loader=train_loader, noise_multiplier={sigma:g}, max_grad_norm={float(noise.clip)!r})"
    ]


def _fisher_lines(report: SuggestReport) -> list[str]:
    """suggest with DP options: per design, the least σ keeping unbiased reconstructions at or below the PSNR
    target, beside the least σ the reconstruction bound asks for."""
    fisher = report.fisher
    if fisher is None:
        return []
    rero = report.noise.noise_multiplier if report.noise is not None else None
    beside = (
        f"σ {rero:.3g} for the reconstruction bound (any attacker)"
        if rero is not None
        else "give --max-reconstruction for the reconstruction bound's σ (any attacker)"
    )
    lines = [
        f"Fisher floor (clip {fisher.clip:g}, q {fisher.sample_rate:.4g}, T {fisher.steps:,}, {fisher.weights}): "
        f"the least σ keeping every measured sample's PSNR ceiling at or below {fisher.psnr_target:g} dB, for "
        f"attackers who fill what the update cannot see with the mean sample (the designs are ranked by it) and for "
        f"unbiased attackers; {beside}.",
    ]
    rows = [("design", "target", "detail", "least σ, prior", "least σ, unbiased", "PSNR at σ 1, prior", "unbiased")]

    def sigma(value):
        return f"{value:.3g}" if value is not None else "not measured"

    def psnr(value, measured):
        return "-" if not measured else "unbounded" if value is None else f"{value:.1f} dB"

    for one in [fisher.as_is, *fisher.edits]:
        measured = one.least_noise is not None
        rows.append(
            (
                one.edit,
                one.target or "-",
                one.detail or "-",
                sigma(one.least_noise_with_prior) if measured else "not measured",
                sigma(one.least_noise),
                psnr(one.median_prior_psnr_ceiling, measured and one.least_noise_with_prior is not None),
                psnr(one.median_psnr_ceiling, measured).replace("unbounded", "none"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        lines.append(
            "  " + "  ".join(cell.rjust(widths[i]) if i >= 3 else cell.ljust(widths[i]) for i, cell in enumerate(row))
        )
    reasons = sorted({f"{one.edit}: {one.reason}" for one in fisher.edits if one.reason})
    lines += [f"  not measured, {reason}" for reason in reasons]
    lines += [
        f"  {fisher.samples} samples ({fisher.inputs}); {fisher.estimator}; {fisher.seconds:.1f} s."
        + (
            ""
            if fisher.estimator.startswith("exact")
            else f" σ varies as the square root of the estimate: two designs' σ within {_noise_band(fisher):.0%} of "
            "each other are within two standard errors."
        ),
        f"  Covers {fisher.covers}.",
        *[f"  note: {note}" for note in fisher.notes],
        "",
    ]
    return lines


def _noise_band(fisher) -> float:
    """Two standard errors of the ratio of two designs' least σ (each σ ∝ √(estimate): half its relative error)."""
    from rankaudit.design.fisher_review import DESIGN_RELATIVE_SE

    return 2 * (2**0.5) * DESIGN_RELATIVE_SE / 2


def _round_review_dict(report: SuggestReport) -> dict | None:
    review = report.round_review
    if review is None:
        return None
    shown = asdict(review)
    shown["round"] = {
        "local_samples": review.round.samples,
        "batch_size": review.round.batch_size,
        "local_epochs": review.round.local_epochs,
        "steps": review.round.steps,
        "clients": review.round.clients,
    }
    return shown


_KNOB_TEXT = {
    "local-samples": "Smallest local dataset N",
    "local-epochs": "Largest number of local epochs E",
    "clients": "Smallest number of securely aggregated clients C",
}


def _round_lines(report: SuggestReport) -> list[str]:
    """With a round: the N, E and C at which it is protected, each with its bound (method.md: the round)."""
    review = report.round_review
    if review is None:
        return []
    from rankaudit.settings.round import describe

    lines = [
        "",
        f"Round: {describe(review.round)}: each sample: rank bound {review.rank_bound:,} of "
        f"{review.unknowns:,} unknowns, ρ = {percent(review.recoverable_fraction)}, {review.verdict} "
        f"(protected: {_protected_text(report)}); the round as a whole: rank bound "
        f"{review.whole_rank_bound:,} of {review.whole_unknowns:,}, {review.whole_verdict} (no guarantee "
        "for any one sample).",
    ]
    for setting in review.settings:
        head = f"  {_KNOB_TEXT[setting.knob]} for each sample protected: "
        if setting.value is None and not setting.unbounded:
            lines.append(head + f"none ({setting.explanation}).")
        elif setting.unbounded:
            lines.append(head + f"any ({setting.explanation}).")
        else:
            lines.append(
                head + f"{setting.value:,}: rank bound {setting.rank_bound:,} of {setting.unknowns:,}, "
                f"ρ = {percent(setting.recoverable_fraction)} ({setting.explanation})."
            )
    lines.append("  Each knob is moved alone, the others as given.")
    return lines


def _protected_text(report: SuggestReport) -> str:
    """What `protected` asks, as `check` reads it: a hidden share of the energy (directions for token inputs)."""
    if not report.spectrum:
        return f"at most {percent(report.max_recoverable)} of the input's directions recoverable"
    return f"{_samples(report)} keeping at least {percent(1 - report.max_recoverable)} of their detail hidden"


def _certificates(report: SuggestReport) -> list[str]:
    current = lambda batch: " (the current one)" if batch == report.batch_size else ""  # noqa: E731
    ceiling = _protected_text(report)
    protecting = (
        f"{report.protecting_batch}{current(report.protecting_batch)}"
        if report.protecting_batch is not None
        else "none"
    )
    lines = [
        f"The batch as a whole: smallest batch size with a certified deficit: {report.certifying_batch}"
        f"{current(report.certifying_batch)}; smallest protected ({ceiling}): {protecting}. No batch size "
        "protects any one sample: a sample's bound does not depend on it."
    ]
    if report.certifying_withheld is None:
        partial = (
            f" Keeping {', '.join(report.deficit_withheld)} local makes each sample partial."
            if report.deficit_withheld
            else ""
        )
        lines.append(
            f"Withholding gradients: no set of layers that still shares some gradient makes each sample protected "
            f"({ceiling}): what stays shared, parameters used outside layers such as norms included, still shows "
            f"more of a sample.{partial}"
        )
    elif not report.certifying_withheld:
        lines.append("Withholding gradients: none needed, each sample is already protected.")
    else:
        beside = f" beside {', '.join(report.withheld_layers)}" if report.withheld_layers else ""
        lines.append(
            f"Withholding gradients: keeping {', '.join(report.certifying_withheld)} local (or encrypted){beside} "
            f"makes each sample protected ({ceiling}; found greedily: a certificate, not proven the "
            "smallest set)."
        )
    lines.extend(_readout_text(report))
    lines.extend(_token_budget(report))
    if report.spectrum:
        exposed = percent(report.exposed_below) if report.exposed_below is not None else "5 %"
        sample = report.sample
        if report.spectrum == NO_REFERENCE and sample is not None and sample.rank_bound >= sample.unknowns:
            # Nothing of a sample is hidden: no --data could certify a part of it, so the reader is not sent there.
            lines.append(
                "Levels: every direction of a sample reaches the server, so no data, --data included, can show any "
                "of it hidden: only client DP noise bounds what a server reconstructs."
            )
            return lines
        lines.append(
            f"Levels are read on energy, as `rankaudit check` reads them (reference: {report.spectrum}): exposed "
            f"below {exposed} of the detail of {_samples(report)} hidden."
        )
    return lines


def _readout_text(report: SuggestReport) -> list[str]:
    """method.md: each sample: the bias readout, and whether anything but noise can protect a sample."""
    lines = []
    if report.readout_layers:
        lines.append(
            f"Bias readout: {', '.join(report.readout_layers)} can hand a sample over exactly (a unit that "
            "fires for it alone); withholding or removing that bias stops the exact readout (remove-bias "
            "rows above), the per-sample bound says what still stays hidden."
        )
    if report.noise_is_the_way and _client_noise(report):
        dp = report.round_dp
        lines.append(
            "No structural edit protects a sample: no single edit, no set of withheld gradients"
            + (" and no round setting" if report.round_review is not None else "")
            + f" makes each sample protected. The round's own DP noise, added on the client (σ {dp.noise_multiplier:g}, "
            f"clip {dp.clip:g}, each {dp.level}), is what bounds what the server reconstructs of a sample: "
            f"`{report.check_command or 'rankaudit check ' + report.model}` gives its ε and reconstruction bound"
            + (
                "; with --max-reconstruction, the least noise multiplier meeting it is below."
                if report.noise is not None
                else "; add --max-reconstruction P for the least noise multiplier meeting a ceiling."
            )
        )
    elif report.noise_is_the_way:
        noise = report.noise
        least = (
            f"; with the DP options given, the least noise multiplier is σ = {noise.noise_multiplier:g} (below)"
            if noise is not None and noise.noise_multiplier is not None
            else "; give DP options with --max-reconstruction to find the least noise multiplier"
            if noise is None
            else ""
        )
        lines.append(
            "No structural edit protects a sample: no single edit, no set of withheld gradients"
            + (" and no round setting" if report.round_review is not None else "")
            + " makes each sample protected. Noise the client adds (DP-SGD, local DP) is the "
            f"way{least}."
        )
    return lines


def _round_dp_dict(dp) -> dict | None:
    """The round's own DP as suggest kept it: the mechanism, not the accounting `check` does."""
    if dp is None:
        return None
    return {"noise_multiplier": dp.noise_multiplier, "clip": dp.clip, "level": dp.level, "noise_by": dp.noise_by}


def _client_noise(report: SuggestReport) -> bool:
    """The round already carries noise the client adds (DP-SGD, local DP): the noise to keep, not to propose."""
    return report.round_dp is not None and report.round_dp.noise_by == "client"


def _token_budget(report: SuggestReport) -> list[str]:
    """DAGER's span test: the batch x sequence-length budget from which no shared layer passes it."""
    if report.safe_tokens_per_batch is None:
        return []
    per_sequence = -(-report.tokens_per_batch // report.batch_size) if report.tokens_per_batch else None
    now = (
        f"exposed now through {', '.join(report.token_span_exposed)} at B·n = {report.tokens_per_batch}"
        if report.token_span_exposed
        else f"not exposed at B·n = {report.tokens_per_batch}"
    )
    return [
        f"Token set (DAGER's span test): {now}; safe from {report.safe_tokens_per_batch} tokens per shared "
        f"gradient (batch {report.safe_token_batch} at {per_sequence} tokens per sequence), if they give as many distinct "
        "vectors (repeated tokens lower the count)."
    ]


def _samples(report: SuggestReport) -> str:
    """ "90 % of samples like yours": the share of samples the certificate speaks for."""
    return f"{percent(report.certificate_quantile)} of samples like yours"


def _hidden_text(report: SuggestReport) -> str:
    hidden = report.sample.certified_hidden_energy
    if hidden is None:
        return ""
    return f", {_samples(report)} keep {percent(hidden)} of their detail hidden" if hidden > 0 else ", nothing hidden"


def suggest_table(report: SuggestReport, top: int | None = None) -> str:
    sample = (
        f"each sample: rank bound {report.sample.rank_bound:,} of {report.sample.unknowns:,} "
        f"({percent(report.sample.recoverable_fraction)} recoverable{_hidden_text(report)}), "
        f"{report.verdict}; the batch as a whole: "
        if report.sample is not None
        else ""
    )
    lines = [
        f"rankaudit {__version__} suggest  {report.model}  batch {report.batch_size}: {sample}rank bound "
        f"{report.rank_bound:,} of {report.unknowns:,} unknowns "
        f"({percent(report.recoverable_fraction)} recoverable)"
        f"{'' if report.sample is not None else ', ' + report.verdict}; "
        f"{_ra_text(report.ra_i, report.critical_layer)}",
        "",
    ]
    header = ("edit", "target", "detail", "recoverable", "deficit", "RA-i", "critical layer", "Δ params", "verdict")
    cells = [header] + [
        (
            s.edit,
            s.target,
            s.detail,
            percent(s.recoverable_fraction),
            f"{s.certified_deficit:,}",
            _shown(s.ra_i),
            s.critical_layer or "-",
            f"{s.delta_params:+d}",
            s.verdict + (" (crosses)" if s.crosses_verdict else ""),
        )
        for s in report.suggestions[:top]
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        lines.append(
            "  ".join(
                cell.rjust(widths[i]) if i in (3, 4, 5, 7) else cell.ljust(widths[i]) for i, cell in enumerate(row)
            ).rstrip()
        )
    lines += [
        *_round_lines(report),
        "",
        *_certificates(report),
        *_noise_lines(report),
        *_fisher_lines(report),
        f"{len(report.suggestions)} edits re-counted and re-bounded in {report.seconds:.2f} s"
        + (f"; {len(report.skipped)} not applicable (see --format json)" if report.skipped else "")
        + ".",
        report.note,
        f"Exit code 0 whatever the verdict ({report.verdict} here): suggest proposes, it gates nothing; "
        f"`{report.check_command or 'rankaudit check ' + report.model}` gives the policy's exit code.",
    ]
    return "\n".join(lines) + "\n"


def compare_dict(first: Result, second: Result) -> dict:
    return {
        "rankaudit_version": __version__,
        "a": to_dict(first),
        "b": to_dict(second),
        "ra_i_delta": None if first.ra_i is None or second.ra_i is None else second.ra_i - first.ra_i,
        "layers": _matched_layers(first, second),
    }


def _matched_layers(first: Result, second: Result) -> list[dict]:
    rows = {row.name: row for row in second.layers}
    return [
        {
            "name": row.name,
            "a": row.ra_i,
            "b": rows[row.name].ra_i,
            "delta": rows[row.name].ra_i - row.ra_i,
            "a_critical": row.critical,
            "b_critical": rows[row.name].critical,
        }
        for row in first.layers
        if row.name in rows
    ]


def _bound_text(result: Result) -> str:
    bound = result.identifiability
    if bound is None:
        return "no bound"
    from rankaudit.findings.meaning import per_sample_view

    text = (
        f"rank bound {bound.rank_bound:,} of {bound.unknowns:,} (deficit {bound.certified_deficit:,}, "
        f"{percent(bound.recoverable_fraction)} recoverable)"
    )
    if bound.sample is not None and per_sample_view(result):  # method.md: each sample: the verdict is each sample's
        sample = bound.sample
        text = (
            f"each sample: rank bound {sample.rank_bound:,} of {sample.unknowns:,} "
            f"({percent(sample.recoverable_fraction)} recoverable); as a whole: {text}"
        )
    return text


def compare_table(first: Result, second: Result) -> str:
    leak = lambda r: r.label_leakage.risk if r.label_leakage else "n/a"  # noqa: E731
    lines = [
        f"rankaudit {__version__} compare",
        "",
        f"  A  {first.model}: {first.verdict}, {_bound_text(first)}; {_ra_text(first.ra_i, first.critical_layer)}"
        f"; label leakage {leak(first)}, {first.parameters:,} parameters",
        f"  B  {second.model}: {second.verdict}, {_bound_text(second)}; "
        f"{_ra_text(second.ra_i, second.critical_layer)}; label leakage {leak(second)}, "
        f"{second.parameters:,} parameters",
        "",
    ]
    matched = _matched_layers(first, second)
    changed = [m for m in matched if m["delta"] or m["a_critical"] != m["b_critical"]]
    if changed:
        width = max(len(m["name"]) for m in changed)
        lines.append(f"  {'layer'.ljust(width)}  {'RA_i A':>9}  {'RA_i B':>9}  {'Δ':>9}")
        for m in changed:
            marks = ("*" if m["a_critical"] else " ") + ("*" if m["b_critical"] else " ")
            lines.append(f"  {m['name'].ljust(width)}  {m['a']:>9}  {m['b']:>9}  {m['delta']:>+9}  {marks}")
        if any(m["a_critical"] or m["b_critical"] for m in changed):  # the legend only explains a star shown
            lines.append("  (* critical in A, B)")
    else:
        lines.append("  No layer that both models share changed its RA_i.")
    only = sorted({r.name for r in first.layers} ^ {r.name for r in second.layers})
    if only:
        lines.append(f"  Layers in one model only: {', '.join(only)}")
    lines += _compare_fisher_lines(first, second)
    if first.ra_i is not None and second.ra_i is not None:
        lines += [
            "",
            f"RA-i {first.ra_i} -> {second.ra_i} ({second.ra_i - first.ra_i:+d}); verdict "
            f"{first.verdict} -> {second.verdict}. Policy applies to B: "
            + ("pass" if second.policy.passed else "FAIL: " + "; ".join(second.policy.reasons)),
        ]
    return "\n".join(lines) + "\n"


def _compare_fisher_lines(first: Result, second: Result) -> list[str]:
    """compare --dp-noise σ: each design's Fisher floor at the same σ, beside the reconstruction bound (the same for
    both: the architecture does not enter it)."""
    lines_of = [result.verification.get("fisher") for result in (first, second)]
    if not all(lines_of) or first.dp is None:
        return []

    def ceiling(value, none="none"):
        return none if value is None else f"{value:.1f} dB"

    dp = first.dp
    lines = [
        "",
        f"DP noise σ {dp.noise_multiplier:g}, clip {dp.clip:g}, q {dp.sample_rate:.4g}, T {dp.steps:,}: any "
        f"reconstruction succeeds with probability at most B({dp.prior:g}) = {dp.reconstruction_bound:.3g} for "
        + (
            "both designs (the architecture does not enter it)."
            if second.dp is not None and second.dp.reconstruction_bound == dp.reconstruction_bound
            else f"A, {second.dp.reconstruction_bound:.3g} for B."
        ),
        f"Fisher floor at σ {dp.noise_multiplier:g} (unbiased attackers, {lines_of[0]['weights']}):",
    ]
    for mark, line in zip("AB", lines_of):
        worst = line["worst"]
        prior = line.get("worst_prior")
        if prior is not None:
            lines.append(
                f"  {mark}  with the mean filling what the update cannot see: PSNR at most "
                f"{ceiling(line['median_prior_psnr_ceiling'], 'unbounded')} (median), "
                f"{ceiling(prior['prior_psnr_ceiling'], 'unbounded')} (worst); σ "
                f"{line['least_noise_with_prior']:.3g} keeps {line['psnr_target']:g} dB"
            )
        lines.append(
            f"  {mark}  unbiased: PSNR at most {ceiling(line['median_psnr_ceiling'])} (median), "
            f"{ceiling(worst['psnr_ceiling'])} (worst); MSE at least {_floor_text(line['median_mse_floor'])} per "
            f"value; σ {line['least_noise']:.3g} keeps {line['psnr_target']:g} dB"
        )
    for mark, line in zip("AB", lines_of):
        stopped = sum(1 for one in line["samples"] if one.get("rank_exact") is False)
        if stopped:
            lines.append(
                f"  {mark}: the rank check of {stopped} of {len(line['samples'])} samples stopped before the exact "
                "rank; its ceiling with the mean then reads the rank from below and nothing as hidden, higher than "
                "the exact one"
            )
    safer = _safer_design(lines_of)
    if safer:
        lines.append(f"  {safer}")
    lines.append(
        f"  {len(lines_of[0]['samples'])} samples each ({lines_of[0]['inputs']}); {lines_of[0]['estimator']}; "
        f"{sum(line['seconds'] for line in lines_of):.1f} s"
    )
    return lines


def _safer_design(lines_of: list[dict]) -> str:
    """Which design needs less noise against the attacker with a prior (the figure designs are ranked by)."""
    needed = [line.get("least_noise_with_prior") for line in lines_of]
    stopped = any(one.get("rank_exact") is False for line in lines_of for one in line["samples"])
    if None in needed or needed[0] == needed[1] or stopped:
        return ""
    mark = "A" if needed[0] < needed[1] else "B"
    return f"{mark} needs less noise for the same ceiling (σ {min(needed):.3g} against {max(needed):.3g})"


def _floor_text(value) -> str:
    return "infinite" if value is None else f"{value:.3g}"


def render_json(payload: dict) -> str:
    return strict_json(payload)
