"""The verdicts section's verdict levels and the --fail-on gates over them (no torch: the CLI names them at startup)."""

from __future__ import annotations

# Weakest protection first, and the default ceiling on the recoverable fraction R/n for `protected`.
VERDICT_LEVELS = ("exposed", "partial", "protected")
DEFAULT_MAX_RECOVERABLE = 0.5
# `exposed` when the certificate keeps less than this share of each sample's detail hidden (--exposed-below).
DEFAULT_EXPOSED_BELOW = 0.05
# --psnr-target: the PSNR (dB) an unbiased reconstruction may reach at most when σ is chosen from the Fisher floor;
# at 20 dB a reconstructed photograph is no longer recognisable (docs/verify/fisher.md).
DEFAULT_PSNR_TARGET = 20.0
# The certificate is read per sample: the hidden share that at least this share of samples like the user's keep
# (--certificate-quantile). docs/method.md, "The certificate, per sample".
DEFAULT_CERTIFICATE_QUANTILE = 0.9

# --fail-on, weakest gate first: never; exposed (fail without a certified deficit: the gate before method.md: verdicts);
# partial, the default (fail unless `protected`); boundary (also unless R-GAP's closed form stops, RA-i > 0).
FAIL_ON_CHOICES = ("never", "exposed", "partial", "boundary")
DEFAULT_FAIL_ON = "partial"
FAILING_VERDICTS = {
    "never": (),
    "exposed": ("exposed",),
    "partial": ("exposed", "partial"),
    "boundary": ("exposed", "partial"),
}


def ceiling(max_recoverable: float | None) -> float:
    """The recoverable-fraction ceiling ρ_max in force: the one given, else the default."""
    return DEFAULT_MAX_RECOVERABLE if max_recoverable is None else max_recoverable


def verdict_level(rank_bound: int, unknowns: int, max_recoverable: float = DEFAULT_MAX_RECOVERABLE) -> str:
    """method.md: verdicts: `exposed` without a certified deficit (R >= n); `protected` when the recoverable fraction
    ρ = R/n is at most `max_recoverable`; `partial` in between (some directions hidden, most still visible)."""
    if unknowns <= 0 or rank_bound >= unknowns:
        return "exposed"
    return "protected" if rank_bound / unknowns <= max_recoverable else "partial"


def energy_level(
    hidden: float, max_recoverable: float = DEFAULT_MAX_RECOVERABLE, exposed_below: float = DEFAULT_EXPOSED_BELOW
) -> str:
    """The energy section's levels on a hidden share of energy: `exposed` below `exposed_below` (default 5 %), `protected`
    from 1 − `max_recoverable` (default half of the energy hidden), `partial` in between."""
    if hidden < exposed_below:
        return "exposed"
    # A share computed as exactly 1 − ρ_max can land a rounding error below it.
    return "protected" if hidden >= 1 - max_recoverable - 1e-12 else "partial"


def count(number: int, word: str, plural: str | None = None) -> str:
    """A count and its noun, the plural right: 1 step, 2 steps, 1,000 steps (`plural` where adding s is wrong)."""
    return f"{number:,} {word if number == 1 else plural or word + 's'}"


def percent(fraction: float) -> str:
    """A share as the reports write it: 99.5 %, 50 %, 0.5 % (one decimal, more only where rounding would print a
    share below 100 % as 100 %, or one above 0 % as 0 %: a partial verdict never reads "100 % recoverable")."""
    value = fraction * 100
    for digits in (1, 2, 3, 4, 6):
        shown = round(value, digits)
        if (shown >= 100) == (value >= 100) and (shown <= 0) == (value <= 0):
            break
    return f"{shown:.{digits}f}".rstrip("0").rstrip(".") + " %"
