"""One model's settings for a run: the flags over [tool.rankaudit] over a deployment's values, resolved once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from rankaudit.errors import UsageError
from rankaudit.settings.levels import DEFAULT_PSNR_TARGET

if TYPE_CHECKING:
    from rankaudit.settings.round import Round

# The round's flags (method.md: the round), by their parameter names; they mirror [tool.rankaudit.round].
ROUND_FLAGS = (
    "local_samples",
    "local_epochs",
    "lr",
    "optimizer",
    "momentum",
    "clients",
    "server_rounds",
    "available_clients",
    "bn_mode",
)


def build_run_round(
    flags: dict,
    batch_size: int,
    configured: dict | None,
    dp_options: dict | None = None,
    dp_configured: dict | None = None,
):
    """The round from the command's round `flags` and the configuration's table (flags win), with the DP settings
    from `dp_options` (the DP flags) over `dp_configured` ([tool.rankaudit.dp]): q and T follow the round unless
    given."""
    from rankaudit.settings.dp_options import settings_from
    from rankaudit.settings.round import build_round

    values = dp_values(dp_options or {}, dp_configured)
    return build_round(
        {**flags, "batch_size": batch_size},
        configured,
        dp=settings_from(values),
        dp_given=dp_sources(dp_options or {}, dp_configured),
    )


_DP_FLAGS = {
    "noise": "dp_noise",
    "clip": "dp_clip",
    "sample-rate": "dp_sample_rate",
    "steps": "dp_steps",
    "delta": "dp_delta",
    "level": "dp_level",
    "prior": "prior",
    "max-reconstruction": "max_reconstruction",
    "noise-by": "noise_by",
}


def dp_values(options: dict, configured: dict | None) -> dict:
    """The DP options keyed as in [tool.rankaudit.dp]: the config's, then the flags' over them (flags win)."""
    from rankaudit.settings.dp_options import check_option

    merged = dict(configured or {})
    for key, parameter in _DP_FLAGS.items():
        if options.get(parameter) is not None:
            merged[key] = check_option(key, options[parameter])
    if options.get("target_epsilon") is not None:  # suggest's: a second aim of its noise search, beside B(κ)
        merged["target-epsilon"] = _checked_epsilon(options["target_epsilon"])
    return merged


def _checked_epsilon(value: float) -> float:
    import math

    from rankaudit.errors import UsageError

    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"--target-epsilon must be a number above 0, got {value!r}", "pass e.g. --target-epsilon 3")
    return value


def dp_sources(options: dict, configured: dict | None) -> dict[str, str]:
    """Where q and T were given (DPSettings field -> the flag or the config key); absent ones follow the round."""
    sources = {}
    for key, field in (("sample-rate", "sample_rate"), ("steps", "steps")):
        if options.get(_DP_FLAGS[key]) is not None:
            sources[field] = f"--dp-{key}"
        elif configured and key in configured:
            sources[field] = f"[tool.rankaudit.dp] {key}"
    return sources


def factory_arguments(deployment, model_args: tuple[str, ...]) -> dict | None:
    """The factory's keyword arguments: the deployment's (resolved there), else --model-arg KEY=VALUE."""
    if deployment is not None:
        return deployment.model_args or None
    from rankaudit.settings.pyproject import parse_value

    parsed = {}
    for text in model_args:
        key, sep, value = text.partition("=")
        if not sep or not key.strip().isidentifier():
            raise UsageError(f"--model-arg {text!r} is not KEY=VALUE", "write e.g. --model-arg num_classes=10")
        parsed[key.strip()] = parse_value(value.strip())
    return parsed or None


# The options `check` reads from [tool.rankaudit] where the command line does not give them.
CONFIGURABLE = (
    "input_shape",
    "batch_size",
    "fail_on",
    "min_ra",
    "max_recoverable",
    "exposed_below",
    "certificate_quantile",
    "shared_layers",
    "withheld_layers",
    "psnr_target",
)


@dataclass(frozen=True)
class ModelSettings:
    """What `check` analyses one model with: the round (with its DP settings) and the chosen options."""

    round: Round
    input_shape: tuple | None
    fail_on: str
    min_ra: int | None
    max_recoverable: float | None
    exposed_below: float | None
    certificate_quantile: float | None
    shared_layers: list[str] | None
    withheld_layers: list[str] | None
    model_args: dict | None
    # How the model's code may run, from [tool.rankaudit] (the flags set theirs): the caller applies them.
    timeout: float | None = None
    memory_limit: float | None = None
    stand_ins: list[str] | bool | None = None
    psnr_target: float = DEFAULT_PSNR_TARGET  # dB: what --verify fisher's least σ keeps


def sent_layers(shared: list[str] | None, withheld: list[str] | None, deployment) -> dict:
    """What the server receives, as every command judges it: the shared or withheld layers given (a flag, else
    [tool.rankaudit]), else the app's withheld set (NVFlare's ExcludeVars, a FedBN, FedPer or FedRep client's local
    layers), as keyword arguments of the bound."""
    if deployment is not None and not withheld and not shared:
        withheld = deployment.withheld_layers
    return {"shared_layers": shared, "withheld_layers": withheld}


def model_settings(
    spec: str,
    deployment,
    values: dict,
    given: set[str],
    *,
    round_flags: dict,
    dp_options: dict,
    model_args: tuple[str, ...],
) -> ModelSettings:
    """A flag given on the command line (`given`) wins; else the model's [tool.rankaudit] value; else the
    deployment's (an app's round, NVFlare's ExcludeVars), else the default in `values`."""
    from rankaudit.settings.model_spec import split_model_spec
    from rankaudit.settings.pyproject import load_settings

    settings = load_settings(split_model_spec(spec)[0])

    def pick(name):
        return settings.in_force(name, values[name], name in given)

    # One value for the whole run: the round, with its DP settings, handed to every step.
    round_ = (
        deployment.round
        if deployment is not None
        else build_run_round(round_flags, pick("batch_size"), settings.round, dp_options, settings.dp)
    )
    sent = sent_layers(pick("shared_layers"), pick("withheld_layers"), deployment)
    arguments = factory_arguments(deployment, model_args)
    if arguments is None and deployment is None and settings.model_args:  # [[tool.rankaudit.models]] model-args
        arguments = dict(settings.model_args)
    return ModelSettings(
        round=round_,
        input_shape=pick("input_shape"),
        fail_on=pick("fail_on"),
        min_ra=pick("min_ra"),
        max_recoverable=pick("max_recoverable"),
        exposed_below=pick("exposed_below"),
        certificate_quantile=pick("certificate_quantile"),
        **sent,
        model_args=arguments,
        timeout=settings.timeout,
        memory_limit=settings.memory_limit,
        stand_ins=settings.stand_ins,
        psnr_target=pick("psnr_target"),
    )
