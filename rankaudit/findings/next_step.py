"""The next step after a failing policy: the command to run, with the user's own model (or app) and round filled in,
and why it is the one (docs/what-now.md). The full report, the --quiet line and the policy line print it."""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from rankaudit.findings.meaning import certifies_nothing
from rankaudit.result import Result
from rankaudit.settings.levels import FAILING_VERDICTS, percent
from rankaudit.settings.round import Round
from rankaudit.settings.run import ROUND_FLAGS

# The ceiling on any reconstruction's success the commands propose when the user gave none: the example every page
# uses (--max-reconstruction 0.05 at the default prior 0.01).
PROPOSED_CEILING = 0.05


@dataclass(frozen=True)
class NextStep:
    command: str  # one shell command, the user's file and round in it
    why: str  # what it finds and what to do with the answer, one sentence without the command


def _round_flags(round_: Round) -> list[str]:
    """The flags that give `round_` again, each only where it differs from the default round."""
    default = Round(batch_size=round_.batch_size)
    flags = ["-b", str(round_.batch_size)] if round_.batch_size != 1 else []
    if round_.local_samples is not None and round_.local_samples != round_.batch_size:  # N = B is the default
        flags += ["--local-samples", str(round_.local_samples)]
    for field, flag in (
        ("local_epochs", "--local-epochs"),
        ("lr", "--lr"),
        ("optimizer", "--optimizer"),
        ("momentum", "--momentum"),
        ("clients", "--clients"),
        ("available_clients", "--available-clients"),
        ("bn_mode", "--bn-mode"),
    ):
        value = getattr(round_, field)
        if value is not None and value != getattr(default, field):
            flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    if round_.server_rounds_known:
        flags += ["--server-rounds", str(round_.server_rounds)]
    return flags


def _dp_flags(result: Result) -> list[str]:
    """The DP options of the run that change the least noise (not the noise itself: that is what is looked for)."""
    dp = result.dp
    if dp is None:
        return []
    flags = []
    for value, default, flag in (
        (dp.clip, 1.0, "--dp-clip"),
        (dp.level, "sample", "--dp-level"),
        (dp.delta, 1e-5, "--dp-delta"),
        (dp.prior, 0.01, "--prior"),
    ):
        if value != default:
            flags += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    # q and T follow the round unless a flag set them; the config's values suggest reads itself.
    if dp.sample_rate_source.startswith("--"):
        flags += ["--dp-sample-rate", f"{dp.sample_rate:g}"]
    if dp.steps_source.startswith("--"):
        flags += ["--dp-steps", str(dp.steps)]
    return flags


# Options of `check` that `suggest` does not take: its command reads the model without them, and says so.
_NOT_IN_SUGGEST = ("--input-dtype", "--shared-layers", "--withheld-layers")
# The round's flags as given on the command line: an app's folder reads the rest of its round itself.
_ROUND_WORDS = ("--batch-size", *(f"--{name.replace('_', '-')}" for name in ROUND_FLAGS))


def _given(result: Result, *, suggest: bool) -> list[str]:
    """The options the user's run was read with (its input shape, model arguments, data, limits ...), for a command
    on the same model; for a model file the round comes from the round judged, config values included."""
    words = []
    for flag, value in result.reading_flags:
        if (suggest and flag in _NOT_IN_SUGGEST) or (flag in _ROUND_WORDS and result.deployment is None):
            continue
        words += [flag] if value is None else [flag, value]
    return words


def _not_carried(result: Result) -> str:
    """The options of the run suggest does not take, said after the step's reason."""
    left_out = sorted({flag for flag, _ in result.reading_flags if flag in _NOT_IN_SUGGEST})
    if not left_out:
        return ""
    return f" (suggest reads the model without {', '.join(left_out)}, which only check takes)"


def _target(result: Result, *, suggest: bool = True) -> list[str]:
    """What the command runs on: the app folder for `rankaudit DIR` (it reads the round itself, beside the round
    flags given), else the model file as the user named it with the round's flags; then the options the run was
    read with."""
    if result.deployment is not None:
        return [result.deployment.root, *_given(result, suggest=suggest)]
    round_ = _round_flags(result.round or Round(batch_size=result.batch_size))
    return [result.model, *round_, *_given(result, suggest=suggest)]


def _command(*words: str) -> str:
    return " ".join(shlex.quote(word) for word in words)


def _noise_command(result: Result) -> tuple[str, float]:
    ceiling = result.dp.max_reconstruction if result.dp is not None and result.dp.max_reconstruction else None
    ceiling = ceiling or PROPOSED_CEILING
    words = ["rankaudit", "suggest", *_target(result), *_dp_flags(result), "--max-reconstruction", f"{ceiling:g}"]
    return _command(*words), ceiling


def _only_noise_helps(result: Result) -> bool:
    """No architecture change protects a sample: photographs (a single visible direction already shows more than
    protected allows), or a sample none of whose directions is hidden and no reference that could say otherwise."""
    bound = result.identifiability
    sample = bound.sample if bound is not None else None
    if sample is None:
        return False
    if certifies_nothing(bound):  # no reference: its protected rank says nothing
        return sample.rank_bound >= sample.unknowns
    return bound.protected_rank == 0 and sample.rank_bound > 0


TRAIN_WITH_IT = (
    "train with it on the client (Opacus's make_private takes it as noise_multiplier) and set `noise` in "
    "[tool.rankaudit.dp] so the gate passes"
)
# Client-level DP has no Opacus call: the client clips its whole update and adds the noise itself.
TRAIN_WITH_IT_CLIENT = (
    "add it on the client to the clipped update before it is sent, and set `noise` in [tool.rankaudit.dp] so the "
    "gate passes"
)


def _train_with_it(result: Result) -> str:
    return TRAIN_WITH_IT_CLIENT if result.dp is not None and result.dp.level == "client" else TRAIN_WITH_IT


def next_step(result: Result) -> NextStep | None:
    """The one thing to do next when the policy fails; None when it passes (or nothing was judged)."""
    policy, dp, bound = result.policy, result.dp, result.identifiability
    if policy is None or policy.passed:
        return None
    verdict_fails = result.verdict in FAILING_VERDICTS[policy.fail_on]
    if dp is not None and dp.noise_by == "server" and verdict_fails:
        command, _ = _noise_command(result)
        return NextStep(
            command,
            "it names the least noise multiplier the client must add (noise the server adds bounds what the released "
            f"model reveals, not what the server sees); {_train_with_it(result)}" + _not_carried(result),
        )
    if dp is not None and dp.within_limit is False:
        command, ceiling = _noise_command(result)
        return NextStep(
            command,
            f"it names the least noise multiplier that keeps any reconstruction within {percent(ceiling)} at this "
            f"round, more than the noise given; {_train_with_it(result)}" + _not_carried(result),
        )
    if verdict_fails and _only_noise_helps(result):
        command, ceiling = _noise_command(result)
        where = (
            "every direction of each sample reaches the server, so no --data can certify any of it hidden"
            if certifies_nothing(bound)
            else "no architecture change reaches protected on this input"
        )
        return NextStep(
            command,
            f"client DP noise is the way ({where}): it names the least noise multiplier that keeps any "
            f"reconstruction within {percent(ceiling)}; {_train_with_it(result)}; then compare designs under that noise "
            "(--verify fisher, compare --dp-noise)" + _not_carried(result),
        )
    if verdict_fails and bound is not None and certifies_nothing(bound):
        return NextStep(
            _command("rankaudit", *_target(result, suggest=False), "--data", "SAMPLES.npy"),
            "with a few hundred samples like yours (SAMPLES.npy, one sample per row) the hidden directions are read "
            f"on your data; or add client DP noise: `rankaudit suggest ... --max-reconstruction {PROPOSED_CEILING:g}` "
            "names the least noise multiplier",
        )
    command = _command("rankaudit", "suggest", *_target(result))
    return NextStep(
        command,
        "it lists the single design changes that raise what each sample keeps hidden, best first; with "
        f"--max-reconstruction {PROPOSED_CEILING:g} also the least client DP noise that bounds every reconstruction"
        + _not_carried(result),
    )
