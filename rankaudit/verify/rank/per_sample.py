"""method.md: each sample, measured: each sample's rank(J_i) against the per-sample bound R_s, and the worst sample first.

The rank check sketches J over all of a batch's (or round's) unknowns; sample i's column block of that sketch is
R·J_i (rankaudit.verify.rank.jacobian.sample_ranks), so rank(J_i) comes free. A rank above R_s means the static per-sample
bound is wrong: an internal error. The hidden energy h_i of each sample (method.md: verdicts, with all samples unknown) is
ordered worst first, and the judgement reads the worst sample: the one the update sees most of.
"""

from __future__ import annotations

# method.md: each sample: "how many samples hide less than 1 % of their energy".
SMALL_HIDDEN_SHARE = 0.01


def _sample_bound(result):
    identifiability = result.identifiability
    return getattr(identifiability, "sample", None) if identifiability is not None else None


def sample_reading(result, ranks: list[int], inputs: list[dict], unknowns: int, *, what: str = "gradient") -> dict:
    """The JSON keys the rank check adds: per_sample_rank, sample_bound, worst, worst_first,
    hiding_under_1_percent, sample_level, and the worst sample's confirms / agreement / judgement.

    ``ranks``: rank(J_i) per sample in order; ``inputs``: the hidden-energy entries of the same samples (index,
    hidden_energy, visible_psnr, visible_ssim); ``unknowns``: |x|; ``what``: "gradient" or "update"."""
    bound = _sample_bound(result)
    check = None
    if bound is not None:
        above = [(i, r) for i, r in enumerate(ranks) if r > bound.rank_bound]
        check = {
            "rank_bound": int(bound.rank_bound),
            "unknowns": int(bound.unknowns),
            "consistent": not above,
            "internal_error": None,
        }
        if above:
            index, value = max(above, key=lambda pair: pair[1])
            check["internal_error"] = (
                f"internal error: sample {index}'s measured rank {value} exceeds the per-sample upper bound "
                f"R_s = {bound.rank_bound}: the static bound is wrong for this model; please report it "
                "with this model file"
            )
    entries = [
        {
            "index": entry["index"],
            "rank": ranks[position] if position < len(ranks) else None,
            "hidden_energy": entry.get("hidden_energy"),
            "visible_psnr": entry.get("visible_psnr"),
            "visible_ssim": entry.get("visible_ssim"),
        }
        for position, entry in enumerate(inputs)
    ]
    measured = [e for e in entries if e["hidden_energy"] is not None]
    worst_first = sorted(measured, key=lambda e: e["hidden_energy"]) + [
        e for e in entries if e["hidden_energy"] is None
    ]

    def hidden(position: int) -> float:
        value = entries[position]["hidden_energy"] if position < len(entries) else None
        return 1.0 if value is None else value

    # The sample the update sees most of: the largest rank(J_i), ties to the least hidden energy.
    by_rank = max(range(len(ranks)), key=lambda i: (ranks[i], -hidden(i))) if ranks else None
    worst = worst_first[0] if measured else (entries[by_rank] if by_rank is not None and entries else None)
    small = sum(1 for e in measured if e["hidden_energy"] < SMALL_HIDDEN_SHARE)
    level = bound.level if bound is not None else result.verdict
    confirms, agreement, judgement = judge_worst(level, ranks, unknowns, worst, len(measured), small, what, by_rank)
    return {
        "per_sample_rank": list(ranks),
        "sample_bound": check,
        "worst": worst,
        "worst_first": worst_first,
        "worst_by_rank": by_rank,
        "hiding_under_1_percent": small if measured else None,
        "sample_level": level,
        "sample_confirms": confirms,
        "sample_agreement": agreement,
        "sample_judgement": judgement,
    }


def _percent(share: float) -> str:
    return f"{100 * share:.1f} %" if share >= 0.001 or share == 0 else f"{100 * share:.2g} %"


def judge_worst(
    level: str, ranks: list[int], unknowns: int, worst: dict | None, measured: int, small: int, what: str, top: int
) -> tuple[bool | None, str, str]:
    """(confirms, agreement, judgement) of the per-sample verdict against the worst sample.

    Full rank of some sample's J_i agrees with `exposed`; a deficit in every sample with `partial` and `protected`,
    except that `protected` disagrees when the worst sample still hides under 1 % of its energy (method.md: verdicts: a
    deficit that hides almost nothing is no protection)."""
    one = "one gradient" if what == "gradient" else "the update"
    deficit = unknowns - ranks[top]
    measured_text = (
        f"{one} determines the input of sample {top} (rank(J_i) {ranks[top]} of {unknowns})"
        if deficit == 0
        else f"every sample keeps at least {deficit} invisible directions (largest rank(J_i) {ranks[top]} "
        f"of {unknowns})"
    )
    hidden = ""
    if worst is not None and worst.get("hidden_energy") is not None:
        psnr = worst.get("visible_psnr")
        shown = "identical to it" if psnr is None else f"{psnr:.1f} dB"
        ssim = worst.get("visible_ssim")
        visible = (
            "nothing visible (rank 0)"
            if max(ranks) == 0
            # an empty gradient
            else f"visible part {shown}" + (f", SSIM {ssim:.3f}" if ssim is not None else "")
        )
        hidden = (
            f"; the worst sample ({worst['index']}) hides {_percent(worst['hidden_energy'])} of its energy "
            f"({visible}), "
            f"{small} of {measured} sample{'s' if measured != 1 else ''} hide under 1 %"
        )
    if level not in ("exposed", "partial", "protected"):
        return (
            None,
            f"no verdict to compare with ({measured_text})",
            f"no verdict to compare with ({level or 'none'}): {measured_text}{hidden}",
        )
    if level == "exposed" and deficit:
        # as measurement.judge: the level reads energy, so a deficit of directions leaves it to the energy line
        return (
            None,
            f"consistent with exposed ({measured_text}; the energy line judges what they hide)",
            f"consistent with exposed (each sample): {measured_text}{hidden}",
        )
    confirms = (deficit == 0) == (level == "exposed")
    if (
        confirms
        and level == "protected"
        and worst is not None
        and (worst.get("hidden_energy") or 0) < SMALL_HIDDEN_SHARE
        and worst.get("hidden_energy") is not None
    ):
        confirms = False
        return (
            False,
            f"disagrees with protected (sample {worst['index']} hides {_percent(worst['hidden_energy'])})",
            (f"disagrees: the per-sample verdict is protected, but {measured_text}{hidden}"),
        )
    if confirms:
        return True, f"confirms {level} ({measured_text})", f"confirms {level} (each sample): {measured_text}{hidden}"
    return (
        False,
        f"disagrees with {level} ({measured_text})",
        f"disagrees: the per-sample verdict is {level}, but {measured_text}{hidden}",
    )
