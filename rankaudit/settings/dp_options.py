"""The DP options: each key of [tool.rankaudit.dp] and its flag, checked once, and the DP settings built from them."""

from __future__ import annotations

import math

from rankaudit.errors import UsageError
from rankaudit.settings.limits import NOISE_MULTIPLIER
from rankaudit.settings.round import DP_LEVELS, NOISE_BY, DPSettings

# The DP options: config key in [tool.rankaudit.dp] -> (DPSettings field, type, test, what a valid value is).
# The flag is --dp-KEY, except --prior and --max-reconstruction. One table for the flags, the config and validate().
OPTION_RULES = {
    "noise": (
        "noise_multiplier",
        float,
        lambda v: NOISE_MULTIPLIER[0] <= v <= NOISE_MULTIPLIER[1],
        f"a number above 0 (from {NOISE_MULTIPLIER[0]:g} to {NOISE_MULTIPLIER[1]:g}: the accountant's arithmetic "
        "holds no other)",
        "1.0",
    ),
    "clip": ("clip", float, lambda v: v > 0, "a number above 0", "1.0"),
    "sample-rate": (
        "sample_rate",
        float,
        lambda v: 0 < v <= 1,
        "a rate in (0, 1] (batch size over dataset size; 1 for full batches)",
        "0.01",
    ),
    "steps": ("steps", int, lambda v: v >= 1, "an integer >= 1", "1000"),
    "delta": ("delta", float, lambda v: 0 < v < 1, "a probability in (0, 1)", "1e-5"),
    "level": ("level", str, lambda v: v in DP_LEVELS, " or ".join(DP_LEVELS), "sample"),
    "prior": (
        "prior",
        float,
        lambda v: 0 < v < 1,
        "a probability in (0, 1) (an attack's success without the update)",
        "0.01",
    ),
    "max-reconstruction": ("max_reconstruction", float, lambda v: 0 < v <= 1, "a probability in (0, 1]", "0.05"),
    "noise-by": ("noise_by", str, lambda v: v in NOISE_BY, " or ".join(NOISE_BY), "client"),
}
# Without a noise multiplier there is no mechanism; these keys only make sense with one.
_NEEDS_NOISE = ("clip", "sample-rate", "steps", "delta", "level", "prior", "max-reconstruction", "noise-by")


def flag_name(key: str) -> str:
    return f"--{key}" if key in ("prior", "max-reconstruction", "noise-by") else f"--dp-{key}"


def check_option(key: str, value, where: str | None = None):
    """`value` for option `key`, or a one-line UsageError naming it (`where`: the config file, else the flag)."""
    field, kind, test, expected, example = OPTION_RULES[key]
    name = f"{where}: [tool.rankaudit.dp] {key}" if where else flag_name(key)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    valid = isinstance(value, kind) and not isinstance(value, bool)
    if valid and kind is float:
        valid = math.isfinite(value)
    if not valid or not test(value):
        written = f'"{example}"' if kind is str else example  # as TOML writes it
        fix = f"set e.g. {key} = {written} in {where}" if where else f"pass e.g. {flag_name(key)} {example}"
        raise UsageError(f"{name} must be {expected}, got {value!r}", fix)
    return value


def settings_from(options: dict) -> DPSettings | None:
    """DPSettings from checked option values keyed as in OPTION_RULES (flags already merged over the config);
    None without any. DP keys without a noise multiplier are an error: there is no mechanism to bound."""
    if "noise" not in options:
        orphans = [flag_name(key) for key in _NEEDS_NOISE if key in options]
        if orphans:
            raise UsageError(
                f"{', '.join(orphans)} given without a noise multiplier: no DP mechanism to bound",
                "add --dp-noise σ (or noise = σ in [tool.rankaudit.dp])",
            )
        return None
    settings = DPSettings(**{OPTION_RULES[key][0]: value for key, value in options.items()})
    validate(settings)
    return settings


def validate(settings: DPSettings) -> None:
    """One-line errors for settings no accountant can take (every field by OPTION_RULES, and the prior below the
    ceiling); the CLI, the config reader and the library calls share it."""
    for key, (field, *_) in OPTION_RULES.items():
        value = getattr(settings, field)
        if value is not None:
            check_option(key, value)
    if settings.max_reconstruction is not None:
        check_ceiling(settings.max_reconstruction, settings.prior)


def check_ceiling(ceiling: float, prior: float) -> None:
    """B(κ) >= κ for every mechanism: a ceiling at or below the prior can never be met."""
    if not prior < ceiling <= 1:
        raise UsageError(
            f"--max-reconstruction {ceiling:g} is not above the prior {prior:g}: no amount of noise "
            "brings an attack below guessing",
            "raise --max-reconstruction above --prior",
        )
