"""method.md: energy, measured: each sample's hidden energy at the weights that are sent, judged on the energy levels.

The certificate (h_cert, for any weights) is the analysis'; this is the measurement at given weights (the seeded
initialisation or --weights). Two readings join the rank check's record under ``energy``:

- **The measured level.** The worst sample's hidden share h_min on the energy section's thresholds (levels.energy_level). The
  check never confirms a level the measurement does not support: a per-sample verdict of `protected` (or `partial`)
  is confirmed only when the worst measured sample hides at least that level's share; otherwise the judgement says
  that these weights show more than the level allows. A measured level above the verdict is no disagreement: the
  verdict covers a server that picks the weights, the measurement only the weights it ran at.
- **The certificate's consistency.** Two readings, both one-sided. The certificate h says that, for every weight
  value, at least a share q (--certificate-quantile, default 90 %) of samples keep at least h hidden: the count of
  measured samples below h is at most Binomial(n, 1 − q), and the run is inconsistent when a count that high has
  probability under 0.1 % (QUANTILE_SURPRISE). And the expected hidden share (Ky Fan, first order) is a floor for
  the mean: inconsistent when mean + 3·stderr < the expected share (stderr = sample standard deviation / √n; no
  check with one sample). Either way the certificate, not the measurement, is in doubt: an internal error, as a rank
  above its bound is.
"""

from __future__ import annotations

import math

from rankaudit.settings.levels import DEFAULT_EXPOSED_BELOW, VERDICT_LEVELS, ceiling, energy_level, percent

# The mean measured hidden share may fall below the expected share by at most this many standard errors; the count
# of samples below the certified share may be at most this improbable under the certificate's quantile.
CONSISTENCY_STANDARD_ERRORS = 3.0
QUANTILE_SURPRISE = 1e-3
CONSISTENCY_RULE = (
    "no more samples may hide less than the certified share than the certificate's quantile makes likely (a count "
    "with probability under 0.1 % is inconsistent), and the mean measured hidden share + 3 standard errors must "
    "reach the expected share (one-sided, over the samples measured)"
)


def _certified(result) -> float | None:
    identifiability = getattr(result, "identifiability", None)
    sample = getattr(identifiability, "sample", None) if identifiability is not None else None
    return getattr(sample, "certified_hidden_energy", None) if sample is not None else None


def _sample_field(result, name: str):
    identifiability = getattr(result, "identifiability", None)
    sample = getattr(identifiability, "sample", None) if identifiability is not None else None
    return getattr(sample, name, None) if sample is not None else None


def below_is_surprising(below: int, samples: int, quantile: float) -> bool:
    """Whether `below` of `samples` measured samples under the certified share is a count of probability under
    QUANTILE_SURPRISE when each sample falls below it with probability at most 1 − `quantile`."""
    if below <= 0:
        return False
    miss = 1 - quantile
    if miss <= 0:
        return True
    tail = sum(math.comb(samples, k) * miss**k * (1 - miss) ** (samples - k) for k in range(below, samples + 1))
    return tail < QUANTILE_SURPRISE


def _max_recoverable(result) -> float:
    identifiability = getattr(result, "identifiability", None)
    return ceiling(getattr(identifiability, "max_recoverable", None) if identifiability is not None else None)


def mean_and_stderr(values: list[float]) -> tuple[float, float | None]:
    """The mean and its standard error (sample standard deviation / √n); None below two values."""
    mean = sum(values) / len(values)
    if len(values) < 2:
        return mean, None
    variance = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
    return mean, math.sqrt(variance / len(values))


def measured_line(weights_phrase: str, worst: dict) -> str:
    """ "at the weights in ckpt.pt, the worst sample hides 5.3 % (23.4 dB)" """
    psnr = worst.get("visible_psnr")
    if psnr is not None:
        shown = f"{psnr:.1f} dB"
    elif worst["hidden_energy"] >= 1:  # an empty gradient: nothing of any sample is seen
        shown = "nothing seen"
    else:  # no PSNR because nothing differs from the sample
        shown = "nothing hidden: its visible part is the sample"
    return f"{weights_phrase}, the worst sample hides {percent(worst['hidden_energy'])} ({shown})"


def read_energy(verification: dict, result, weights_phrase: str) -> None:
    """Add ``energy`` to the rank check's record, and correct confirms / agreement / judgement / internal_error.

    ``verification`` already holds the worst-sample reading (check.read_worst_sample): ``worst_first`` and
    ``sample_level``. Nothing changes where no sample's hidden energy was measured."""
    measured = [e for e in verification.get("worst_first") or [] if e.get("hidden_energy") is not None]
    if not measured:
        verification["energy"] = None
        return
    worst = min(measured, key=lambda e: e["hidden_energy"])
    max_recoverable = _max_recoverable(result)
    bound = result.identifiability
    exposed_below = bound.exposed_below if bound is not None else DEFAULT_EXPOSED_BELOW
    level = energy_level(worst["hidden_energy"], max_recoverable, exposed_below)
    shares = [e["hidden_energy"] for e in measured]
    mean, stderr = mean_and_stderr(shares)
    certified = _certified(result)
    expected = _sample_field(result, "expected_hidden_energy")
    quantile = getattr(bound, "certificate_quantile", None) or 0.9
    below = sum(1 for share in shares if certified is not None and share < certified)
    mean_holds = None if expected is None or stderr is None else mean + CONSISTENCY_STANDARD_ERRORS * stderr >= expected
    quantile_holds = None if certified is None else not below_is_surprising(below, len(shares), quantile)
    readings = [holds for holds in (mean_holds, quantile_holds) if holds is not None]
    consistent = all(readings) if readings else None
    line = measured_line(weights_phrase, worst) + f": {level} on energy"
    energy = {
        "weights": weights_phrase,
        "worst_index": worst["index"],
        "worst_hidden_energy": worst["hidden_energy"],
        "worst_visible_psnr": worst.get("visible_psnr"),
        "level": level,
        "thresholds": {"exposed_below": exposed_below, "protected_from": 1 - max_recoverable},
        "mean_hidden_energy": mean,
        "stderr": stderr,
        "samples": len(shares),
        "certified_hidden_energy": certified,
        "certificate_quantile": quantile,
        "below_certified": below,
        "expected_hidden_energy": expected,
        "consistent": consistent,
        "consistency_rule": CONSISTENCY_RULE,
        "line": line,
    }
    if expected is not None and stderr is None:
        energy["consistency_note"] = "one sample measured: no standard error, the expected share is not checked"
    verification["energy"] = energy
    verdict_level = verification.get("sample_level")
    if verdict_level == "exposed" and verification.get("confirms") is None:
        # A deficit of directions left the judgement open (measurement.judge): the worst sample settles it. Hiding
        # more at these weights than the certificate promises for any weights contradicts nothing, so it stays open.
        if level == "exposed":
            verification["confirms"] = True
            verification["agreement"] = f"confirms exposed ({line})"
            verification["judgement"] = f"confirms exposed: {line}"
        else:
            verification["agreement"] = f"consistent with exposed ({line}; the verdict covers any weights)"
    if verdict_level in VERDICT_LEVELS and verdict_level != "exposed" and verification.get("confirms"):
        if VERDICT_LEVELS.index(level) < VERDICT_LEVELS.index(verdict_level):
            needed = percent(1 - max_recoverable if verdict_level == "protected" else exposed_below)
            verification["confirms"] = False
            verification["agreement"] = f"does not confirm {verdict_level} ({line})"
            verification["judgement"] = (
                f"does not confirm {verdict_level}: {line}, and {verdict_level} asks that every sample hide "
                f"at least {needed} of its energy"
            )
    if consistent is False:
        if quantile_holds is False:
            why = (
                f"{below} of {len(shares)} measured samples hide less than the certified {percent(certified)}, more "
                f"than {percent(quantile)} of samples keeping it makes likely"
            )
        else:
            why = (
                f"the mean measured hidden share {percent(mean)} (± {percent(stderr)} standard error, "
                f"{len(shares)} samples) is below the expected {percent(expected)} by more than "
                f"{CONSISTENCY_STANDARD_ERRORS:g} standard errors"
            )
        error = (
            f"internal error: {why}: the energy certificate is wrong for this model; please report it with this "
            "model file"
        )
        verification["internal_error"] = "; ".join(e for e in (verification.get("internal_error"), error) if e)
