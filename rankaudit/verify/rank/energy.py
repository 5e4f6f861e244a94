"""Spec §15, measured: each sample's hidden energy at the weights that are sent, judged on the energy levels.

The certificate (h_cert, for any weights) is the analysis'; this is the measurement at given weights (the seeded
initialisation or --weights). Two readings join the rank check's record under ``energy``:

- **The measured level.** The worst sample's hidden share h_min on spec §15's thresholds (levels.energy_level). The
  check never confirms a level the measurement does not support: a per-sample verdict of `protected` (or `partial`)
  is confirmed only when the worst measured sample hides at least that level's share; otherwise the judgement says
  that these weights show more than the level allows. A measured level above the verdict is no disagreement: the
  verdict covers a server that picks the weights, the measurement only the weights it ran at.
- **The certificate's consistency.** For every weight value the expected hidden share of a sample is at least
  h_cert (Ky Fan, first order). The mean of the measured h_i estimates that expectation from the samples used, so
  the rule is one-sided at three standard errors: the run is inconsistent when mean + 3·stderr < h_cert
  (stderr = sample standard deviation / √n). Then the certificate, not the measurement, is in doubt: an internal
  error, as a rank above its bound is. With one measured sample there is no standard error and no check; the record
  says so.
"""

from __future__ import annotations

import math

from rankaudit.settings.levels import DEFAULT_EXPOSED_BELOW, VERDICT_LEVELS, ceiling, energy_level, percent

# Spec §15: the mean measured hidden share may fall below h_cert by at most this many standard errors.
CONSISTENCY_STANDARD_ERRORS = 3.0
CONSISTENCY_RULE = (
    "the mean measured hidden share + 3 standard errors must reach the certified share "
    "(one-sided, over the samples measured)"
)


def _certified(result) -> float | None:
    identifiability = getattr(result, "identifiability", None)
    sample = getattr(identifiability, "sample", None) if identifiability is not None else None
    return getattr(sample, "certified_hidden_energy", None) if sample is not None else None


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
    consistent = None
    if certified is not None and stderr is not None:
        consistent = mean + CONSISTENCY_STANDARD_ERRORS * stderr >= certified
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
        "consistent": consistent,
        "consistency_rule": CONSISTENCY_RULE,
        "line": line,
    }
    if certified is not None and stderr is None:
        energy["consistency_note"] = "one sample measured: no standard error, the certified share is not checked"
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
        error = (
            f"internal error: the mean measured hidden share {percent(mean)} (± {percent(stderr)} standard error, "
            f"{len(shares)} samples) is below the certified {percent(certified)} by more than "
            f"{CONSISTENCY_STANDARD_ERRORS:g} standard errors: the energy certificate is wrong for this model; "
            "please report it with this model file"
        )
        verification["internal_error"] = "; ".join(e for e in (verification.get("internal_error"), error) if e)
