"""Gradient defenses a client can apply before sharing, for the verifier to attack: noise, pruning, AdaDefense.

A :class:`Defense` maps the gradient a client would share (parameter name -> tensor) to what it shares instead:

- ``noise:SIGMA``: Gaussian noise N(0, SIGMA^2) added to every entry (DLG's "noisy gradients" defense).
- ``prune:P``: in every parameter tensor, the fraction P of entries with the smallest magnitude set to zero
  (DLG's "gradient compression"/pruning defense).
- ``adadefense``: the Adam stand-in m̂/(√v̂ + ε) of AdaDefense (Hu et al., "Gradients Stand-in for Defending
  Deep Leakage in Federated Learning", Eq. 1-5), with the moments m, v kept on the client.

``Defense.apply(grads, state)`` is one step of the client; ``state`` holds what the client keeps locally between
rounds (its random generator, or its Adam moments and step count) and comes from ``Defense.new_state(seed)``.
``Defense.client(seed)`` wraps that into the plain ``grads -> grads`` callable the attacks take (their
``defense=`` argument): each call is one attacked round, see :class:`ClientDefense` for what state it starts from.

:func:`fedavg_accuracy` trains a small MLP on scikit-learn's digits with FedAvg, each client sharing its defended
update, and returns the test accuracy: the price of a defense in utility.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.errors import UsageError

__all__ = [
    "DEFENSES",
    "DEFAULT_NOISE_SIGMA",
    "DEFAULT_PRUNE_FRACTION",
    "ADAM_BETA1",
    "ADAM_BETA2",
    "ADAM_EPS",
    "ADADEFENSE_SERVER_LR",
    "Defense",
    "DefenseError",
    "ClientDefense",
    "parse_defense",
    "fedavg_accuracy",
]

Grads = dict[str, torch.Tensor]

DEFENSES = ("noise", "prune", "adadefense")

# σ = 0.01, variance 1e-4: the mildest Gaussian noise in DLG's defense study (Zhu et al. 2019), where DLG still
# leaked; AdaDefense's related work quotes variance above 1e-2 as what stops DLG, "at the cost of significant
# performance degradation". The default asks whether the attacks survive a mild, training-friendly level (FedAvg on
# digits: 96.8 % with it, 97.0 % without). σ is absolute, as in DLG, so its strength depends on the gradient's
# scale: the verifier reports σ against the RMS of each attacked gradient (untrained CNN6: σ is about 50× it).
DEFAULT_NOISE_SIGMA = 0.01
# 90 % pruned: DLG reports its attack fails once more than about 20 % of the gradient is pruned, while gradient
# compression schemes send 1 % or less; 0.9 sits between what stopped DLG and what compression does in practice.
DEFAULT_PRUNE_FRACTION = 0.9
# Adam's defaults, which AdaDefense uses (Sec. III-B: β1 = 0.9, β2 = 0.999, ε small).
ADAM_BETA1 = 0.9
ADAM_BETA2 = 0.999
ADAM_EPS = 1e-8
# The server applies the averaged stand-ins with Adam's step size α = 1e-3, as AdaDefense's code scales the
# stand-in (scale = 0.001) before FedAvg averages the clients' models (Eq. 19 with the stand-in for g_i).
ADADEFENSE_SERVER_LR = 1e-3


class DefenseError(UsageError, ValueError):
    """A malformed --defense value (exit 2 through the CLI). ``problem`` says what is wrong, ``fix`` what to write
    instead; ``str()`` is "problem; fix: fix"."""


@dataclass(frozen=True)
class Defense:
    """One defense with its strength. ``param`` is the headline strength (σ, the pruned fraction, or ε for
    AdaDefense); ``options`` the rest (AdaDefense: beta1, beta2, eps, warmup)."""

    name: str
    param: float | None
    description: str
    options: dict = field(default_factory=dict, hash=False)

    @property
    def label(self) -> str:
        """Short form for tables: 'noise σ=0.01', 'prune 90%', 'adadefense'."""
        if self.name == "noise":
            return f"noise σ={self.param:g}"
        if self.name == "prune":
            percent = self.param * 100
            return f"prune {round(percent)}%" if abs(percent - round(percent)) < 1e-9 else f"prune {self.param:g}"
        extras = [f"{k}={v:g}" for k, v in self.options.items() if v != _ADADEFENSE_DEFAULTS.get(k)]
        return "adadefense" + (f" ({', '.join(extras)})" if extras else "")

    @property
    def spec(self) -> str:
        """The --defense value that gives this defense back."""
        if self.name in ("noise", "prune"):
            return f"{self.name}:{self.param:g}"
        extras = [f"{k}={v:g}" for k, v in self.options.items() if v != _ADADEFENSE_DEFAULTS.get(k)]
        return "adadefense" + (":" + ",".join(extras) if extras else "")

    # -- the client's local state and one step -----------------------------------------------------------------

    def new_state(self, seed: int = 0) -> dict:
        """What the client keeps locally: a seeded generator (noise), Adam's moments and step (AdaDefense)."""
        if self.name == "noise":
            return {"generator": torch.Generator().manual_seed(int(seed))}
        if self.name == "adadefense":
            return {"m": {}, "v": {}, "t": 0}
        return {}

    def apply(self, grads: Grads, state: dict | None = None) -> Grads:
        """What the client shares instead of ``grads``; advances ``state`` (a fresh one when None)."""
        if state is None:
            state = self.new_state()
        if self.name == "noise":
            return {name: _add_noise(g, self.param, state["generator"]) for name, g in grads.items()}
        if self.name == "prune":
            return {name: _prune(g, self.param) for name, g in grads.items()}
        if self.name == "adadefense":
            return _adam_stand_in(grads, state, self.options["beta1"], self.options["beta2"], self.options["eps"])
        raise DefenseError(f"unknown defense {self.name!r}", f"use one of {', '.join(DEFENSES)}")

    def client(self, seed: int = 0, warmup: list[Grads] | None = None) -> ClientDefense:
        """The ``grads -> grads`` callable the attacks take; see :class:`ClientDefense`."""
        return ClientDefense(self, seed, warmup)

    def __call__(self, grads: Grads) -> Grads:
        """One attacked round from a fresh client (seed 0): ``defense.client()(grads)``."""
        return self.apply(grads, self.new_state(0))


class ClientDefense:
    """A client applying ``defense`` to each gradient it is attacked on (one call = one attacked round).

    noise: one generator for the client, so every call draws fresh noise, the same for the same seed.
    prune: stateless.
    adadefense: every call starts from the same local moments: Adam's zero moments (the client's first round,
    the paper's own leakage test), or the moments after the ``warmup`` gradients (earlier rounds on other data);
    the attacked gradient is then one more Adam step, whose stand-in is shared. Starting each call afresh keeps
    the attacked images independent of each other's order.
    """

    def __init__(self, defense: Defense, seed: int = 0, warmup: list[Grads] | None = None):
        self.defense = defense
        self.seed = int(seed)
        self._state = defense.new_state(seed)
        self._warm: dict | None = None
        if defense.name == "adadefense":
            state = defense.new_state(seed)
            for grads in warmup or []:
                defense.apply(grads, state)
            self._warm = state
        self.warmup_rounds = len(warmup or [])

    def __call__(self, grads: Grads) -> Grads:
        if self._warm is not None:
            return self.defense.apply(grads, _copy_state(self._warm))
        return self.defense.apply(grads, self._state)


def _copy_state(state: dict) -> dict:
    return {
        "m": {k: v.clone() for k, v in state["m"].items()},
        "v": {k: v.clone() for k, v in state["v"].items()},
        "t": state["t"],
    }


def _add_noise(g: torch.Tensor, sigma: float, generator: torch.Generator) -> torch.Tensor:
    # Drawn on the CPU in float64 from the client's own generator, so the noise is the same on every device.
    noise = torch.randn(g.shape, generator=generator, dtype=torch.float64)
    return g + (sigma * noise).to(device=g.device, dtype=g.dtype)


def _prune(g: torch.Tensor, fraction: float) -> torch.Tensor:
    flat = g.reshape(-1)
    count = int(math.floor(fraction * flat.numel() + 1e-9))
    if count <= 0:
        return g.clone()
    # Exactly `count` entries: the smallest magnitudes, ties broken by position (stable sort).
    order = torch.argsort(flat.abs(), stable=True)
    pruned = flat.clone()
    pruned[order[:count]] = 0
    return pruned.reshape(g.shape)


def _adam_stand_in(grads: Grads, state: dict, beta1: float, beta2: float, eps: float) -> Grads:
    """AdaDefense Eq. 1-5 for every tensor: update the local moments with g, share m̂ / (√v̂ + ε)."""
    state["t"] += 1
    t = state["t"]
    shared = {}
    for name, g in grads.items():
        m = state["m"].get(name)
        v = state["v"].get(name)
        if m is None:
            m = torch.zeros_like(g)
            v = torch.zeros_like(g)
        else:
            # Warm-up rounds may have run on another device or in another precision than this gradient.
            m, v = m.to(device=g.device, dtype=g.dtype), v.to(device=g.device, dtype=g.dtype)
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        state["m"][name], state["v"][name] = m, v
        m_hat = m / (1 - beta1**t)
        v_hat = v / (1 - beta2**t)
        shared[name] = m_hat / (v_hat.sqrt() + eps)
    return shared


# --------------------------------------------------------------------------- parsing --defense values

_ADADEFENSE_DEFAULTS = {"beta1": ADAM_BETA1, "beta2": ADAM_BETA2, "eps": ADAM_EPS, "warmup": 0}
_ADADEFENSE_KEYS = {
    "beta1": "beta1",
    "b1": "beta1",
    "beta2": "beta2",
    "b2": "beta2",
    "eps": "eps",
    "epsilon": "eps",
    "warmup": "warmup",
}
_USAGE = "write noise[:SIGMA], prune[:FRACTION] or adadefense[:BETA2 | EPS | key=value,...]"


def _number(text: str, what: str, spec: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise DefenseError(f"--defense {spec}: {what} {text!r} is not a number", _USAGE) from None
    if not math.isfinite(value):
        raise DefenseError(f"--defense {spec}: {what} must be finite, got {text}", _USAGE)
    return value


def parse_defense(spec: str) -> Defense:
    """``"noise"``, ``"noise:0.05"``, ``"prune:0.99"``, ``"adadefense"``, ``"adadefense:0.99"`` (β2),
    ``"adadefense:1e-6"`` (ε), ``"adadefense:eps=1e-6,beta2=0.99,warmup=5"`` -> a :class:`Defense`.

    A bare AdaDefense number in [0.5, 1) is β2, one in (0, 0.5) is ε. Raises :class:`DefenseError` (a ValueError)
    naming the problem and the fix.
    """
    text = str(spec).strip()
    name, sep, param = text.partition(":")
    name = name.strip().lower()
    param = param.strip()
    if name in ("gaussian", "dp"):
        name = "noise"
    if name in ("pruning", "compression"):
        name = "prune"
    if name in ("ada", "ad", "ada-defense", "ada_defense"):
        name = "adadefense"
    if name not in DEFENSES:
        raise DefenseError(
            f"--defense {text}: unknown defense {name!r}", f"use one of noise, prune, adadefense ({_USAGE})"
        )
    if sep and not param:
        raise DefenseError(f"--defense {text}: nothing after the colon", _USAGE)
    if name == "noise":
        sigma = _number(param, "sigma", text) if param else DEFAULT_NOISE_SIGMA
        if sigma <= 0:
            raise DefenseError(
                f"--defense {text}: sigma must be positive, got {sigma:g}",
                "give the noise's standard deviation, e.g. noise:0.01",
            )
        return Defense("noise", sigma, f"Gaussian noise N(0, {sigma:g}²) added to every gradient entry")
    if name == "prune":
        fraction = _number(param, "fraction", text) if param else DEFAULT_PRUNE_FRACTION
        if fraction > 1 and fraction < 100:
            fraction_hint = f"prune:{fraction / 100:g}"
            raise DefenseError(
                f"--defense {text}: the pruned fraction must lie in [0, 1), got {fraction:g}",
                f"give a fraction, e.g. {fraction_hint} for {fraction:g}%",
            )
        if not 0 <= fraction < 1:
            raise DefenseError(
                f"--defense {text}: the pruned fraction must lie in [0, 1), got {fraction:g}",
                "give a fraction, e.g. prune:0.9 to zero the 90% smallest entries",
            )
        return Defense(
            "prune", fraction, f"the {fraction:.0%} smallest-magnitude entries of every gradient tensor set to zero"
        )
    options = dict(_ADADEFENSE_DEFAULTS)
    for item in (p.strip() for p in param.split(",")) if param else ():
        if not item:
            raise DefenseError(f"--defense {text}: empty item in the parameter list", _USAGE)
        key, eq, value = item.partition("=")
        if eq:
            canonical = _ADADEFENSE_KEYS.get(key.strip().lower())
            if canonical is None:
                raise DefenseError(
                    f"--defense {text}: unknown AdaDefense option {key.strip()!r}",
                    "use beta1=, beta2=, eps= or warmup=",
                )
            options[canonical] = _number(value.strip(), canonical, text)
        else:
            number = _number(key, "parameter", text)
            if 0.5 <= number < 1:
                options["beta2"] = number
            elif 0 < number < 0.5:
                options["eps"] = number
            else:
                raise DefenseError(
                    f"--defense {text}: a bare AdaDefense parameter is β2 in [0.5, 1) or ε in (0, 0.5), got {number:g}",
                    "write adadefense:beta2=... or adadefense:eps=...",
                )
    for key in ("beta1", "beta2"):
        if not 0 <= options[key] < 1:
            raise DefenseError(
                f"--defense {text}: {key} must lie in [0, 1), got {options[key]:g}",
                f"e.g. adadefense:{key}={_ADADEFENSE_DEFAULTS[key]:g}",
            )
    if options["eps"] <= 0:
        raise DefenseError(
            f"--defense {text}: eps must be positive, got {options['eps']:g}", "e.g. adadefense:eps=1e-8"
        )
    warmup = options["warmup"]
    if warmup < 0 or warmup != int(warmup) or warmup > 1000:
        raise DefenseError(
            f"--defense {text}: warmup counts earlier rounds, a whole number 0-1000, got {warmup:g}",
            "e.g. adadefense:warmup=5",
        )
    options["warmup"] = int(warmup)
    description = (
        f"the client shares Adam's stand-in m̂/(√v̂+ε) (β1={options['beta1']:g}, "
        f"β2={options['beta2']:g}, ε={options['eps']:g}) instead of its gradient, moments kept local; "
        + (
            "attacked in its first round (zero moments)"
            if not options["warmup"]
            else f"attacked after {options['warmup']} earlier rounds on other data"
        )
    )
    return Defense("adadefense", options["eps"], description, options)


# --------------------------------------------------------------------------- the price: FedAvg with the defense

# FedAvg set-up: small enough to train in seconds on a CPU, big enough that a broken update rule shows.
FEDAVG_ROUNDS = 300
FEDAVG_CLIENTS = 4
FEDAVG_LOCAL_STEPS = 5
FEDAVG_LOCAL_LR = 0.1
FEDAVG_LOCAL_BATCH = 32
_TEST_FRACTION = 0.3
_HIDDEN = (128, 64)


def _digits_train_test(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    gen = torch.Generator().manual_seed(int(seed))
    train, test = [], []
    # Stratified: the same share of every class in the test set.
    for c in range(10):
        idx = torch.nonzero(y == c).squeeze(1)
        idx = idx[torch.randperm(len(idx), generator=gen)]
        cut = int(round(len(idx) * _TEST_FRACTION))
        test.append(idx[:cut])
        train.append(idx[cut:])
    train_idx = torch.cat(train)
    train_idx = train_idx[torch.randperm(len(train_idx), generator=gen)]
    test_idx = torch.cat(test)
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


def _small_mlp(seed: int) -> nn.Module:
    torch.manual_seed(int(seed))
    widths = (64,) + _HIDDEN
    layers: list[nn.Module] = []
    for width_in, width_out in zip(widths, widths[1:]):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    layers.append(nn.Linear(widths[-1], 10))
    return nn.Sequential(*layers)


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((model(x).argmax(1) == y).double().mean())


def fedavg_accuracy(
    defense: Defense | None,
    rounds: int = FEDAVG_ROUNDS,
    clients: int = FEDAVG_CLIENTS,
    seed: int = 0,
    *,
    local_steps: int = FEDAVG_LOCAL_STEPS,
    local_lr: float = FEDAVG_LOCAL_LR,
    batch_size: int = FEDAVG_LOCAL_BATCH,
    server_lr: float | None = None,
) -> dict:
    """Train a 64-128-64-10 ReLU MLP on scikit-learn's digits (8x8, 1,797 images, 30 % held out) with FedAvg.

    Every round each client starts from the global model, takes ``local_steps`` SGD steps (lr ``local_lr``,
    minibatches of ``batch_size`` from its own IID shard) and shares its update Δ = w_global − w_local, passed
    through ``defense`` with the client's own local state (its Adam moments persist across rounds, never sent).
    The server averages what it receives and applies it: w ← w − server_lr · mean(shared). ``server_lr`` defaults
    to 1 (FedAvg: the mean of the clients' models) and, for AdaDefense, to Adam's step size 1e-3, as in
    AdaDefense's code, which scales the stand-in by 0.001 before averaging. Returns the final test accuracy
    and the set-up. Deterministic for a seed on the CPU.
    """
    if rounds < 1 or clients < 1 or local_steps < 1:
        raise ValueError("rounds, clients and local_steps must be at least 1")
    started = time.perf_counter()
    x_train, y_train, x_test, y_test = _digits_train_test(seed)
    model = _small_mlp(seed)
    gen = torch.Generator().manual_seed(int(seed) + 1)
    shards = torch.arange(len(y_train)).chunk(clients)
    states = [defense.new_state(seed * 1000 + c) if defense is not None else {} for c in range(clients)]
    if server_lr is None:
        server_lr = ADADEFENSE_SERVER_LR if defense is not None and defense.name == "adadefense" else 1.0
    names = [name for name, _ in model.named_parameters()]
    local = copy.deepcopy(model)
    for _ in range(rounds):
        global_params = {name: p.detach().clone() for name, p in model.named_parameters()}
        total = {name: torch.zeros_like(p) for name, p in global_params.items()}
        for c, shard in enumerate(shards):
            local.load_state_dict(model.state_dict())
            for _ in range(local_steps):
                pick = shard[torch.randint(len(shard), (min(batch_size, len(shard)),), generator=gen)]
                loss = F.cross_entropy(local(x_train[pick]), y_train[pick])
                grads = torch.autograd.grad(loss, list(local.parameters()))
                with torch.no_grad():
                    for p, g in zip(local.parameters(), grads):
                        p -= local_lr * g
            update = {name: global_params[name] - p.detach() for name, p in local.named_parameters()}
            shared = defense.apply(update, states[c]) if defense is not None else update
            for name in names:
                total[name] += shared[name]
        with torch.no_grad():
            for name, p in model.named_parameters():
                p -= server_lr * total[name] / clients
    return {
        "accuracy": _accuracy(model, x_test, y_test),
        "train_accuracy": _accuracy(model, x_train, y_train),
        "rounds": rounds,
        "clients": clients,
        "local_steps": local_steps,
        "local_lr": local_lr,
        "batch_size": batch_size,
        "server_lr": server_lr,
        "seed": seed,
        "defense": defense.spec if defense is not None else None,
        "model": "MLP 64-128-64-10 (ReLU)",
        "data": f"scikit-learn digits 8x8 ({len(y_train)} train / {len(y_test)} test images, IID shards)",
        "seconds": round(time.perf_counter() - started, 3),
    }
