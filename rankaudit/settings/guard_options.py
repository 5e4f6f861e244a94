"""The client-side guard's settings: what it does with an update that reads a sample out, and how well a readout
must show a sample to count; from keyword arguments, a Flower run config or [tool.rankaudit.guard]."""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass, fields

from rankaudit.errors import UsageError

ACTIONS = ("block", "drop", "noise")
# What a readout of a hidden layer's features whose sample stays hidden gets (it is logged either way).
FEATURE_ACTIONS = ("send", "drop", "block")
# A readout reads a sample when its PSNR against it (peak: the sample's own range) is at least this, in dB: a
# photograph at 30 dB is the photograph (docs/guard.md, "The criterion").
DEFAULT_MIN_PSNR = 30.0
# Run-config keys carry this prefix, in the hyphenated style of Flower run configs ("rankaudit-guard-action").
RUN_CONFIG_PREFIX = "rankaudit-guard-"


@dataclass(frozen=True)
class GuardSettings:
    """How the guard decides and acts; the defaults are the safe ones (block, no energy check)."""

    action: str = "block"  # block: nothing is sent this round; drop: the offending rows' update is not sent;
    # noise: Gaussian noise of noise-scale times each offending row's own update norm is added to it
    min_psnr: float = DEFAULT_MIN_PSNR
    noise_scale: float = 1.0
    check_features: bool = True  # readouts of a deeper layer's input (features) count, not only the raw input
    energy_budget: float = 0.0  # seconds for the measured visible-energy check; 0 skips it
    min_hidden: float = 0.05  # the energy check's threshold: every sample must hide at least this share
    log: str | None = None  # a file the one-line JSON record of each round is appended to (None: the logger only)
    seed: int | None = None  # the noise action's generator; None: fresh from the operating system's entropy, so
    # that no two clients or runs draw the same noise (a server that knew it could subtract it)
    feature_action: str = "send"  # a readout of features that determine too little of the sample: send (logged),
    # drop its rows, or block

    def replaced(self, values: dict) -> GuardSettings:
        return guard_settings(values, base=self)


# key (as written in TOML, run configs and keyword arguments with _) -> field
GUARD_KEYS = {f.name.replace("_", "-"): f.name for f in fields(GuardSettings)}


def _number(where: str, key: str, value, low: float, high: float = math.inf, *, open_low: bool = False) -> float:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    ok = ok and (value > low if open_low else value >= low) and value <= high
    if not ok:
        bound = f"above {low:g}" if open_low else f"at least {low:g}"
        raise UsageError(
            f"{where}: {key} is {value!r}",
            f"give a number {bound}" + (f" and at most {high:g}" if high < 1e300 else ""),
        )
    return float(value)


def guard_settings(values: dict, *, base: GuardSettings | None = None, where: str = "the guard's settings"):
    """``base`` (default: the defaults) with ``values`` over it, each checked (a one-line UsageError naming the key)."""
    from dataclasses import replace

    chosen = {}
    for raw_key, value in values.items():
        key = str(raw_key).replace("_", "-")
        if key == "tolerance":
            raise UsageError(
                f"{where}: tolerance was replaced by min-psnr",
                f"give min-psnr in dB instead (default {DEFAULT_MIN_PSNR:g}; a readout at or above it reads a sample)",
            )
        if key not in GUARD_KEYS:
            raise UsageError(f"{where}: unknown key {raw_key}", "use " + ", ".join(GUARD_KEYS))
        name = GUARD_KEYS[key]
        if name == "action":
            if value not in ACTIONS:
                raise UsageError(f"{where}: action is {value!r}", "use one of " + ", ".join(ACTIONS))
        elif name == "min_psnr":
            value = _number(where, key, value, 0.0, 300.0, open_low=True)
        elif name == "feature_action":
            if value not in FEATURE_ACTIONS:
                raise UsageError(f"{where}: feature-action is {value!r}", "use one of " + ", ".join(FEATURE_ACTIONS))
        elif name in ("noise_scale", "energy_budget"):
            value = _number(where, key, value, 0.0)
        elif name == "min_hidden":
            value = _number(where, key, value, 0.0, 1.0)
        elif name == "check_features":
            if not isinstance(value, bool):
                raise UsageError(f"{where}: check-features is {value!r}", "give true or false")
        elif name == "log":
            if value is not None and not (isinstance(value, str) and value):
                raise UsageError(f"{where}: log is {value!r}", "give a file path")
            if value is not None and os.path.exists(value) and not os.path.isfile(value):
                # A named pipe would hold every round until something reads it; a device or a folder is no log.
                kind = "a named pipe (FIFO)" if stat.S_ISFIFO(os.stat(value).st_mode) else "not a file"
                raise UsageError(
                    f"{where}: log {value} is {kind}; lines are appended to a regular file", "give a file name"
                )
        elif name == "seed":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise UsageError(f"{where}: seed is {value!r}", "give an integer")
        chosen[name] = value
    return replace(base or GuardSettings(), **chosen)


# Which way each setting makes the guard stricter, for the settings a run config may only tighten: "higher" or
# "lower" (a number), "true" (a switch), or the values from weakest to strictest. A field this table does not name
# (a later setting, or `log` and `seed`, which aim the guard's output or make its noise predictable) is never taken
# from a run config.
STRICTER = {
    "action": ("noise", "drop", "block"),  # noise sends the offending rows noised, drop sends none of them
    "feature_action": ("send", "drop", "block"),
    "min_psnr": "lower",  # a readout at or above it leaks: a lower threshold counts more
    "check_features": "true",
    "noise_scale": "higher",
    "energy_budget": "higher",  # 0 skips the energy check
    "min_hidden": "higher",
}


def _stricter_or_equal(name: str, value, current) -> bool:
    way = STRICTER.get(name)
    if way is None:
        return False
    if isinstance(way, tuple):
        return value in way and current in way and way.index(value) >= way.index(current)
    if way == "true":
        return bool(value) or not current
    return value >= current if way == "higher" else value <= current


def from_run_config(
    run_config: dict, base: GuardSettings | None = None, ignored: list[str] | None = None
) -> GuardSettings:
    """The settings a Flower run config gives under ``rankaudit-guard-*`` keys, over ``base`` (the client's own,
    from its code and its pyproject.toml): only where they make the guard stricter. Whoever launches the run sets
    the run config, and the guard protects the client from the server's side: a key that would weaken ``base`` is
    left out, with one line in ``ignored`` naming it and where the client sets it instead."""
    from dataclasses import fields as dataclass_fields

    base = base or GuardSettings()
    found = {
        key[len(RUN_CONFIG_PREFIX) :]: value for key, value in run_config.items() if key.startswith(RUN_CONFIG_PREFIX)
    }
    where = "the run config's rankaudit-guard- keys"
    proposed = guard_settings(found, base=base, where=where)  # each value checked as the client's own would be
    kept = {}
    for field in dataclass_fields(GuardSettings):
        value, current = getattr(proposed, field.name), getattr(base, field.name)
        if value == current:
            continue
        if _stricter_or_equal(field.name, value, current):
            kept[field.name] = value
        elif ignored is not None:
            key = field.name.replace("_", "-")
            ignored.append(
                f"the run config's {RUN_CONFIG_PREFIX}{key} = {json.dumps(value)} would weaken the client's guard "
                f"({key} = {json.dumps(current)}), so it is ignored: a run config may only make the guard stricter; set "
                f"{key} in the client's own code (rankaudit_guard(..., {field.name}=...)) or in its pyproject.toml "
                "[tool.rankaudit.guard]"
            )
    return guard_settings(kept, base=base, where=where)


def settings_from_flags(options: dict, log: str | None, base: GuardSettings | None) -> GuardSettings:
    """The guard command's own flags over ``base`` ([tool.rankaudit.guard]); the flags are taken out of ``options``."""
    if options.pop("tolerance", None) is not None:
        raise UsageError(
            "--tolerance was replaced by --min-psnr",
            f"give --min-psnr DB instead (default {DEFAULT_MIN_PSNR:g}; a readout at or above it reads a sample)",
        )
    given = {
        key: options.pop(key)
        for key in ("action", "min_psnr", "feature_action", "noise_scale", "energy_budget", "min_hidden")
        if options.get(key) is not None
    }
    if log is not None:
        given["log"] = log
    return guard_settings(given, base=base or GuardSettings(), where="the guard's flags")


def one_round_flags(round_flags: dict) -> dict:
    """The round flags the guard takes: one client's update in one round, so none that counts clients or rounds."""
    for name in ("clients", "server_rounds", "available_clients"):
        if round_flags.get(name) is not None:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag}: the guard decides on one client's update in one round", f"drop {flag}")
    return round_flags
