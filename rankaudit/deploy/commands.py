"""An app folder as each command reads it: `check`'s reading under the command's flags, the same reading for
`suggest` and `compare` (the round, its DP, the model's arguments), and the `check` line that keeps the app's round."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from rankaudit.deploy.app import Overrides, read_deployment
from rankaudit.errors import UsageError
from rankaudit.result import DeploymentRead
from rankaudit.settings.run import (
    ROUND_FLAGS,
    build_run_round,
    dp_sources,
    dp_values,
    factory_arguments,
    sent_layers,
)

# What suggest's DP options ask for rather than describe: the ceiling the least noise must meet, and its prior.
_SEARCH_ONLY = ("max_reconstruction", "prior")


def deployment_for(
    spec: str,
    flags: dict,
    options: dict,
    run_config: str | None,
    model_args: tuple[str, ...],
    *,
    batch_size: int | None,
    input_shape_given: bool,
):
    """`rankaudit DIR`: the app's round, DP and model (read_deployment), the command's round `flags` (and
    `batch_size` where given on the command line) over them; None for a model file."""
    if not Path(spec).is_dir():
        if run_config:
            raise UsageError(
                "--run-config overrides a Flower app's run config",
                "give the app's directory, e.g. `rankaudit . --run-config ...`, or drop --run-config",
            )
        return None
    if batch_size is not None:
        flags = {**flags, "batch_size": batch_size}
    return read_deployment(
        Path(spec),
        Overrides(
            round=flags,
            dp=dp_values(options, None),
            run_config=run_config,
            model_args=model_args,
            input_shape_given=input_shape_given,
        ),
    )


def deployment_read(deployment):
    """What the report says about the deployment that was read (its paths relative to the working directory)."""
    return DeploymentRead(deployment.kind, os.path.relpath(deployment.root), deployment.settings, deployment.notes)


def deployment_for_design(
    spec: str, round_flags: dict, options: dict, *, batch_size, input_shape_given: bool, searching: bool = False
):
    """An app folder's deployment, read as `check` reads it with the same round and DP flags (None for a model
    file). `searching` (suggest): the DP options ask for the least noise rather than state a mechanism, so the app
    is read with them only where they give a noise multiplier; without one the app's own DP stands. `options` also
    carries --run-config and --model-arg where the command takes them."""
    run_config, model_args = options.get("run_config"), tuple(options.get("model_args") or ())
    if searching and options.get("dp_noise") is None:
        options = {}
    elif searching:
        options = {key: value for key, value in options.items() if key not in _SEARCH_ONLY}
    return deployment_for(
        spec, round_flags, options, run_config, model_args, batch_size=batch_size, input_shape_given=input_shape_given
    )


def search_options(options: dict, configured: dict | None, round_dp) -> tuple[dict, dict[str, str]]:
    """suggest's DP search options (keyed as [tool.rankaudit.dp]) and where q and T were given: the flags over the
    config, and where the round already carries DP (an app's DP-SGD), its σ, clip, level, δ, q and T where neither
    states them, so the least noise is searched for the mechanism `check` reads and the Fisher review runs at its σ."""
    values, given = dp_values(options, configured), dp_sources(options, configured)
    if not values or round_dp is None:
        return values, given
    kept = ("noise", "noise_multiplier"), ("clip", "clip"), ("level", "level"), ("delta", "delta")
    for key, field in (*kept, ("sample-rate", "sample_rate"), ("steps", "steps")):
        if key not in values:
            values[key] = getattr(round_dp, field)
            if field in ("sample_rate", "steps"):
                given[field] = getattr(round_dp, f"{field}_source") or "the app's DP"
    return values, given


def design_round(deployment, round_flags: dict, batch_size: int, settings, options: dict):
    """compare's round for one design: an app's, as `check` reads it; a model file's from the round and DP flags
    over its [tool.rankaudit.round] and [tool.rankaudit.dp] where any flag gives one; else None (structural)."""
    if deployment is not None:
        return deployment.round
    if any(value is not None for value in round_flags.values()) or dp_values(options, None):
        return build_run_round(round_flags, batch_size, settings.round, options, settings.dp)
    return None


def fisher_at_one_sigma(rounds: list, dp_flags_given: bool) -> bool:
    """Whether compare reads both designs' Fisher floor: at one σ, both rounds carrying it. DP flags that leave
    the designs at different σ (their configurations differ) are refused in one line; two apps whose own DP differs
    (or only one has any) are compared without it, each design's DP section as `check` reports it."""
    carried = [round_.dp for round_ in rounds if round_ is not None and round_.dp is not None]
    if not carried:
        return False
    if len(carried) == len(rounds) and len({dp.noise_multiplier for dp in carried}) == 1:
        return True
    if dp_flags_given:
        raise UsageError(
            "compare reads both designs' Fisher floor at the same σ, and their configurations give different "
            "noise multipliers (or only one gives any)",
            "give --dp-noise σ on the command line",
        )
    return False


def check_line(given: str, round_flags: dict, input_shape, options: dict) -> str:
    """The `check` command that judges what suggest judged: the model file or app folder as given (an app's round
    and DP are read again) with the round flags, input shape, run config and model arguments given on the command
    line."""
    words = ["rankaudit", "check", shlex.quote(given)]
    if input_shape is not None:
        words += ["--input-shape", ",".join(str(size) for size in input_shape)]
    if options.get("run_config"):
        words += ["--run-config", shlex.quote(options["run_config"])]
    for argument in options.get("model_args") or ():
        words += ["--model-arg", shlex.quote(argument)]
    for name in (*ROUND_FLAGS, "batch_size"):
        value = round_flags.get(name)
        if value is not None:
            words += [
                f"--{name.replace('_', '-')}",
                shlex.quote(f"{value:g}" if isinstance(value, float) else str(value)),
            ]
    return " ".join(words)


def refuse_model_arguments(spec: str, model_args: dict | None, what: str) -> None:
    """The Fisher review builds the model with real weights and without arguments (as --verify does)."""
    if model_args:
        shown = ", ".join(f"{key}={value!r}" for key, value in model_args.items())
        raise UsageError(
            f"{spec}: {what} builds the model with real weights and without its arguments ({shown})",
            "drop the DP options and --psnr-target, or give a zero-argument factory that passes them: PATH:NAME",
        )


@dataclass(frozen=True)
class DesignReading:
    """What suggest judges: the app's deployment (None for a model file), the model file, the arguments the app
    builds it with, and the `check` line that judges it on the same round."""

    deployment: object | None
    model: str
    model_args: dict | None
    check_command: str

    def built_and_sent(self, settings) -> dict:
        """The arguments the model is built with and the layers the server receives, as `check` reads them
        ([tool.rankaudit]'s shared or withheld layers, else the app's withheld set), as suggest's keywords."""
        sent = sent_layers(settings.shared_layers, settings.withheld_layers, self.deployment)
        return {"model_args": self.model_args, **sent}


def suggest_reading(spec: str, round_flags: dict, options: dict, batch_size, input_shape) -> DesignReading:
    """suggest's model and round: an app folder read as `check` reads it, its DP kept unless a noise is given; a
    model file built with --model-arg, else its [[tool.rankaudit.models]] model-args, as `check` builds it."""
    deployment = deployment_for_design(
        spec, round_flags, options, batch_size=batch_size, input_shape_given=input_shape is not None, searching=True
    )
    command = check_line(spec, {**round_flags, "batch_size": batch_size}, input_shape, options)
    if deployment is None:
        from rankaudit.settings.model_spec import split_model_spec
        from rankaudit.settings.pyproject import load_settings

        arguments = factory_arguments(None, tuple(options.get("model_args") or ()))
        configured = load_settings(split_model_spec(spec)[0]).model_args
        return DesignReading(None, spec, arguments or (dict(configured) if configured else None), command)
    return DesignReading(deployment, deployment.model, deployment.model_args or None, command)
