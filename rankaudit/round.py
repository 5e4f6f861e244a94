"""The federated round as one frozen value: local samples, batch size, epochs, learning rate, clients, DP."""
from __future__ import annotations

import math
from dataclasses import dataclass

from rankaudit.errors import UsageError

OPTIMIZERS = ("sgd", "adam")
DP_LEVELS = ("sample", "client")
# Who adds the Gaussian noise. Against the honest-but-curious server only noise the client adds counts: noise the
# server adds after aggregation bounds what the released model reveals, not what the server sees.
NOISE_BY = ("client", "server")


# Issue 23: below this a step's lr·g underflows float32 (smallest normal 1.2e-38 at gradients of 1e-8) and the
# verifiers' sketch fills with denormals (--lr 1e-320 measured rank 48 above the bound 39).
MIN_LR = 1e-30


@dataclass(frozen=True)
class DPSettings:
    """DP-SGD on the client (level `sample`) or user-level DP-FedAvg (level `client`), spec §13.

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


@dataclass(frozen=True)
class Round:
    """What one client sends in one federated round (spec §12). FedSGD is local_samples == batch_size, one epoch.

    Built once from flags and [tool.rankaudit.round] and handed to every step; nothing else re-derives it.
    """

    batch_size: int = 1
    local_samples: int | None = None      # N; None: the batch size (one step per epoch)
    local_epochs: int = 1                 # E
    lr: float = 0.1                       # η (at least MIN_LR)
    optimizer: str = "sgd"                # sgd | adam
    momentum: float = 0.0                 # μ, SGD only
    clients: int = 1                      # C under secure aggregation; 1: none
    server_rounds: int = 1                # rounds of the whole training (DP composes over them)
    available_clients: int | None = None  # clients the server samples the C from; None: C (all take part)
    dp: DPSettings | None = None

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
ROUND_KEYS = {"local-samples": "local_samples", "batch-size": "batch_size", "local-epochs": "local_epochs",
              "lr": "lr", "optimizer": "optimizer", "momentum": "momentum", "clients": "clients",
              "server-rounds": "server_rounds", "available-clients": "available_clients"}
_FLAG = {field: f"--{key} (`{key}` in [tool.rankaudit.round])" for key, field in ROUND_KEYS.items()}


def build_round(flags: dict[str, object], config: dict[str, object] | None = None,
                dp: DPSettings | None = None) -> Round:
    """The round from the command line's values (`flags`, None where not given) and the configuration's
    [tool.rankaudit.round] values (`config`, same field names); flags win. Validated: a UsageError otherwise."""
    values = {}
    for field in ROUND_KEYS.values():
        given = flags.get(field)
        if given is None and config:
            given = config.get(field)
        if given is not None:
            values[field] = given
    return validate_round(Round(**values, dp=dp))


def validate_round(round_: Round) -> Round:
    """One-line UsageErrors for a round no client can run; the round itself when it is valid."""
    def whole(field: str, value, minimum: int, what: str):
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UsageError(f"{what} {value!r} is not an integer >= {minimum}",
                             f"give {_FLAG[field]} as a whole number of at least {minimum}")

    whole("batch_size", round_.batch_size, 1, "batch size B =")
    whole("local_epochs", round_.local_epochs, 1, "local epochs E =")
    whole("clients", round_.clients, 1, "clients C =")
    whole("server_rounds", round_.server_rounds, 1, "server rounds =")
    if round_.available_clients is not None:
        whole("available_clients", round_.available_clients, round_.clients,
              f"available clients (at least the C = {round_.clients} of a round) =")
    if round_.local_samples is not None:
        whole("local_samples", round_.local_samples, 1, "local samples N =")
        if round_.local_samples < round_.batch_size:
            raise UsageError(f"local samples N = {round_.local_samples} is below the batch size B = "
                             f"{round_.batch_size}: the client cannot fill one batch",
                             f"give {_FLAG['local_samples']} of at least {round_.batch_size}, or a smaller "
                             "--batch-size")
    lr = round_.lr
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise UsageError(f"learning rate {lr!r} is not a finite number above 0",
                         f"give {_FLAG['lr']} as a positive number, e.g. 0.05")
    if lr < MIN_LR:
        raise UsageError(f"learning rate {lr:g} is below {MIN_LR:g}: a local step lr·g would be lost to rounding (or "
                         "be a denormal) in the verifiers' float32 and float64 arithmetic, and no rank or attack "
                         "measured on it means anything", f"give {_FLAG['lr']} as a realistic rate, e.g. 0.05")
    if round_.optimizer not in OPTIMIZERS:
        raise UsageError(f"unknown optimizer {round_.optimizer!r}",
                         f"give {_FLAG['optimizer']} as one of {', '.join(OPTIMIZERS)}")
    momentum = round_.momentum
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0 <= momentum < 1:
        raise UsageError(f"momentum {momentum!r} is outside [0, 1)",
                         f"give {_FLAG['momentum']} between 0 (plain SGD) and just below 1, e.g. 0.9")
    if momentum and round_.optimizer != "sgd":
        raise UsageError(f"momentum {momentum:g} given with the {round_.optimizer} optimizer",
                         "momentum applies to SGD (Adam keeps its own moment estimates): drop --momentum or use "
                         "--optimizer sgd")
    return round_


def describe(round_: Round) -> str:
    """The round in one line, as the table's header and the reports name it."""
    if round_.steps == 1:
        text = f"FedSGD: one gradient of a batch of {round_.batch_size}"
        if round_.secure_aggregation:
            text += f", summed over C = {round_.clients} clients by secure aggregation"
        return text
    text = (f"FedAvg round: N = {round_.samples} local samples, batch {round_.batch_size}, "
            f"{round_.local_epochs} local epoch{'s' if round_.local_epochs != 1 else ''}, K = {round_.steps} "
            f"step{'s' if round_.steps != 1 else ''} of {round_.optimizer}"
            + (f" (momentum {round_.momentum:g})" if round_.momentum else "") + f", lr {round_.lr:g}")
    if round_.secure_aggregation:
        text += f"; secure aggregation over C = {round_.clients} clients"
    return text
