"""The inputs a verifier feeds the real model: real images where the input is one, else seeded values; labels."""

from __future__ import annotations

import torch

from rankaudit.errors import UsageError
from rankaudit.result import Result


def real_inputs(result: Result, data: str | None, count: int, seed: int) -> tuple[torch.Tensor, str]:
    """Real images where the input is one (1 or 3 channels, or --data given); seeded uniform values otherwise."""
    return inputs_of_shape(tuple(result.input_shape), data, count, seed)


def inputs_of_shape(shape: tuple[int, ...], data: str | None, count: int, seed: int) -> tuple[torch.Tensor, str]:
    """real_inputs for a per-sample shape (the design review measures models it has no Result of)."""
    from rankaudit.bound import images as image_data

    if data is not None or (len(shape) == 3 and shape[0] in (1, 3)):
        try:
            images, source = image_data.load_images(data, shape, count, seed)
        except image_data.DataError as exc:
            raise UsageError(str(exc)) from exc
        return images.to(torch.float64), source
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.rand((count, *shape), generator=generator, dtype=torch.float64),
        f"{count} seeded uniform random inputs on [0, 1] (the input is not an image; --data gives real ones)",
    )


def images_to_attack(data: str | None, count: int) -> int:
    """--data that holds fewer images than asked for (one, say) is attacked whole: the record names how many."""
    from rankaudit.bound import images as image_data

    held = image_data.held_images(data) if data is not None else None
    return min(count, held) if held else count


def round_inputs(result: Result, data: str | None, seed: int, what: str) -> tuple[torch.Tensor, str]:
    """C·N inputs shaped (C, N, *sample): real images where the input is one, seeded uniform values otherwise."""
    round_ = result.round
    if result.inputs and (len(result.inputs) != 1 or result.inputs[0].role != "data"):
        raise UsageError(
            f"--verify {what} for a round differentiates the update with respect to one real-valued "
            "input, and this model takes several or token ids",
            "verify a model with a single float input",
        )
    flat, source = real_inputs(result, data, round_.clients * round_.samples, seed)
    return flat.reshape(round_.clients, round_.samples, *flat.shape[1:]), source
