"""Readouts whose scale the float rounding of the bias update hides: a server that chose the weights knows the
sample's mean or range and puts the scale back. Each leak is judged by a readout written here, blind (no sample
used), from the float32 update the guard lets out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import psnr
from sklearn import datasets
from torch import nn

from rankaudit.guard.decide import Guard

THRESHOLD = 30.0


def in_range(readout: np.ndarray, low: float, high: float) -> np.ndarray:
    """The readout mapped onto the data's known range by its own extremes (either sign): what a server does
    with a readout whose scale it does not trust."""
    spread = readout.max() - readout.min()
    if not spread > 0:
        return np.full_like(readout, (low + high) / 2)
    if abs(readout.min()) > abs(readout.max()):
        readout = -readout
        spread = readout.max() - readout.min()
    return low + (readout - readout.min()) / spread * (high - low)


def neighbour_readouts(received: dict, sent: dict, layer: str) -> list[np.ndarray]:
    """The imprint readout for each pair of neighbouring units, (ΔW_k − ΔW_k+1) / (Δb_k − Δb_k+1), as the server
    forms it from the float32 weights; the numerator alone where the denominator is zero."""
    rows = (sent[f"{layer}.weight"].double() - received[f"{layer}.weight"].double()).numpy()
    bias = (sent[f"{layer}.bias"].double() - received[f"{layer}.bias"].double()).numpy()
    found = []
    for k in range(len(rows) - 1):
        numerator, denominator = rows[k] - rows[k + 1], bias[k] - bias[k + 1]
        found.append(numerator / denominator if denominator != 0 else numerator)
    return found


def blind_reads(readouts: list[np.ndarray], samples: np.ndarray, low: float, high: float) -> dict[int, float]:
    best: dict[int, float] = {}
    for readout in readouts:
        if not np.all(np.isfinite(readout)) or not np.any(readout):
            continue
        mapped = in_range(readout, low, high)
        for index, sample in enumerate(samples):
            best[index] = max(best.get(index, -math.inf), psnr(mapped, sample))
    return {index: value for index, value in best.items() if value >= THRESHOLD}


class NormalisedMLP(nn.Module):
    def __init__(self, size: int, units: int):
        super().__init__()
        self.norm = nn.LayerNorm(size)
        self.fc1 = nn.Linear(size, units)
        self.fc2 = nn.Linear(units, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def watched_step(guard: Guard, model: nn.Module, received: dict, x, y, lr: float) -> dict:
    model.load_state_dict(received)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with guard.watch(model):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("offset", [300.0, 1000.0, 10000.0])
def test_an_imprint_after_a_normalisation_with_a_large_offset_is_read_at_its_scale(offset):
    """A LayerNorm whose offset the server set high, then a binning imprint on the normalised digits: every
    feature is near the offset, the imprint's biases are in the thousands, and float32 rounds each bias update by
    a large share of a one-sample step, so the neighbouring units' readout is the features at a wrong scale. The
    server that set the offset knows the features' mean, takes the offset back out and maps the normalised digit
    onto the data's range: digits at 40 dB and more. The guard names each and blocks."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[200:232], dtype=torch.float32)
    y = torch.tensor(digits.target[200:232])
    public = torch.tensor(digits.data[1000:1600], dtype=torch.float32)
    torch.manual_seed(2)
    model = NormalisedMLP(64, 80)
    generator = torch.Generator().manual_seed(5)
    direction = torch.randn(64, generator=generator)
    direction /= direction.norm()
    with torch.no_grad():
        model.norm.bias.fill_(offset)
        scores = (nn.functional.layer_norm(public, (64,)) + offset) @ direction
        model.fc1.weight.copy_(direction.expand(80, 64))
        model.fc1.bias.copy_(-torch.quantile(scores, torch.linspace(0.01, 0.99, 80)))
        model.fc2.weight.copy_(torch.randn(10, 1, generator=generator).expand(10, 80) * 0.1)
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    guard = Guard(NormalisedMLP(64, 80))
    sent = watched_step(guard, model, received, x, y, lr=0.01)

    readouts = []
    for readout in neighbour_readouts(received, sent, "fc1"):
        # The features' mean is the offset (a LayerNorm's output has mean zero before it): that fixes the scale.
        mean = readout.mean()
        if mean != 0 and np.isfinite(mean):
            readouts.append(readout * (offset / mean) - offset)
    read = blind_reads(readouts, x.numpy(), 0.0, 16.0)
    assert len(read) >= 5 and min(read.values()) >= THRESHOLD

    decision, to_send = guard.decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(read) <= set(decision.exact_samples), (sorted(read), decision.exact_samples, decision.notes)


def trap_digits(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, nn.Sequential]:
    """``count`` digits (0-16) and an MLP whose first three units each fire for one of them alone: the unit's row is
    its digit scaled to score 1 on it, its bias halfway between that score and the next highest (near -1)."""
    digits = datasets.load_digits()
    chosen = torch.randperm(len(digits.data), generator=torch.Generator().manual_seed(seed))[:count]
    x = torch.tensor(digits.data[chosen.numpy()], dtype=torch.float32)
    y = torch.tensor(digits.target[chosen.numpy()])
    model = nn.Sequential(nn.Linear(64, 3), nn.ReLU(), nn.Linear(3, 10))
    with torch.no_grad():
        for unit in range(3):
            row = x[unit] / (x[unit] @ x[unit])
            scores = (x @ row).sort(descending=True).values
            model[0].weight[unit] = row
            model[0].bias[unit] = -(scores[0] + scores[1]) / 2
        model[2].weight.copy_(torch.randn(10, 3, generator=torch.Generator().manual_seed(seed)))
        model[2].bias.zero_()
    return x, y, model


def blind_ratio_reads(received: dict, sent: dict, x: torch.Tensor) -> dict[int, float]:
    """Each first-layer unit's ratio ΔW / Δb mapped onto the digits' known top (16, its largest value there)."""
    rows = (sent["0.weight"].double() - received["0.weight"].double()).numpy()
    bias = (sent["0.bias"].double() - received["0.bias"].double()).numpy()
    readouts = [row / value * (16 / (row / value).max()) for row, value in zip(rows, bias) if value != 0]
    best: dict[int, float] = {}
    for readout in readouts:
        for index, sample in enumerate(x.numpy()):
            best[index] = max(best.get(index, -math.inf), psnr(readout, sample))
    return {index: value for index, value in best.items() if value >= THRESHOLD}


@pytest.mark.parametrize(("half", "lr"), [(torch.float16, 0.03), (torch.bfloat16, 0.3)])
def test_a_training_in_half_precision_sent_as_float32_is_read_at_its_own_rounding(half, lr):
    """The client trains in half precision and sends its weights as float32 (what Flower and NVFlare carry). Each
    step rounded the trap units' biases (near 1) to the half-precision spacing, thousands of times float32's, so a
    one-sample bias update (one or two spacings) comes out a few tenths off, and a server that maps the readout
    onto the digits' known top reads it at 55 dB or more. The guard sees from the values sent
    that every one is a half-precision value, reads at that rounding, and names each digit."""
    x, y, model = trap_digits(8, seed=3)
    model = model.to(half)
    received = {name: value.detach().to(torch.float32).clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x.to(half)).float(), y).backward()
    optimizer.step()
    sent = {name: value.detach().to(torch.float32).clone() for name, value in model.state_dict().items()}

    read = blind_ratio_reads(received, sent, x)
    assert read
    decision, to_send = Guard(trap_digits(8, seed=3)[2]).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(read) <= set(decision.exact_samples), (read, decision.exact_samples)


def test_many_watched_steps_are_read_at_their_many_roundings():
    """A hundred full-batch epochs on eight digits, the head frozen. The trap units' biases are at -1000, and the
    softmax is saturated on a class no digit has, so each step's bias update is the same 0.56-0.72 of a float32
    spacing there: every step rounds it to a whole spacing, and the update sent is a hundred spacings where the
    training made 56 to 72, more than one rounding per sample allows. The readout is the digit at 0.56-0.72 of its
    scale; a server that maps it onto the digits' known top reads it whole. The watch counts the steps, and the
    guard reads each ratio within that many roundings."""
    x, y, _ = trap_digits(8, seed=5)
    absent = next(label for label in range(10) if label not in y.tolist())
    spacing = float(torch.nextafter(torch.tensor(1000.0), torch.tensor(2000.0))) - 1000.0
    lr = 0.02

    def crafted() -> nn.Sequential:
        model = trap_digits(8, seed=5)[2]
        with torch.no_grad():
            # Each unit's digit scores 1 on its row and the others under 0.95: at 1050 times the row and a bias of
            # -1000 the digit's unit stays 50 above its kink for the hundred steps, every other digit below it.
            model[0].weight.mul_(1050.0)
            model[0].bias.fill_(-1000.0)
            model[2].weight.zero_()
            model[2].bias.zero_()
            model[2].bias[absent] = 20.0  # every softmax saturated on a class none of the digits has
            # Each unit's signal at its digit is this over the batch of eight: 0.56 to 0.72 of a spacing a step
            # (a different share for each unit: no one learning-rate ratio of the biases explains them).
            model[2].weight[absent] = torch.tensor([0.56, 0.64, 0.72]) * spacing * len(x) / lr
        return model

    model = crafted()
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    guard = Guard(crafted())
    optimizer = torch.optim.SGD(model[0].parameters(), lr=lr)  # the head frozen: the signals stay the same
    with guard.watch(model):
        for _ in range(100):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}

    moved = (sent["0.bias"].double() - received["0.bias"].double()) / spacing
    assert bool((moved.abs() >= 90).all())  # a whole spacing a step, not the 0.6 the training made
    read = blind_ratio_reads(received, sent, x)
    assert len(read) == 3
    decision, to_send = guard.decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(read) <= set(decision.exact_samples), (read, decision.exact_samples)


def test_a_unit_whose_bias_is_sent_as_infinity_is_read_by_its_row():
    """One trap unit's bias goes out as an infinity (a diverged value, or one set to hide the ratio): its row update
    is still the digit at some scale, which a server maps onto the digits' known top. The guard reads the row at
    any scale and names the digit."""
    x, y, model = trap_digits(8, seed=3)
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}
    sent["0.bias"][0] = math.inf

    row = (sent["0.weight"][0].double() - received["0.weight"][0].double()).numpy()
    shown = psnr(row * (16 / row.max()) if row.max() > 0 else row * (16 / row.min()), x[0].numpy())
    assert shown >= THRESHOLD
    decision, to_send = Guard(trap_digits(8, seed=3)[2]).decide(received, sent, x, y)
    assert decision.action == "block" and 0 in decision.exact_samples
    assert any("at the scale its bias update's float rounding leaves open" in reason for reason in decision.reasons)


def test_honest_rounds_on_four_features_sent_in_bfloat16_block_no_more_than_in_float32():
    """Iris (four standardised features), an honest MLP trained in float32 and sent as bfloat16 values (transport
    compression): the biases' rounding then leaves most readouts' scale open, and a readout at a free scale passes
    within 30 dB of flowers the client never had about as often as of its own. With so few values per sample the
    readouts are read as formed: sending in bfloat16 blocks no more rounds than sending in float32 (readouts near
    30 dB move a little with the rounding, so not always the same rounds)."""
    iris = datasets.load_iris()
    data = torch.tensor(iris.data, dtype=torch.float32)
    data = (data - data.mean(0)) / data.std(0)
    labels = torch.tensor(iris.target)
    blocked = {torch.float32: set(), torch.bfloat16: set()}
    for seed in range(6):
        chosen = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:32]
        x, y = data[chosen], labels[chosen]
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        received = {name: value.detach().to(torch.bfloat16).float() for name, value in model.state_dict().items()}
        model.load_state_dict(received)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for batch in torch.randperm(32, generator=torch.Generator().manual_seed(seed)).split(8):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
        for dtype in blocked:
            sent = {name: value.detach().to(dtype).float() for name, value in model.state_dict().items()}
            guard = Guard(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)))
            if guard.decide(received, sent, x, y)[0].action == "block":
                blocked[dtype].add(seed)
    assert len(blocked[torch.bfloat16]) <= len(blocked[torch.float32]), blocked
