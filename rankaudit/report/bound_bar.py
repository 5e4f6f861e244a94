"""The identifiability bound as bars for the HTML report: a sample's detail, which the verdict reads, above
the count of input directions (inline SVG)."""

from __future__ import annotations

from rankaudit.findings.meaning import energy_percent, per_sample_view, samples_like_yours, visible_percent
from rankaudit.report.svg import GRID, INK, WARN, _f, _svg_open, fmt_int, x
from rankaudit.result import Result
from rankaudit.settings.levels import percent

HIDDEN = "#15803d"  # what no weights can make visible
# The direction count drawn paler than the energy: many hidden directions can hold little of a sample.
SEEN_PALE, HIDDEN_PALE = "#fdba74", "#bbf7d0"


def _share_bar(
    out: list, top: float, width: float, caption: str, shown: float, tips: tuple[str, str], labels, pale=False
) -> None:
    """One labelled bar: its caption above, the part a server may see (WARN) then the hidden part (HIDDEN)."""
    seen_colour, hidden_colour = (SEEN_PALE, HIDDEN_PALE) if pale else (WARN, HIDDEN)
    bar_h = 22
    out.append(f'<text x="0" y="{_f(top + 12)}" font-size="12" font-weight="600" fill="{INK}">{x(caption)}</text>')
    bar_y = top + 18
    out.append(f'<rect x="0" y="{_f(bar_y)}" width="{width}" height="{bar_h}" rx="4" fill="{GRID}"/>')
    seen = width * min(max(shown, 0.0), 1.0)
    out.append(
        f'<rect x="0" y="{_f(bar_y)}" width="{_f(seen)}" height="{bar_h}" rx="4" fill="{seen_colour}">'
        f"<title>{x(tips[0])}</title></rect>"
    )
    if seen < width:
        out.append(
            f'<rect x="{_f(seen)}" y="{_f(bar_y)}" width="{_f(width - seen)}" height="{bar_h}" '
            f'fill="{hidden_colour}"><title>{x(tips[1])}</title></rect>'
        )
    left, right = labels
    out.append(f'<text x="4" y="{_f(bar_y + bar_h + 16)}" font-size="12" fill="{INK}">{x(left)}</text>')
    out.append(
        f'<text x="{width - 4}" y="{_f(bar_y + bar_h + 16)}" font-size="12" text-anchor="end" fill="{INK}">'
        f"{x(right)}</text>"
    )


def bound_bar(result: Result, prefix: str = "b") -> str:
    """The bound in the verdict's currency first: of a sample's detail (for the share of samples the certificate
    speaks for), the part the visible directions may
    show and the part certified hidden from any weights (the level reads it); below, the same bound counted in
    directions: the rank bound R of n unknowns and the certified deficit. Only the second where no energy
    certificate was computed."""
    bound = result.identifiability
    if bound is None or not bound.unknowns:
        return ""
    sample = bound.sample
    hidden = sample.certified_hidden_energy if sample is not None else None
    # Beyond one sample at FedSGD batch 1 the verdict reads each sample's bound: its directions are drawn, and the
    # batch's or round's count, a statement about all samples at once, is a bar of its own, labelled so.
    each = sample is not None and per_sample_view(result)
    width, row = 560, 64
    rows = (2 if hidden is not None else 1) + (1 if each else 0)
    out = [
        _svg_open(
            width,
            row * rows,
            (
                f"each sample: rank bound {sample.rank_bound} of {sample.unknowns}; the {_whole(result)} as a whole: "
                if each
                else ""
            )
            + f"rank bound {bound.rank_bound} of {bound.unknowns} unknowns"
            + (
                f"; {energy_percent(hidden)} of the detail of {samples_like_yours(bound)} certified hidden"
                if hidden is not None
                else ""
            ),
            "bound",
            280,
            grow=2.0,
        )
    ]
    top = 0
    if hidden is not None:
        _share_bar(
            out,
            top,
            width,
            f"Detail of {samples_like_yours(bound)} (what the verdict reads)",
            1 - hidden,
            (
                f"up to {visible_percent(hidden)} of a sample's detail can be visible to a server that picks the weights",
                f"{energy_percent(hidden)} of it is certified hidden from any weights",
            ),
            (f"visible: {visible_percent(hidden)}", f"certified hidden: {energy_percent(hidden)}"),
        )
        top += row
    if each:
        _share_bar(
            out,
            top,
            width,
            "Directions of each sample (its rank bound)",
            sample.rank_bound / sample.unknowns,
            (
                f"up to {sample.rank_bound:,} of a sample's directions the update may determine",
                f"{sample.unknowns - sample.rank_bound:,} of its directions no update sees",
            ),
            (
                f"rank ≤ {fmt_int(sample.rank_bound)} ({percent(sample.recoverable_fraction)})",
                f"certified deficit {fmt_int(sample.unknowns - sample.rank_bound)} of {fmt_int(sample.unknowns)}",
            ),
            pale=hidden is not None,
        )
        top += row
    _share_bar(
        out,
        top,
        width,
        f"The {_whole(result)} as a whole: all its samples at once, no guarantee for any one"
        if each
        else "Input directions (the rank bound)",
        bound.rank_bound / bound.unknowns,
        (
            f"up to {bound.rank_bound:,} input directions the gradient may determine",
            f"{bound.certified_deficit:,} directions no gradient sees",
        ),
        (
            f"rank ≤ {fmt_int(bound.rank_bound)} ({percent(bound.recoverable_fraction)})",
            f"certified deficit {fmt_int(bound.certified_deficit)} of {fmt_int(bound.unknowns)}",
        ),
        pale=hidden is not None or each,
    )
    out.append("</svg>")
    return "".join(out)


def _whole(result: Result) -> str:
    """What the count over all samples is of: the round (local training), else the batch."""
    return "round" if result.round is not None and not result.round.fedsgd else "batch"
