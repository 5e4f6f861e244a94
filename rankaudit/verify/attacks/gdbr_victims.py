"""GDBR's victims: batches of real digits in a chosen class mix, the attacker's held-out digits, the client's gradient."""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify import finite

__all__ = [
    "CLASS_DISTRIBUTIONS",
    "victim_batch",
    "held_out_images",
    "init_like_paper",
    "client_gradient",
]

CLASS_DISTRIBUTIONS = ("random", "uniform", "single", "imbalanced")
# Table I leaves "imbalanced" unspecified; halving each next class's weight gives a clearly skewed batch.
_IMBALANCE_RATIO = 0.5
# The attacker's auxiliary data is the held-out share of load_digits, never seen in a victim batch.
_HELD_OUT_FRACTION = 0.3
_DIGITS_SPLIT_SEED = 0


@functools.lru_cache(maxsize=1)
def _digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(_DIGITS_SPLIT_SEED))
    cut = len(labels) - int(len(labels) * _HELD_OUT_FRACTION)
    return images[order[:cut]], labels[order[:cut]], images[order[cut:]], labels[order[cut:]]


def _to_model_shape(images_8x8: torch.Tensor, input_shape: tuple[int, ...]) -> torch.Tensor:
    channels, height, width = (int(s) for s in input_shape)
    resized = F.interpolate(images_8x8.unsqueeze(1), size=(height, width), mode="bilinear", align_corners=False)
    return resized.clamp(0.0, 1.0).expand(-1, channels, -1, -1).contiguous()


def _class_counts(class_dist: str, n_classes: int, batch_size: int, gen: torch.Generator) -> torch.Tensor:
    if class_dist == "uniform":
        counts = torch.full((n_classes,), batch_size // n_classes, dtype=torch.long)
        counts[torch.randperm(n_classes, generator=gen)[: batch_size % n_classes]] += 1
        return counts
    if class_dist == "single":
        counts = torch.zeros(n_classes, dtype=torch.long)
        counts[int(torch.randint(n_classes, (1,), generator=gen))] = batch_size
        return counts
    if class_dist == "imbalanced":
        weights = torch.empty(n_classes, dtype=torch.float64)
        weights[torch.randperm(n_classes, generator=gen)] = _IMBALANCE_RATIO ** torch.arange(
            n_classes, dtype=torch.float64
        )
        draws = torch.multinomial(weights, batch_size, replacement=True, generator=gen)
        return torch.bincount(draws, minlength=n_classes)
    raise ValueError(f"class_dist must be one of {CLASS_DISTRIBUTIONS}, got {class_dist!r}")


def _draw(pool: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    if count <= len(pool):
        return pool[torch.randperm(len(pool), generator=gen)[:count]]
    return pool[torch.randint(len(pool), (count,), generator=gen)]


def victim_batch(
    n_classes: int, input_shape: tuple[int, int, int], batch_size: int, class_dist: str = "random", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """A labelled batch of real digits (scikit-learn's 8x8 ``load_digits``) resized to ``input_shape``.

    Images are bilinearly resized to H x W, lie in [0, 1] and are copied into every channel.
    Labels use classes ``0 .. min(n_classes, 10) - 1``. ``class_dist`` follows Table I of the paper:
    ``random`` draws images uniformly (any class mix), ``uniform`` gives every class the same count
    (the remainder to random classes), ``single`` one random class only, ``imbalanced`` draws classes
    with geometric weights 1, 1/2, 1/4, ... over a random class order. Images come from the victim
    share of the data set; :func:`held_out_images` returns the disjoint rest.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if class_dist not in CLASS_DISTRIBUTIONS:
        raise ValueError(f"class_dist must be one of {CLASS_DISTRIBUTIONS}, got {class_dist!r}")
    images, labels, _, _ = _digits_split()
    n_used = min(int(n_classes), 10)
    if n_used < 1:
        raise ValueError(f"n_classes must be positive, got {n_classes}")
    gen = torch.Generator().manual_seed(int(seed))
    allowed = torch.nonzero(labels < n_used).squeeze(1)
    if class_dist == "random":
        chosen = _draw(allowed, batch_size, gen)
    else:
        counts = _class_counts(class_dist, n_used, batch_size, gen)
        parts = [_draw(torch.nonzero(labels == c).squeeze(1), int(k), gen) for c, k in enumerate(counts.tolist()) if k]
        chosen = torch.cat(parts)
        chosen = chosen[torch.randperm(len(chosen), generator=gen)]
    return _to_model_shape(images[chosen], input_shape), labels[chosen].clone()


def held_out_images(input_shape: tuple[int, int, int], n_classes: int = 10) -> torch.Tensor:
    """The attacker's auxiliary data: the held-out digits (about 54 per class), never in a victim batch."""
    _, _, images, labels = _digits_split()
    return _to_model_shape(images[labels < min(int(n_classes), 10)], input_shape)


def init_like_paper(model: nn.Module, bottom_layers: list[str], seed: int | None = None) -> nn.Module:
    """Weights of ``bottom_layers`` ~ U(0.01, 0.2) and their bias 0, as in Sec. V-A; returns ``model``.

    Positive weights on non-negative inputs keep every unit of these layers active, which is what
    Theorem 1's ReLU steps and the division by ã assume.
    """
    gen = None if seed is None else torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name in bottom_layers:
            layer = model.get_submodule(name)
            weight = getattr(layer, "weight", None)
            if not isinstance(weight, torch.Tensor):
                raise ValueError(f"{name} has no weight to initialise")
            fresh = torch.empty(weight.shape, dtype=weight.dtype).uniform_(0.01, 0.2, generator=gen)
            weight.copy_(fresh)
            if getattr(layer, "bias", None) is not None:
                layer.bias.zero_()
    return model


def client_gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """What a FedSGD client shares: the gradient of the batch-mean cross-entropy (eval mode, so dropout is off)."""
    was_training = model.training
    model.eval()
    try:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]

        def output_and_loss():
            output = model(images)
            return output, F.cross_entropy(output, labels)

        with torch.enable_grad():
            output, loss = output_and_loss()
            grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
        # Label counts read off a NaN gradient are not a result: refuse, naming the op that made it.
        finite.require_finite(
            "--verify gdbr",
            (output, loss),
            grads,
            model=model,
            rerun=output_and_loss,
            parameters=[p for _, p in named],
            inputs=images,
        )
    finally:
        model.train(was_training)
    return {name: (torch.zeros_like(p) if g is None else g).detach() for (name, p), g in zip(named, grads)}
