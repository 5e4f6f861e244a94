"""The client's local training as a differentiable function of its data: the update one round sends (spec §12).

Pure functions of (parameters, inputs) built on ``torch.func``, so that the rank check can take vector-Jacobian
products through the whole unrolled training and the attack can batch candidates and clients with ``vmap``.
The model runs in eval mode (BatchNorm on its running statistics, as every other verifier does); each step's
loss is the mean over its mini-batch; the batch order is fixed and the same in every epoch (samples 0..B-1 first).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from rankaudit.round import Round
from rankaudit.verify.rank.jacobian import _loss

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


class LocalTraining:
    """u(X) = Σ_c (θ_K(X_c) − θ₀) over the shared parameters, for a model whose weights θ₀ are the server's.

    ``update(X, labels)`` takes X of shape (C, N, *sample) and labels (C, N) and returns the aggregated update
    as one flat vector of |θ_s| values (the shared parameters in ``shared`` order). Frozen parameters stay fixed;
    every trainable one is trained (a withheld layer's weights move too and later steps read them), only the shared
    ones are sent.
    """

    def __init__(self, net: nn.Module, round_: Round, loss: str, shared: list[str]):
        from torch.func import functional_call, grad

        self.round = round_
        self.shared = list(shared)
        parameters = {name: p.detach() for name, p in net.named_parameters()}
        self.trainable = [name for name, p in net.named_parameters() if p.requires_grad]
        self.initial = {name: parameters[name] for name in self.trainable}
        frozen = {name: p for name, p in parameters.items() if name not in self.initial}
        buffers = {name: b.detach() for name, b in net.named_buffers()}
        self.values = sum(self.initial[name].numel() for name in self.shared)

        def batch_loss(weights, inputs, labels):
            output = functional_call(net, ({**frozen, **weights}, buffers), (inputs,))
            return _loss(output, labels, loss)

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

    def trajectory(self, inputs: torch.Tensor, labels: torch.Tensor) -> list[dict[str, torch.Tensor]]:
        """One client's trainable weights θ₀, θ₁, ..., θ_K: step k reads batches()[k] at θ_k (the bias readout
        matches a deeper layer's candidates to the features each step saw)."""
        weights = dict(self.initial)
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
        """Σ_c u_c: what the server sees; the clients run side by side under vmap."""
        from torch.func import vmap

        if inputs.shape[0] == 1:
            return self.client_update(inputs[0], labels[0])
        return vmap(self.client_update)(inputs, labels).sum(0)


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
    """Raise the right error when the round's local training, in float32 as clients run it, is not finite (issue 23),
    before any sketch or attack.

    At the starting weights a non-finite gradient is the model's (exit 3, the op named). After the weights moved, the
    training is run again at a millionth of --lr: still non-finite, the model breaks as soon as its weights move
    (exit 3, the op named at those weights); finite, the step size made it diverge (exit 2, lower --lr).
    """
    import copy
    import dataclasses

    from torch.func import functional_call

    from rankaudit.errors import UsageError
    from rankaudit.verify import finite

    # In float32, as clients train: the rank check's float64 would carry an --lr that no client's training survives
    # (issue 23: --verify rank passed at --lr 1e305 where rgap's float32 attack diverged).
    net = copy.deepcopy(net).to(torch.float32)
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
        return output, _loss(output, y, loss)

    where = "at the starting weights" if step == 1 else f"once local training has moved the weights (step {step})"
    error = finite.locate(f"{verifier}, {where}", net, rerun, list(leaves.values()))
    raise error
