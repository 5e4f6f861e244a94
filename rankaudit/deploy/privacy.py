"""The privacy mechanism an app's code uses, as rankaudit's DP settings: σ, clip, level, who adds the noise."""

from __future__ import annotations

import math

from rankaudit.errors import UsageError

ROUND_TABLE = "[tool.rankaudit.round]"
DP_TABLE = "[tool.rankaudit.dp]"


# NVFlare's privacy filters on a client's task result, by class: what each does to the update before it is sent.
# None of them is a DP mechanism rankaudit accounts for; none runs on the server.
NVFLARE_RESULT_FILTERS = {
    "PercentilePrivacy": "sends only the weight changes above its percentile, clipped to gamma; it adds no noise, so "
    "nothing is counted as DP, and the entries it sends still carry the samples (the bound judges the full update, "
    "an upper bound on what the filtered one shows)",
    "SVTPrivacy": "sends a noisy selection of the weight changes (the sparse vector technique, noise added on the "
    "client); that noise is not counted (set noise, clip and noise-by in " + DP_TABLE + " to count it)",
}


def result_filter_note(name: str, where: str) -> str:
    """The one line a report gives an NVFlare privacy filter on the client's result."""
    return f"{name} at {where}: a result filter on the client that {NVFLARE_RESULT_FILTERS[name]}"


# ---- privacy ---------------------------------------------------------------------------------------------------


def privacy_settings(mechanisms, read, round_, settings, overrides, sources):
    """The DP mechanism of the code (if any) as [tool.rankaudit.dp] keys; the config and the flags over it."""
    from rankaudit.settings.dp_options import OPTION_RULES, check_option, settings_from
    from rankaudit.settings.round import dp_for_round

    found: dict[str, tuple[object, str]] = {}
    notes: list[str] = []
    for wrapper in (m for m in mechanisms if m.kind == "unaccounted"):
        who = wrapper.arguments["noise_by"].value
        notes.append(
            f"{wrapper.name} at {wrapper.source}: a privacy wrapper rankaudit has no rule for; "
            + (
                "its noise, added by the server, protects nothing against the server"
                if who == "server"
                else "noise it adds on the client is not counted"
            )
            + f" (set noise, clip and noise-by in {DP_TABLE} to count it)"
        )
    notes += [result_filter_note(m.name, m.source) for m in mechanisms if m.kind == "result-filter"]
    not_dp = ("secagg", "exclude-vars", "unaccounted", "local-layers", "sent-part", "result-filter")
    dp_mechanisms = [m for m in mechanisms if m.kind not in not_dp]
    if len({m.kind for m in dp_mechanisms}) > 1:
        notes.append(
            "several DP mechanisms in the code ("
            + ", ".join(f"{m.name} at {m.source}" for m in dp_mechanisms)
            + f"); the first is used: set the others' settings in {DP_TABLE} to judge them"
        )
    given_dp = {**(settings.dp or {}), **overrides.dp}
    undecided = [m for m in dp_mechanisms if m.condition is not None]
    if undecided and "noise" not in given_dp:
        # DP on or off is the app's choice at run time: assuming it on could claim a protection the run lacks.
        mechanism = undecided[0]
        raise UsageError(
            f"{mechanism.name} at {mechanism.source} runs only when {mechanism.condition} holds, which is not read",
            f"state the key that decides in the app's configuration; or, for the run with it, noise = σ and clip = C "
            f"in {DP_TABLE}",
        )
    if dp_mechanisms:
        mechanism = dp_mechanisms[0]
        reader = {
            "flower-central": _flower_central,
            "local-dp": _local_dp,
            "opacus": _opacus,
            "opacus-epsilon": _opacus,
        }[mechanism.kind]
        try:
            found, more = reader(mechanism, read, round_)
        except _Unread as unread:
            given = {**(settings.dp or {}), **overrides.dp}
            if "noise" not in given or unread.key not in given:
                raise UsageError(
                    f"{mechanism.name} at {mechanism.source}: its {unread.name} is not a literal or a "
                    "run-config value rankaudit can read",
                    f"set noise = σ and clip = C in {DP_TABLE} of the app's pyproject.toml (or --dp-noise, --dp-clip)",
                ) from None
            found, more = _unread_mechanism(mechanism, round_)
        notes += more
    merged: dict[str, tuple[object, str]] = dict(found)
    for key, value in (settings.dp or {}).items():
        merged[key] = (value, DP_TABLE)
    for key, value in overrides.dp.items():
        prefix = "dp-" if key in ("noise", "clip", "sample-rate", "steps", "delta", "level") else ""
        merged[key] = (value, f"--{prefix}{key}")
    options, given = {}, {}
    for key, (value, source) in merged.items():
        options[key] = check_option(key, value, source if source.startswith("[") else None)
        sources.add(f"dp {key}", options[key], source)
        if key in ("sample-rate", "steps"):
            given[OPTION_RULES[key][0]] = source
    settings = dp_for_round(round_, settings_from(options), given)
    if settings is not None:
        for key, field in (("sample-rate", "sample_rate"), ("steps", "steps")):
            if field not in given:
                sources.add(f"dp {key}", getattr(settings, field), getattr(settings, f"{field}_source"))
    return settings, notes


class _Unread(Exception):
    """A mechanism's argument rankaudit cannot read; fatal only when [tool.rankaudit.dp] or a flag does not give
    the value instead."""

    def __init__(self, mechanism, name: str, key: str):
        super().__init__(name)
        self.mechanism, self.name, self.key = mechanism, name, key


def _need(mechanism, name: str, key: str = "noise"):
    found = mechanism.arguments.get(name)
    if found is None or isinstance(found.value, (str, list, bool)):
        raise _Unread(mechanism, name, key)
    return found


def _unread_mechanism(mechanism, round_):
    """A mechanism whose σ or clip the config gives: who adds the noise and its level, from the mechanism alone."""
    where = f"{mechanism.name} at {mechanism.source}"
    # q and T not named here follow the round (round.dp_for_round, the one place that derives them).
    if mechanism.kind == "flower-central":
        return {
            "level": ("client", where),
            "noise-by": ("server", f"{mechanism.name} adds the noise on the server"),
        }, []
    if mechanism.kind == "local-dp":
        return {
            "level": ("client", where),
            "noise-by": ("client", f"{where} adds the noise on the client"),
            "sample-rate": (1.0, f"{where}: the server knows which client sent each update"),
        }, []
    return {"level": ("sample", where), "noise-by": ("client", f"{where}: DP-SGD on the client")}, []


def _flower_central(mechanism, read, round_):
    """Flower's central DP: clipped updates, Gaussian noise added by the SERVER to the aggregate. Client level;
    q = sampled / available clients, T = server rounds."""
    noise, clip = _need(mechanism, "noise_multiplier"), _need(mechanism, "clipping_norm", "clip")
    found = {
        "noise": (float(noise.value), noise.source),
        "clip": (float(clip.value), clip.source),
        "level": ("client", f"{mechanism.name} at {mechanism.source}"),
        "noise-by": ("server", f"{mechanism.name} adds the noise on the server"),
    }
    notes = []
    if "Adaptive" in mechanism.name:
        notes.append(f"{mechanism.name}: the clip norm adapts during training; the bound does not depend on it")
    sampled = mechanism.arguments.get("num_sampled_clients") or read.get("sampled-clients")
    nodes = read.get("available-clients")
    if sampled is not None and nodes is not None and isinstance(sampled.value, int) and sampled.value <= nodes.value:
        found["sample-rate"] = (
            sampled.value / nodes.value,
            f"num_sampled_clients {sampled.value} ({sampled.source}) / {nodes.value} nodes ({nodes.source})",
        )
    else:
        notes.append(
            "client-level q = 1: the number of nodes the server samples from is not stated; set "
            f"available-clients in {ROUND_TABLE} or options.num-supernodes of the federation"
        )
    return found, notes


def _local_dp(mechanism, read, round_):
    """Flower's LocalDpMod: each client clips its update to `clipping_norm` and adds Gaussian noise of standard
    deviation sensitivity·√(2 ln(1.25/δ))/ε itself. The server knows who sent what: no sampling amplification
    against it (q = 1); T = server rounds."""
    clip, sensitivity = _need(mechanism, "clipping_norm", "clip"), _need(mechanism, "sensitivity")
    epsilon, delta = _need(mechanism, "epsilon"), _need(mechanism, "delta")
    if not (epsilon.value > 0 and 0 < delta.value < 1 and clip.value > 0):
        raise UsageError(
            f"LocalDpMod at {mechanism.source}: epsilon {epsilon.value!r}, delta {delta.value!r} and "
            f"clipping_norm {clip.value!r} give no Gaussian noise rankaudit can bound",
            f"set noise = σ and clip in {DP_TABLE}",
        )
    std = sensitivity.value * math.sqrt(2 * math.log(1.25 / delta.value)) / epsilon.value
    where = f"LocalDpMod at {mechanism.source}"
    return {
        "noise": (std / clip.value, f"{where}: sensitivity·√(2 ln(1.25/δ))/ε / clipping_norm"),
        "clip": (float(clip.value), clip.source),
        "level": ("client", where),
        "noise-by": ("client", f"{where} adds the noise on the client"),
        "sample-rate": (1.0, f"{where}: the server knows which client sent each update"),
    }, []


def _opacus(mechanism, read, round_):
    """Opacus DP-SGD on the client: sample level, q = B/N, T = E·⌈N/B⌉ per round × rounds."""
    clip = _need(mechanism, "max_grad_norm", "clip")
    where = f"{mechanism.name} at {mechanism.source}"
    notes = []
    found = {
        "clip": (float(clip.value), clip.source),
        "level": ("sample", where),
        "noise-by": ("client", f"{where}: DP-SGD on the client"),
    }  # q = B/N and T follow the round
    poisson = mechanism.arguments.get("poisson_sampling")
    if poisson is not None and poisson.value is False:
        notes.append(
            f"{where}: poisson_sampling=False; the bound assumes Poisson sampling at q = B/N, as Opacus' "
            "own accountant does, which shuffled batches do not strictly give"
        )
    if mechanism.kind == "opacus":
        noise = _need(mechanism, "noise_multiplier")
        found["noise"] = (float(noise.value), noise.source)
        return found, notes
    target, delta, epochs = (_need(mechanism, name) for name in ("target_epsilon", "target_delta", "epochs"))
    horizon = int(epochs.value) * round_.steps_per_epoch
    from rankaudit.settings.round import round_sampling

    sigma = noise_for_epsilon(float(target.value), float(delta.value), round_sampling(round_, "sample")[0], horizon)
    found["noise"] = (
        sigma,
        (
            f"σ for ε {target.value:g} at δ {delta.value:g} over {epochs.value} epoch(s) "
            f"({where}), derived with dp-accounting's PLD (Opacus' own accountant may differ "
            "slightly)"
        ),
    )
    return found, notes


def noise_for_epsilon(epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """The least σ whose subsampled Gaussian reaches `epsilon` at `delta` after `steps` steps at `sample_rate`
    (what make_private_with_epsilon chooses), by bisection on the PLD accountant's ε."""
    from rankaudit.settings.accountant import PLDAccountant, SubsampledGaussian

    accountant = PLDAccountant()

    def reached(sigma: float) -> float:
        return accountant.profile(SubsampledGaussian(sigma, sample_rate, steps)).epsilon(delta)

    low, high = 0.3, 1.0
    while reached(high) > epsilon:
        low, high = high, high * 2
        if high > 1e4:
            raise UsageError(
                f"no noise multiplier reaches ε {epsilon:g} at δ {delta:g}", f"set noise = σ in {DP_TABLE}"
            )
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if reached(middle) > epsilon else (low, middle)
        if high - low < 1e-3:
            break
    return round(high, 4)
