"""The client's loss and labels, and its local training as a differentiable function of its data: the update one
round sends (method.md: the round).

Pure functions of (parameters, inputs) built on ``torch.func``, so that the rank check can take vector-Jacobian
products through the whole unrolled training and the attack can batch candidates and clients with ``vmap``.
The model runs as the client trains it in the BatchNorm mode the bound covers (client_mode: BatchNorm on each
batch's own statistics in training mode, the default; on running statistics with --bn-mode eval; every other
module in eval mode, so dropout is off); each step's loss is the mean over its mini-batch; the batch order is fixed
and the same in every epoch (samples 0..B-1 first). Over several server rounds (method.md: the round) the weights move between
rounds by the clients' own updates and by a fixed random step that stands for the other clients' (independent of
the samples).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.settings.round import Round

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
# The other clients' step between two server rounds, per weight tensor: this share of its mean magnitude, in a
# random direction fixed by the seed. It only has to move the weights; its size does not enter the bound.
OTHER_CLIENTS_STEP = 0.05
# Server rounds the verifiers simulate at most: each one multiplies the sketch's cost; a rank measured over fewer
# rounds than the bound counts still sits under it (it can only grow with more rounds).
MAX_SIMULATED_ROUNDS = 8


def logits_of(output) -> torch.Tensor:
    """The logits of a forward pass: the tensor itself, a model output's .logits, or a tuple's first element."""
    if isinstance(output, torch.Tensor):
        return output
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UsageError(
        f"the model returns {type(output).__name__}, not logits",
        "return the logits tensor (or an object with .logits) from forward()",
    )


def mean_loss(output, labels: torch.Tensor, loss: str) -> torch.Tensor:
    """The mean loss of a batch's output against its labels, by the loss's name."""
    logits = logits_of(output).reshape(labels.shape[0], -1)
    if loss == "logistic":
        return F.softplus(-labels.to(logits.dtype) * logits[:, 0]).mean()
    return F.cross_entropy(logits, labels)


def loss_name_for(logits_per_sample: int) -> str:
    """The convention of the other attacks: one logit -> the logistic loss, several -> cross-entropy."""
    return "logistic" if logits_per_sample == 1 else "cross-entropy"


def draw_labels(count: int, loss: str, classes: int, seed: int) -> torch.Tensor:
    """Seeded labels as R-GAP draws them: ±1 for the logistic loss, a class index for cross-entropy."""
    generator = torch.Generator().manual_seed(seed)
    labels = []
    for _ in range(count):
        if loss == "logistic":
            labels.append(1 if torch.rand((), generator=generator) < 0.5 else -1)
        else:
            labels.append(int(torch.randint(classes, (), generator=generator)))
    return torch.tensor(labels, dtype=torch.long)


def round_labels(model, inputs: torch.Tensor, seed: int) -> tuple[torch.Tensor, str]:
    """Labels for a round's (C, N) inputs, drawn as draw_labels draws them, and the loss they go with."""
    with torch.no_grad():
        logits = logits_of(model(inputs[0, :1])).numel()
    loss = loss_name_for(logits)
    count = inputs.shape[0] * inputs.shape[1]
    return draw_labels(count, loss, logits, seed).reshape(inputs.shape[:2]), loss


def client_mode(net: nn.Module, bn_mode: str) -> nn.Module:
    """`net` as a client trains it: eval mode (no dropout), BatchNorm in training mode on each batch's own mean and
    variance when `bn_mode` is "train" (without updating running statistics: the update does not read them, and an
    in-place buffer write cannot run under torch.func's transforms), else on its running statistics."""
    net.eval()
    if bn_mode == "train":
        for module in net.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.train()
                module.track_running_stats = False
    return net


def simulated_rounds(round_: Round) -> int:
    """The server rounds a verifier simulates: the rounds the bound counts, at most MAX_SIMULATED_ROUNDS."""
    return min(round_.rounds_counted, MAX_SIMULATED_ROUNDS)


class LocalTraining:
    """u(X) = Σ_c (θ_K(X_c) − θ₀) over the shared parameters, for a model whose weights θ₀ are the server's.

    ``update(X, labels)`` takes X of shape (C, N, *sample) and labels (C, N) and returns the aggregated update
    as one flat vector of |θ_s| values (the shared parameters in ``shared`` order). Frozen parameters stay fixed;
    every trainable one is trained (a withheld layer's weights move too and later steps read them), only the shared
    ones are sent. With ``rounds`` > 1 it returns every round's update, one after the other (rounds·|θ_s| values):
    the next round starts from the weights the clients' mean update and the other clients' step (a fixed random
    one, ``seed``) moved to.
    """

    def __init__(self, net: nn.Module, round_: Round, loss: str, shared: list[str], rounds: int = 1, seed: int = 0):
        from torch.func import functional_call, grad

        self.round = round_
        self.rounds = rounds
        self.shared = list(shared)
        parameters = {name: p.detach() for name, p in net.named_parameters()}
        self.trainable = [name for name, p in net.named_parameters() if p.requires_grad]
        self.initial = {name: parameters[name] for name in self.trainable}
        frozen = {name: p for name, p in parameters.items() if name not in self.initial}
        buffers = {name: b.detach() for name, b in net.named_buffers()}
        self.values = rounds * sum(self.initial[name].numel() for name in self.shared)
        generator = torch.Generator().manual_seed(seed)
        self.other_clients = [
            {name: _other_step(weight, generator) for name, weight in self.initial.items()} for _ in range(rounds - 1)
        ]

        def batch_loss(weights, inputs, labels):
            output = functional_call(net, ({**frozen, **weights}, buffers), (inputs,))
            return mean_loss(output, labels, loss)

        self._gradient: Callable = grad(batch_loss)

    def batches(self) -> list[slice]:
        """The slices of a client's N samples each local step reads, in order."""
        size, samples = self.round.batch_size, self.round.samples
        epoch = [slice(start, min(start + size, samples)) for start in range(0, samples, size)]
        return epoch * self.round.local_epochs

    def client_update(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """One client's θ_K − θ₀ over the shared parameters, flat; inputs (N, *sample), labels (N)."""
        weights = self.trajectory(inputs, labels)[-1]
        return torch.cat([(weights[name] - self.initial[name]).reshape(-1) for name in self.shared])

    def trajectory(
        self, inputs: torch.Tensor, labels: torch.Tensor, start: dict[str, torch.Tensor] | None = None
    ) -> list[dict[str, torch.Tensor]]:
        """One client's trainable weights θ₀, θ₁, ..., θ_K: step k reads batches()[k] at θ_k (the bias readout
        matches a deeper layer's candidates to the features each step saw). θ₀ is the server's (`start`, default
        the model's own weights)."""
        weights = dict(self.initial if start is None else start)
        path = [weights]
        state: dict[str, tuple[torch.Tensor, ...]] = {}
        for step, part in enumerate(self.batches(), start=1):
            gradients = self._gradient(weights, inputs[part], labels[part])
            weights = {name: self._step(name, weights[name], gradients[name], state, step) for name in weights}
            path.append(weights)
        return path

    def _step(self, name: str, weight: torch.Tensor, gradient: torch.Tensor, state: dict, step: int) -> torch.Tensor:
        """torch.optim's SGD (momentum μ, no dampening or weight decay) and Adam, as differentiable arithmetic."""
        lr = self.round.lr
        if self.round.optimizer == "sgd":
            if not self.round.momentum:
                return weight - lr * gradient
            velocity = gradient if name not in state else self.round.momentum * state[name][0] + gradient
            state[name] = (velocity,)
            return weight - lr * velocity
        beta1, beta2 = ADAM_BETAS
        first, second = state.get(name, (torch.zeros_like(gradient), torch.zeros_like(gradient)))
        first = beta1 * first + (1 - beta1) * gradient
        second = beta2 * second + (1 - beta2) * gradient * gradient
        state[name] = (first, second)
        corrected = second / (1 - beta2**step)
        # sqrt has an infinite slope at 0: where a gradient is exactly zero (a dead unit) its update is zero too,
        # and the safe form keeps the derivative there finite (0) instead of 0 x inf = NaN.
        positive = corrected > 0
        root = torch.where(
            positive,
            torch.sqrt(torch.where(positive, corrected, torch.ones_like(corrected))),
            torch.zeros_like(corrected),
        )
        return weight - lr / (1 - beta1**step) * first / (root + ADAM_EPS)

    def update(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Σ_c u_c: what the server sees; the clients run side by side under vmap. Over several rounds, every
        round's Σ_c u_c in order."""
        from torch.func import vmap

        if self.rounds == 1:
            if inputs.shape[0] == 1:
                return self.client_update(inputs[0], labels[0])
            return vmap(self.client_update)(inputs, labels).sum(0)
        start, sent = dict(self.initial), []
        for round_index in range(self.rounds):
            if inputs.shape[0] == 1:
                reached = {name: w[None] for name, w in self.trajectory(inputs[0], labels[0], start)[-1].items()}
            else:
                reached = vmap(lambda x, y, start=start: self.trajectory(x, y, start)[-1])(inputs, labels)
            moved = {name: reached[name] - start[name] for name in start}
            sent.append(torch.cat([moved[name].sum(0).reshape(-1) for name in self.shared]))
            if round_index < self.rounds - 1:
                others = self.other_clients[round_index]
                start = {name: start[name] + moved[name].mean(0) + others[name] for name in start}
        return torch.cat(sent)


def _other_step(weight: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """The other clients' contribution to one weight tensor between two rounds: it does not depend on this
    client's samples (OTHER_CLIENTS_STEP of the tensor's mean magnitude, in a random direction)."""
    scale = float(weight.detach().abs().mean()) or 1.0
    direction = torch.randn(weight.shape, generator=generator, dtype=torch.float64)
    return (OTHER_CLIENTS_STEP * scale * direction).to(device=weight.device, dtype=weight.dtype)


def unknowns_of(round_: Round, sample_shape: tuple[int, ...]) -> int:
    """n = C·N·|x|."""
    return round_.clients * round_.samples * math.prod(sample_shape)


# A sliver of the user's learning rate: the weights move in the same direction, by a millionth as much.
_SLIVER = 1e-6


def _first_non_finite_step(training: LocalTraining, inputs: torch.Tensor, labels: torch.Tensor):
    """(client, step, weights it starts from, 'gradient' | 'step') of the first local step whose gradient or new
    weights are not finite, or None when the whole round is finite. inputs (C, N, *sample), labels (C, N)."""
    from rankaudit.verify.finite import all_finite

    for client in range(inputs.shape[0]):
        weights, state = dict(training.initial), {}
        for step, part in enumerate(training.batches(), start=1):
            gradients = training._gradient(weights, inputs[client, part], labels[client, part])
            if not all_finite(list(gradients.values())):
                return client, step, weights, "gradient"
            moved = {name: training._step(name, weights[name], gradients[name], state, step) for name in weights}
            if not all_finite(list(moved.values())):
                return client, step, weights, "step"
            weights = moved
    return None


def check_local_training(
    net: nn.Module, round_: Round, loss: str, inputs: torch.Tensor, labels: torch.Tensor, verifier: str
) -> None:
    """Raise the right error when the round's local training, in float32 as clients run it, is not finite,
    before any sketch or attack.

    At the starting weights a non-finite gradient is the model's (exit 3, the op named). After the weights moved, the
    training is run again at a millionth of --lr: still non-finite, the model breaks as soon as its weights move
    (exit 3, the op named at those weights); finite, the step size made it diverge (exit 2, lower --lr).
    """
    import copy
    import dataclasses

    from torch.func import functional_call

    from rankaudit.verify import finite

    # In float32, as clients train: the rank check's float64 would carry an --lr that no client's training survives
    # (--verify rank passed at --lr 1e305 where rgap's float32 attack diverged).
    net = client_mode(copy.deepcopy(net).to(torch.float32), round_.bn_mode)
    inputs = inputs.to(torch.float32) if inputs.is_floating_point() else inputs
    with torch.no_grad():
        training = LocalTraining(net, round_, loss, [])
        found = _first_non_finite_step(training, inputs, labels)
        if found is None:
            return
        client, step, weights, what = found
        if step > 1 or what == "step":
            gentle = LocalTraining(net, dataclasses.replace(round_, lr=round_.lr * _SLIVER), loss, [])
            again = _first_non_finite_step(gentle, inputs, labels)
            if again is None or (again[1] == 1 and again[3] == "step"):
                raise UsageError(
                    f"{verifier}: the local training diverges at --lr {round_.lr:g}: step {step} of client "
                    f"{client + 1} gives non-finite {'weights' if what == 'step' else 'gradients'}, while a "
                    f"millionth of that rate stays finite",
                    "lower --lr (the default is 0.1) or --local-epochs",
                )
            client, step, weights, what = again
    part = training.batches()[step - 1]
    x, y = inputs[client, part], labels[client, part]
    leaves = {name: weight.detach().clone().requires_grad_(True) for name, weight in weights.items()}
    buffers = {name: b.detach() for name, b in net.named_buffers()}
    frozen = {name: p.detach() for name, p in net.named_parameters() if name not in leaves}

    def rerun():
        output = functional_call(net, ({**frozen, **leaves}, buffers), (x,))
        return output, mean_loss(output, y, loss)

    where = "at the starting weights" if step == 1 else f"once local training has moved the weights (step {step})"
    error = finite.locate(f"{verifier}, {where}", net, rerun, list(leaves.values()))
    raise error
