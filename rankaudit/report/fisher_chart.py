"""The Fisher floor against σ for the HTML report's DP card (inline SVG): each measured sample's PSNR ceiling as the
noise grows, the PSNR target, the least σ that keeps every sample under it, and the σ of this run."""

from __future__ import annotations

import math

from rankaudit.report.svg import GRID, INK, MUTED, WARN, _f, _svg_open, x

MEDIAN, SAMPLE = "#2563eb", "#93c5fd"  # the median sample's line, and each measured sample's paler one
USED = "#334155"


def _decades(sigmas: list[float]) -> tuple[int, int]:
    """The σ axis: whole decades around every σ marked, at least two and at most six."""
    low = math.floor(math.log10(min(sigmas))) - 1
    high = math.ceil(math.log10(max(sigmas))) + 1
    if high - low > 6:
        low = high - 6
    return low, max(high, low + 2)


def fisher_chart(line: dict) -> str:
    """PSNR ceiling (dB) over σ on a log axis. dFIL ∝ 1/σ², so each sample's ceiling falls 20 dB per decade of σ
    from its value at the σ measured; a sample its gradient does not depend on (no ceiling) is not drawn."""
    sigma = line.get("noise_multiplier")
    target = line.get("psnr_target")
    least = line.get("least_noise")
    samples = [one["psnr_ceiling"] for one in line.get("samples", []) if one.get("psnr_ceiling") is not None]
    if not sigma or sigma <= 0 or not samples or target is None:
        return ""
    median = line.get("median_psnr_ceiling")
    marked = [sigma] + ([least] if least and least > 0 else [])
    low_exp, high_exp = _decades(marked)

    def ceiling(at_sigma_psnr: float, sigma_at: float) -> float:
        return at_sigma_psnr - 20 * math.log10(sigma_at / sigma)

    values = [ceiling(p, 10.0**e) for p in samples for e in (low_exp, high_exp)] + [target]
    bottom_db, top_db = math.floor(min(values) / 10) * 10, math.ceil(max(values) / 10) * 10
    top_db = max(top_db, bottom_db + 10)
    width, height = 560, 300
    left, right, top, bottom = 56, 16, 14, 46

    def px(value: float) -> float:
        share = (math.log10(value) - low_exp) / (high_exp - low_exp)
        return left + min(max(share, 0.0), 1.0) * (width - left - right)

    def py(db: float) -> float:
        share = (db - bottom_db) / (top_db - bottom_db)
        return top + (1 - min(max(share, 0.0), 1.0)) * (height - top - bottom)

    label = (
        f"Fisher floor: PSNR ceiling of {len(samples)} measured samples over the noise multiplier; "
        f"σ {least:.3g} keeps every one at or below {target:g} dB"
        if least
        else f"Fisher floor: PSNR ceiling of {len(samples)} measured samples over the noise multiplier"
    )
    out = [_svg_open(width, height, label, "fisher", 300, grow=1.5)]
    for exponent in range(low_exp, high_exp + 1):
        at = px(10.0**exponent)
        out.append(
            f'<line x1="{_f(at)}" y1="{top}" x2="{_f(at)}" y2="{height - bottom}" stroke="{GRID}"/>'
            f'<text x="{_f(at)}" y="{height - bottom + 16}" text-anchor="middle" font-size="11" '
            f'fill="{MUTED}">{x(f"{10.0**exponent:g}")}</text>'
        )
    step = 10 if top_db - bottom_db <= 80 else 20
    for db in range(int(bottom_db), int(top_db) + 1, step):
        out.append(
            f'<line x1="{left}" y1="{_f(py(db))}" x2="{width - right}" y2="{_f(py(db))}" stroke="{GRID}"/>'
            f'<text x="{left - 6}" y="{_f(py(db) + 4)}" text-anchor="end" font-size="11" fill="{MUTED}">{db}</text>'
        )
    middle = top + (height - top - bottom) / 2
    out.append(
        f'<text x="{_f(left + (width - left - right) / 2)}" y="{height - 6}" text-anchor="middle" font-size="11" '
        f'fill="{INK}">noise multiplier σ (log scale)</text>'
        f'<text x="14" y="{_f(middle)}" text-anchor="middle" font-size="11" fill="{INK}" '
        f'transform="rotate(-90 14 {_f(middle)})">PSNR ceiling (dB)</text>'
    )
    ends = (10.0**low_exp, 10.0**high_exp)
    for psnr in samples:
        out.append(
            f'<line x1="{_f(px(ends[0]))}" y1="{_f(py(ceiling(psnr, ends[0])))}" x2="{_f(px(ends[1]))}" '
            f'y2="{_f(py(ceiling(psnr, ends[1])))}" stroke="{SAMPLE}" stroke-width="1.5">'
            f"<title>{x(f'a sample: {psnr:.1f} dB at σ {sigma:g}')}</title></line>"
        )
    if median is not None:
        out.append(
            f'<line x1="{_f(px(ends[0]))}" y1="{_f(py(ceiling(median, ends[0])))}" x2="{_f(px(ends[1]))}" '
            f'y2="{_f(py(ceiling(median, ends[1])))}" stroke="{MEDIAN}" stroke-width="2.5">'
            f"<title>{x(f'median: {median:.1f} dB at σ {sigma:g}')}</title></line>"
        )
    out.append(
        f'<line x1="{left}" y1="{_f(py(target))}" x2="{width - right}" y2="{_f(py(target))}" stroke="{WARN}" '
        f'stroke-dasharray="2 3"><title>{x(f"--psnr-target {target:g} dB")}</title></line>'
        f'<text x="{width - right - 4}" y="{_f(py(target) - 5)}" text-anchor="end" font-size="11" '
        f'fill="{WARN}">{x(f"target {target:g} dB")}</text>'
    )
    if least:
        out.append(
            f'<line x1="{_f(px(least))}" y1="{top}" x2="{_f(px(least))}" y2="{height - bottom}" stroke="{WARN}">'
            f"<title>{x(f'σ {least:.3g}: every measured sample at or below {target:g} dB')}</title></line>"
            f'<text x="{_f(px(least) + 4)}" y="{top + 12}" font-size="11" fill="{WARN}">{x(f"σ {least:.3g}")}</text>'
        )
    out.append(
        f'<line x1="{_f(px(sigma))}" y1="{top}" x2="{_f(px(sigma))}" y2="{height - bottom}" stroke="{USED}" '
        f'stroke-dasharray="5 4"><title>{x(f"this run: σ {sigma:g}")}</title></line>'
        f'<text x="{_f(px(sigma) + 4)}" y="{height - bottom - 6}" font-size="11" fill="{USED}">'
        f"{x(f'this run: σ {sigma:g}')}</text>"
    )
    out.append("</svg>")
    return "".join(out)
