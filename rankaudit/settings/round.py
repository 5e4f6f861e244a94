"""The federated round as one frozen value: local samples, batch size, epochs, learning rate, clients, DP."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from rankaudit.errors import UsageError
from rankaudit.settings.levels import count

OPTIMIZERS = ("sgd", "adam")
DP_LEVELS = ("sample", "client")
# Who adds the Gaussian noise. Against the honest-but-curious server only noise the client adds counts: noise the
# server adds after aggregation bounds what the released model reveals, not what the server sees.
NOISE_BY = ("client", "server")
# How the client's BatchNorm layers normalise while it trains: `train` on the batch's own mean and variance (what a
# client in training mode does: the statistics carry each sample into every other sample's gradient), `eval` on
# their running statistics (a client that freezes them).
BN_MODES = ("train", "eval")


# Below this a step's lr·g underflows float32 (smallest normal 1.2e-38 at gradients of 1e-8) and the
# verifiers' sketch fills with denormals (--lr 1e-320 measured rank 48 above the bound 39).
MIN_LR = 1e-30


@dataclass(frozen=True)
class DPSettings:
    """DP-SGD on the client (level `sample`) or user-level DP-FedAvg (level `client`), method.md: DP.

    Each unit's gradient (a sample's, or a client's whole update) is clipped to `clip`, Gaussian noise of
    standard deviation noise_multiplier · clip is added to the sum, each unit takes part in a step with
    probability `sample_rate` (Poisson sampling), over `steps` steps. `prior` is κ, an attack's success
    probability without the update; `max_reconstruction` the policy's ceiling on the bound B(κ) (None: no rule).
    `noise_by`: who adds the noise (NOISE_BY); only `client` noise bounds what the server can reconstruct.
    """

    noise_multiplier: float
    clip: float = 1.0
    sample_rate: float = 1.0
    steps: int = 1
    delta: float = 1e-5
    level: str = "sample"
    prior: float = 0.01
    max_reconstruction: float | None = None
    noise_by: str = "client"
    # Where q and T came from ("round: B/N = 32/4000", "--dp-sample-rate"); "" where nobody said (the defaults).
    # dp_for_round fills them; notes: the one line that says where a given value disagrees with the round.
    sample_rate_source: str = ""
    steps_source: str = ""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Round:
    """What one client sends in one federated round (method.md: the round). FedSGD is local_samples == batch_size, one epoch.

    Built once from flags and [tool.rankaudit.round] and handed to every step; nothing else re-derives it.
    """

    batch_size: int = 1
    local_samples: int | None = None  # N; None: the batch size (one step per epoch)
    local_epochs: int = 1  # E
    lr: float = 0.1  # η (at least MIN_LR)
    optimizer: str = "sgd"  # sgd | adam
    momentum: float = 0.0  # μ, SGD only
    clients: int = 1  # C under secure aggregation; 1: none
    server_rounds: int = 1  # rounds of the whole training (DP composes over them)
    available_clients: int | None = None  # clients the server samples the C from; None: C (all take part)
    dp: DPSettings | None = None
    bn_mode: str = "train"  # BN_MODES: BatchNorm on the batch's statistics (train) or its running ones (eval)
    # Whether anyone stated the server rounds (a flag, [tool.rankaudit.round], the deployment). Not known: the
    # per-sample bound covers one round and the report says what each further round adds.
    server_rounds_known: bool = False

    @property
    def rounds_counted(self) -> int:
        """The server rounds the per-sample bound sums over: all of them where known (client sampling is an
        expectation, not a guarantee: the worst case is every round), else one."""
        return self.server_rounds if self.server_rounds_known else 1

    @property
    def samples(self) -> int:
        """N, with the default applied."""
        return self.batch_size if self.local_samples is None else self.local_samples

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.samples / self.batch_size)

    @property
    def steps(self) -> int:
        """K = E · ⌈N / B⌉ local steps."""
        return self.local_epochs * self.steps_per_epoch

    @property
    def step_batch_sizes(self) -> list[int]:
        """The batch size of every local step in order, the short last batch of each epoch at its size."""
        full, rest = divmod(self.samples, self.batch_size)
        epoch = [self.batch_size] * full + ([rest] if rest else [])
        return epoch * self.local_epochs

    @property
    def population(self) -> int:
        """The clients the server samples each round's C from, with the default applied."""
        return self.clients if self.available_clients is None else self.available_clients

    @property
    def fedsgd(self) -> bool:
        """One gradient of one batch from one client: exactly the single-gradient analysis."""
        return self.steps == 1 and self.clients == 1

    @property
    def secure_aggregation(self) -> bool:
        return self.clients > 1


FEDSGD = Round()


# ---- building and validating a round: the one place that knows what a valid round is ------------------------------

# [tool.rankaudit.round] key -> Round field; the command-line flag is the key with two dashes.
ROUND_KEYS = {
    "local-samples": "local_samples",
    "batch-size": "batch_size",
    "local-epochs": "local_epochs",
    "lr": "lr",
    "optimizer": "optimizer",
    "momentum": "momentum",
    "clients": "clients",
    "server-rounds": "server_rounds",
    "available-clients": "available_clients",
    "bn-mode": "bn_mode",
}
_FLAG = {field: f"--{key} (`{key}` in [tool.rankaudit.round])" for key, field in ROUND_KEYS.items()}


def build_round(
    flags: dict[str, object],
    config: dict[str, object] | None = None,
    dp: DPSettings | None = None,
    dp_given: dict[str, str] | None = None,
) -> Round:
    """The round from the command line's values (`flags`, None where not given) and the configuration's
    [tool.rankaudit.round] values (`config`, same field names); flags win. Validated: a UsageError otherwise.

    `dp`: the DP settings; their q and T follow the round (dp_for_round) except where `dp_given` names them
    (DPSettings field -> where the value was given, e.g. {"sample_rate": "--dp-sample-rate"})."""
    values = {}
    for field in ROUND_KEYS.values():
        given = flags.get(field)
        if given is None and config:
            given = config.get(field)
        if given is not None:
            values[field] = given
    values["server_rounds_known"] = "server_rounds" in values
    round_ = validate_round(Round(**values))
    return dataclasses.replace(round_, dp=dp_for_round(round_, dp, dp_given or {}))


# ---- DP follows the round (method.md: DP): what a unit's sampling rate q and its number of steps T are -----------------


def round_sampling(round_: Round, level: str) -> tuple[float, str, int, str]:
    """(q, where q comes from, T, where T comes from) of the round's DP mechanism.

    Sample level (DP-SGD on the client): each local step draws its batch by Poisson sampling at q = B/N, and a
    sample can take part in every one of the E·⌈N/B⌉ local steps of every server round (client sampling is not
    credited: a pessimistic T). Client level (DP-FedAvg): the server samples C of the M available clients each
    round, q = C/M, over the server rounds."""
    rounds = count(round_.server_rounds, "server round")
    if level == "client":
        rate = round_.clients / round_.population
        return (
            rate,
            f"round: C/M = {round_.clients}/{round_.population} clients sampled per round",
            round_.server_rounds,
            f"round: {rounds}",
        )
    rate = round_.batch_size / round_.samples
    steps = round_.steps * round_.server_rounds
    return (
        rate,
        f"round: B/N = {round_.batch_size}/{round_.samples}",
        steps,
        f"round: E·⌈N/B⌉ = {round_.local_epochs}·{round_.steps_per_epoch} local steps × {rounds}",
    )


def dp_for_round(round_: Round, settings: DPSettings | None, given: dict[str, str]) -> DPSettings | None:
    """`settings` with q and T from the round, each with its source. A value in `given` (DPSettings field ->
    where it was given) is used as given; where it disagrees with the round, one note line says so."""
    if settings is None:
        return None
    rate, rate_source, steps, steps_source = round_sampling(round_, settings.level)
    values, disagree = {}, []
    # A round that does not state its population (M) gives no client-level q to disagree with.
    states_rate = settings.level != "client" or round_.available_clients is not None
    if "sample_rate" in given:
        values["sample_rate_source"] = given["sample_rate"]
        if states_rate and not math.isclose(settings.sample_rate, rate, rel_tol=1e-9):
            disagree.append(
                (
                    f"q = {settings.sample_rate:g} from {given['sample_rate']}",
                    f"q = {rate:.4g} ({rate_source.removeprefix('round: ')})",
                )
            )
    else:
        values.update(sample_rate=rate, sample_rate_source=rate_source)
    if "steps" in given:
        values["steps_source"] = given["steps"]
        if settings.steps != steps:
            disagree.append(
                (
                    f"T = {settings.steps:,} from {given['steps']}",
                    f"T = {steps:,} ({steps_source.removeprefix('round: ')})",
                )
            )
    else:
        values.update(steps=steps, steps_source=steps_source)
    notes = ()
    if disagree:
        notes = (
            f"{' and '.join(used for used, _ in disagree)} used as given; the round gives "
            f"{' and '.join(derived for _, derived in disagree)}",
        )
    return dataclasses.replace(settings, **values, notes=notes)


def validate_round(round_: Round) -> Round:
    """One-line UsageErrors for a round no client can run; the round itself when it is valid."""

    def whole(field: str, value, minimum: int, what: str):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UsageError(
                f"{what} {value!r} is not an integer >= {minimum}",
                f"give {_FLAG[field]} as a whole number of at least {minimum}",
            )

    whole("batch_size", round_.batch_size, 1, "batch size B =")
    whole("local_epochs", round_.local_epochs, 1, "local epochs E =")
    whole("clients", round_.clients, 1, "clients C =")
    whole("server_rounds", round_.server_rounds, 1, "server rounds =")
    if round_.available_clients is not None:
        whole(
            "available_clients",
            round_.available_clients,
            round_.clients,
            f"available clients (at least the C = {round_.clients} of a round) =",
        )
    if round_.local_samples is not None:
        whole("local_samples", round_.local_samples, 1, "local samples N =")
        if round_.local_samples < round_.batch_size:
            raise UsageError(
                f"local samples N = {round_.local_samples} is below the batch size B = "
                f"{round_.batch_size}: the client cannot fill one batch",
                f"give {_FLAG['local_samples']} of at least {round_.batch_size}, or a smaller --batch-size",
            )
    lr = round_.lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise UsageError(
            f"learning rate {lr!r} is not a finite number above 0",
            f"give {_FLAG['lr']} as a positive number, e.g. 0.05",
        )
    if lr < MIN_LR:
        raise UsageError(
            f"learning rate {lr:g} is below {MIN_LR:g}: a local step lr·g would be lost to rounding (or "
            "be a denormal) in the verifiers' float32 and float64 arithmetic, and no rank or attack "
            "measured on it means anything",
            f"give {_FLAG['lr']} as a realistic rate, e.g. 0.05",
        )
    if round_.bn_mode not in BN_MODES:
        raise UsageError(
            f"unknown BatchNorm mode {round_.bn_mode!r}",
            f"give {_FLAG['bn_mode']} as train (the batch's statistics, a client in training mode) or eval",
        )
    if round_.optimizer not in OPTIMIZERS:
        raise UsageError(
            f"unknown optimizer {round_.optimizer!r}", f"give {_FLAG['optimizer']} as one of {', '.join(OPTIMIZERS)}"
        )
    momentum = round_.momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise UsageError(
            f"momentum {momentum!r} is outside [0, 1)",
            f"give {_FLAG['momentum']} between 0 (plain SGD) and just below 1, e.g. 0.9",
        )
    if momentum and round_.optimizer != "sgd":
        raise UsageError(
            f"momentum {momentum:g} given with the {round_.optimizer} optimizer",
            "momentum applies to SGD (Adam keeps its own moment estimates): drop --momentum or use --optimizer sgd",
        )
    return round_


def describe(round_: Round) -> str:
    """The round in one line, as the table's header and the reports name it."""
    if round_.steps == 1:
        text = f"FedSGD: one gradient of a batch of {round_.batch_size}"
        if round_.secure_aggregation:
            text += f", summed over C = {round_.clients} clients by secure aggregation"
        return text
    text = (
        f"FedAvg round: N = {round_.samples} local samples, batch {round_.batch_size}, "
        f"{round_.local_epochs} local epoch{'s' if round_.local_epochs != 1 else ''}, K = {round_.steps} "
        f"step{'s' if round_.steps != 1 else ''} of {round_.optimizer}"
        + (f" (momentum {round_.momentum:g})" if round_.momentum else "")
        + f", lr {round_.lr:g}"
    )
    if round_.secure_aggregation:
        text += f"; secure aggregation over C = {round_.clients} clients"
    return text


def round_dict(round_: Round | None) -> dict | None:
    """The round judged, as the JSON reports write it (method.md: the round): FedSGD is local_samples = batch_size, one epoch,
    one client."""
    if round_ is None:
        return None
    return {
        "local_samples": round_.samples,
        "batch_size": round_.batch_size,
        "local_epochs": round_.local_epochs,
        "steps": round_.steps,
        "lr": round_.lr,
        "optimizer": round_.optimizer,
        "momentum": round_.momentum,
        "clients": round_.clients,
        "secure_aggregation": round_.secure_aggregation,
        "fedsgd": round_.fedsgd,
        "server_rounds": round_.server_rounds,
        "server_rounds_known": round_.server_rounds_known,
        "available_clients": round_.population,
        "bn_mode": round_.bn_mode,
    }
