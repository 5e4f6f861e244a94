"""The federated round as one frozen value: local samples, batch size, epochs, learning rate, clients, DP."""
from __future__ import annotations

import math
from dataclasses import dataclass

OPTIMIZERS = ("sgd", "adam")
DP_LEVELS = ("sample", "client")


@dataclass(frozen=True)
class DPSettings:
    """DP-SGD on the client (level `sample`) or user-level DP-FedAvg (level `client`), spec §13.

    Each unit's gradient (a sample's, or a client's whole update) is clipped to `clip`, Gaussian noise of
    standard deviation noise_multiplier · clip is added to the sum, each unit takes part in a step with
    probability `sample_rate` (Poisson sampling), over `steps` steps. `prior` is κ, an attack's success
    probability without the update; `max_reconstruction` the policy's ceiling on the bound B(κ) (None: no rule).
    """

    noise_multiplier: float
    clip: float = 1.0
    sample_rate: float = 1.0
    steps: int = 1
    delta: float = 1e-5
    level: str = "sample"
    prior: float = 0.01
    max_reconstruction: float | None = None


@dataclass(frozen=True)
class Round:
    """What one client sends in one federated round (spec §12). FedSGD is local_samples == batch_size, one epoch.

    Built once from flags and [tool.rankaudit.round] and handed to every step; nothing else re-derives it.
    """

    batch_size: int = 1
    local_samples: int | None = None      # N; None: the batch size (one step per epoch)
    local_epochs: int = 1                 # E
    lr: float = 0.1                       # η
    optimizer: str = "sgd"                # sgd | adam
    momentum: float = 0.0                 # μ, SGD only
    clients: int = 1                      # C under secure aggregation; 1: none
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
    def fedsgd(self) -> bool:
        """One gradient of one batch from one client: exactly the single-gradient analysis."""
        return self.steps == 1 and self.clients == 1

    @property
    def secure_aggregation(self) -> bool:
        return self.clients > 1


FEDSGD = Round()
