"""The guard at its edges: a first layer without a bias, drop after several local steps that the guard did not
watch, token ids, one sample, an empty batch and weights that are not numbers. Each leak is judged by a readout
written here, from the float32 update the guard lets out."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from conftest import psnr
from sklearn import datasets
from torch import nn

from rankaudit.errors import UsageError
from rankaudit.guard.batch import checked_samples
from rankaudit.guard.decide import Guard
from rankaudit.settings.guard_options import GuardSettings

THRESHOLD = 30.0


def one_sgd_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float = 0.1) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def trap_mlp(public: torch.Tensor, units: int, batch: int, seed: int) -> nn.Sequential:
    """Boenisch et al.'s trap weights in a first layer without a bias: random rows, each shifted by a multiple of the
    all-ones row until about one public sample in ``batch`` makes it fire."""
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(public.shape[1], units, bias=False), nn.ReLU(), nn.Linear(units, 10))
    totals = public.sum(1)
    with torch.no_grad():
        for unit in range(units):
            row = torch.randn(public.shape[1], generator=generator)
            scores = public @ row
            shift = torch.quantile(scores / totals.clamp_min(1e-6), 1 - 1 / batch)
            model[0].weight[unit] = row - shift
    return model


@pytest.mark.parametrize("after", ["a constant input", "a batch norm"])
def test_an_imprint_in_a_layer_without_a_bias_is_read_by_pairs_of_rows(after):
    """A binning imprint in a bias-free first layer, its offsets from a constant input (a digit's pixel 0 set to 1,
    as an appended constant feature) or from a frozen BatchNorm's offset after the layer: neighbouring rows' update
    differences are single digits. The guard pairs rows by the coefficients the update itself gives, names every
    digit the server reads that way at 30 dB or more, and blocks."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[500:532] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[500:532])
    constant = after == "a constant input"
    if constant:
        x[:, 0] = 1.0
    units = 30
    direction = torch.ones(64) / 63
    direction[0] = 0
    thresholds = torch.quantile(x @ direction, torch.linspace(0, 0.9, units + 2)[1:-1])
    layer = nn.Linear(64, units, bias=False)
    norm = nn.BatchNorm1d(units) if not constant else nn.Identity()
    model = nn.Sequential(layer, norm, nn.ReLU(), nn.Linear(units, 10))
    with torch.no_grad():
        layer.weight.copy_(direction.expand(units, 64))
        if constant:
            layer.weight[:, 0] = -thresholds
        else:
            norm.bias.copy_(-thresholds)
        model[3].weight.copy_(torch.randn(10, 1, generator=torch.Generator().manual_seed(3)).expand(10, units))
    model.eval()  # the BatchNorm frozen at its running statistics (mean 0, variance 1)
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y)
    update = (sent["0.weight"] - received["0.weight"]).double().numpy()
    # The server's scale: the constant pixel's share of the update, or the norm's offset update (its running
    # variance is 1 and its weight 1, so that offset's update is the bias update the layer lacks).
    offsets = update[:, 0] if constant else (sent["1.bias"] - received["1.bias"]).double().numpy()
    read = {}
    for k in range(units - 1):
        if offsets[k] == offsets[k + 1]:
            continue
        readout = (update[k] - update[k + 1]) / (offsets[k] - offsets[k + 1])
        for n, sample in enumerate(x.double().numpy()):
            if psnr(readout, sample) >= THRESHOLD:
                read[n] = max(read.get(n, 0.0), psnr(readout, sample))
    assert len(read) >= 10
    decision, to_send = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(read) <= set(decision.exact_samples), (sorted(read), decision.exact_samples)


def read_rows_in_range(update: torch.Tensor, low: float, high: float) -> list[np.ndarray]:
    """The server's readout of a layer without a bias: each row update stretched to the data's known range, with
    the sign that puts most of it near the low end (digits are mostly background)."""
    found = []
    for row in update.double().numpy():
        if not np.any(row) or row.max() == row.min():
            continue
        stretched = [(sign * row - (sign * row).min()) / np.ptp(row) * (high - low) + low for sign in (1, -1)]
        found.append(min(stretched, key=lambda v: float(np.median(v))))
    return found


@pytest.mark.parametrize("seed", [3, 4])
def test_a_trap_in_a_first_layer_without_a_bias_is_read_and_blocked(seed):
    """Trap weights in a bias-free first layer on digits: the guard checks each row update at its best scale and
    offset, names every digit the server's rescaled rows read at 30 dB or more, and blocks; dropped, the rows it
    lets out read none."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[400 + 32 * seed : 432 + 32 * seed], dtype=torch.float32)
    y = torch.tensor(digits.target[400 + 32 * seed : 432 + 32 * seed])
    model = trap_mlp(torch.tensor(digits.data[1300:], dtype=torch.float32), units=96, batch=32, seed=seed)
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y)
    update = sent["0.weight"] - received["0.weight"]
    read = {
        n
        for readout in read_rows_in_range(update, 0.0, 16.0)
        for n, sample in enumerate(x.double().numpy())
        if psnr(readout, sample) >= THRESHOLD
    }
    assert len(read) >= 5
    fresh = trap_mlp(torch.zeros(1, 64), units=96, batch=32, seed=0)  # the architecture, other weights
    decision, to_send = Guard(fresh).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert read <= set(decision.exact_samples), (read, decision.exact_samples)
    assert "0" in decision.layers_checked
    decision, to_send = Guard(fresh, GuardSettings(action="drop", seed=0)).decide(received, sent, x, y)
    assert to_send is not None and decision.action == "drop"
    left = to_send["0.weight"] - received["0.weight"]
    assert not any(
        psnr(readout, sample) >= THRESHOLD
        for readout in read_rows_in_range(left, 0.0, 16.0)
        for sample in x.double().numpy()
    )


def imprint_mlp(public: torch.Tensor, bins: int, seed: int):
    """Fowl et al.'s binning imprint in fc1, each unit scaled by its own factor and the units shuffled, the next
    layer scaled back: (model, each unit's scale, its threshold)."""
    generator = torch.Generator().manual_seed(seed)
    features = public.shape[1]
    model = nn.Sequential(nn.Linear(features, bins), nn.ReLU(), nn.Linear(bins, 16), nn.ReLU(), nn.Linear(16, 3))
    direction = torch.randn(features, generator=generator)
    direction /= direction.norm()
    thresholds = torch.quantile(public @ direction, torch.linspace(0, 1, bins + 2)[1:-1])
    scales = torch.exp(torch.randn(bins, generator=generator))
    order = torch.randperm(bins, generator=generator)
    with torch.no_grad():
        model[0].weight.copy_((scales[:, None] * direction[None, :])[order])
        model[0].bias.copy_((-scales * thresholds)[order])
        model[2].weight.copy_(torch.randn(16, 1, generator=generator) / scales[order][None, :])
    return model, scales[order], thresholds[order]


def test_drop_after_unwatched_local_steps_leaves_no_bin_the_server_reads():
    """Several local steps with momentum, the guard not watching them: which units held a sample is known only at
    the received and sent weights, so drop takes the whole layer a readout was found in; the server's own imprint
    readout of what is sent (neighbouring thresholds, its own scales) reads no sample."""
    wine = datasets.load_wine()
    data = torch.tensor(wine.data, dtype=torch.float32)
    public, private = data[::2], data[1::2][:36]
    mean, spread = public.mean(0), public.std(0)
    x = (private - mean) / spread
    y = torch.tensor(wine.target[1::2][:36])
    model, scales, thresholds = imprint_mlp((public - mean) / spread, bins=40, seed=5)
    received = {name: value.clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    generator = torch.Generator().manual_seed(6)
    for _ in range(3):
        for batch in torch.randperm(36, generator=generator).split(9):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}

    def server_reads(weights):
        rows = (weights["0.weight"] - received["0.weight"]).double()
        bias = (weights["0.bias"] - received["0.bias"]).double()
        ranked = torch.argsort(thresholds)
        found = {}
        for low, high in zip(ranked[:-1].tolist(), ranked[1:].tolist()):
            denominator = float(scales[low] * bias[low] - scales[high] * bias[high])
            if abs(denominator) <= 1e-12 * float(bias.abs().max()):
                continue
            readout = ((scales[low] * rows[low] - scales[high] * rows[high]) / denominator).numpy()
            for n, sample in enumerate(x.double().numpy()):
                if psnr(readout, sample) >= THRESHOLD:
                    found[n] = max(found.get(n, 0.0), psnr(readout, sample))
        return found

    assert len(server_reads(sent)) >= 3
    fresh = imprint_mlp(torch.randn(8, 13), bins=40, seed=0)[0]
    for action in ("drop", "noise"):
        decision, to_send = Guard(fresh, GuardSettings(action=action, seed=1)).decide(received, sent, x, y)
        assert decision.exact_samples
        assert to_send is None or not server_reads(to_send), (action, server_reads(to_send))


class TokenModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(30, 4)
        self.fc1 = nn.Linear(24, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, ids):
        return self.fc2(torch.relu(self.fc1(self.embed(ids).flatten(1))))


def test_token_ids_reach_the_model_as_ids_and_read_features_count_as_the_tokens():
    """A model that embeds token ids: the guard runs it on the ids (not on floats), and a unit that fires for one
    sequence alone reads that sequence's embedded tokens, which determine it: blocked, and the note says why."""
    ids = torch.randint(30, (12, 6), generator=torch.Generator().manual_seed(2))
    y = torch.randint(3, (12,), generator=torch.Generator().manual_seed(3))
    assert checked_samples(ids.numpy(), "test").dtype == torch.int64
    torch.manual_seed(4)
    model = TokenModel()
    with torch.no_grad():
        embedded = model.embed(ids).flatten(1)
        direction = embedded[5] - embedded.mean(0)
        scores = embedded @ direction
        model.fc1.weight[0] = direction
        model.fc1.bias[0] = -(scores[5] + scores[torch.arange(12) != 5].max()) / 2
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, ids, y)
    decision, _ = Guard(TokenModel()).decide(received, sent, ids, y)
    assert decision.action == "block" and 5 in decision.exact_samples
    assert any("token ids" in note for note in decision.reasons + decision.notes)


def test_an_empty_batch_and_weights_that_are_not_numbers_get_an_answer():
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(10, 8, generator=torch.Generator().manual_seed(0)), torch.arange(10) % 3
    received = {name: value.clone() for name, value in model.state_dict().items()}
    with pytest.raises(UsageError, match="no samples"):
        Guard(model).decide(received, received, x[:0], y[:0])
    poisoned = {name: value.clone() for name, value in received.items()}
    poisoned["0.weight"][:] = math.nan
    sent = one_sgd_step(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), x, y)
    decision, _ = Guard(model).decide(poisoned, sent, x, y)
    assert decision.action in ("send", "block")


def test_one_sample_is_not_its_own_prior():
    """One photograph, Flower's quickstart CNN at its seeded initialisation: fc1 reads its features, which show no
    more of it than a flat image of its own colour does; sent (the batch mean of one sample would be the sample)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(400, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, 10),
    )  # fmt: skip
    image = torch.tensor(datasets.load_sample_images().images[0]).permute(2, 0, 1).float() / 255
    x = (image[:, 200:232, 300:332][None] - 0.5) / 0.5
    y = torch.tensor([3])
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y, lr=0.01)
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "send", decision.reasons
    assert decision.feature_samples == [0] and decision.psnr[0] < THRESHOLD


TOKEN_MODEL = """
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(20, 4)
        self.fc = nn.Linear(16, 3)

    def forward(self, ids):
        return self.fc(self.embed(ids).flatten(1))
"""


def test_the_command_runs_a_token_model_on_its_ids(run_cli, tmp_path):
    """Integer samples stay integers for a model that embeds them: the command trains and decides on the ids
    instead of failing in the model's embedding."""
    import json

    (tmp_path / "tokens.py").write_text(TOKEN_MODEL)
    generator = torch.Generator().manual_seed(0)
    weights = {
        "embed.weight": torch.randn(20, 4, generator=generator),
        "fc.weight": torch.randn(3, 16, generator=generator) / 4,
        "fc.bias": torch.zeros(3),
    }
    torch.save(weights, tmp_path / "tokens.pt")
    ids = np.random.default_rng(0).integers(0, 20, (8, 4))
    np.savez(tmp_path / "tokens.npz", x=ids, y=np.arange(8) % 3)
    code, out, err = run_cli(
        "guard",
        f"{tmp_path / 'tokens.py'}:Net",
        "--weights",
        tmp_path / "tokens.pt",
        "--data",
        tmp_path / "tokens.npz",
        "--format",
        "json",
    )
    assert code in (0, 1), err
    assert json.loads(out)["guard"]["action"] in ("send", "block")


class PassThrough(nn.Module):
    """A first layer set to pass the sample, doubled, through a ReLU (no offset), then a readout layer."""

    def __init__(self, conv: bool):
        super().__init__()
        self.conv = conv
        self.first = nn.Conv2d(1, 1, 1) if conv else nn.Linear(64, 64)
        self.fc1 = nn.Linear(64, 8)
        self.fc2 = nn.Linear(8, 10)

    def forward(self, x):
        h = torch.relu(self.first(x.reshape(len(x), 1, 8, 8) if self.conv else x.flatten(1)))
        return self.fc2(torch.relu(self.fc1(h.flatten(1))))


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "convolution"])
def test_features_at_a_relus_kink_count_what_the_kink_tells(conv):
    """Digits, mostly exact zeros, passed through a ReLU at its kink: a unit that fires for one digit reads its
    features, which are the digit. At relu'(0) = 0 the zero pixels would look unknown; the guard counts them as
    seen, names the digit and blocks; the server's ratio reads the digit at 30 dB or more."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[700:724], dtype=torch.float32)
    y = torch.tensor(digits.target[700:724])
    model = PassThrough(conv)
    target = 13  # a 6: much of its background is stroke in the other digits
    with torch.no_grad():
        if conv:
            model.first.weight.fill_(2.0)
        else:
            model.first.weight.copy_(2 * torch.eye(64))
        model.first.bias.zero_()
        # The least-norm row that gives the target's features 1 and every other digit's 0 (24 digits in 64 values).
        model.fc1.weight[0] = torch.linalg.pinv(2 * x) @ (torch.arange(24) == target).float()
        model.fc1.bias[0] = -0.5
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y, lr=0.05)
    rows, bias = sent["fc1.weight"] - received["fc1.weight"], sent["fc1.bias"] - received["fc1.bias"]
    readout = (rows[0].double() / bias[0].double()).numpy() / 2  # the server knows its own doubling
    assert psnr(readout, x[target].double().numpy()) >= THRESHOLD
    assert float((x[target] == 0).float().mean()) > 0.3
    decision, to_send = Guard(PassThrough(conv)).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None and target in decision.exact_samples
    assert any(r.layer == "fc1" and r.sample == target and r.sample_psnr >= THRESHOLD for r in decision.readouts)


def test_every_spelling_of_a_relu_counts_its_kink_as_on():
    """torch.relu, F.relu (in place or not), nn.ReLU(inplace=True), clamp(min=0), Tensor.relu_, nn.Threshold(0, 0)
    and torch.where(t > 0, t, 0): the same values, and a derivative of 1 at exactly 0 while the features' Jacobian is
    formed."""
    from rankaudit.guard.jacobian_mode import KinksCountOn

    spellings = [
        torch.relu,
        nn.functional.relu,
        lambda t: nn.functional.relu(t * 1, True),
        lambda t: nn.ReLU(inplace=True)(t * 1),
        lambda t: t.clamp(min=0),
        lambda t: (t * 1).relu_(),
        nn.Threshold(0.0, 0.0),
        lambda t: torch.where(t > 0, t, 0.0),
        lambda t: torch.where(t > 0, t, torch.zeros_like(t)),
    ]
    for spelling in spellings:
        x = torch.tensor([-1.0, 0.0, 2.0], requires_grad=True)
        with KinksCountOn():
            y = spelling(x)
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert y.tolist() == [0.0, 0.0, 2.0] and grad.tolist() == [0.0, 1.0, 1.0]


class Spelled(nn.Module):
    """One MLP, its ReLU and block spelled several ways that all compute the same function."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc1 = nn.Linear(64, 32)
        self.relu = nn.ReLU(inplace=how == "in place")
        self.fc2 = nn.Linear(32, 10)

    def block(self, x):
        return self.relu(self.fc1(x))

    def forward(self, x):
        if self.how == "checkpointed":
            from torch.utils.checkpoint import checkpoint

            return self.fc2(checkpoint(self.block, x, use_reentrant=False))
        return self.fc2(self.block(x))


def test_an_in_place_relu_or_a_checkpointed_block_gets_the_plain_models_decision():
    """nn.ReLU(inplace=True) after a checked layer, and a block under torch.utils.checkpoint (which runs its
    forward again during the backward): the same readouts as the plain model, without watching the training."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[900:916] / 16, dtype=torch.float32)
    y = torch.tensor(digits.target[900:916])
    decisions = {}
    for how in ("plain", "in place", "checkpointed"):
        torch.manual_seed(0)
        model = Spelled(how)
        received = {name: value.clone() for name, value in model.state_dict().items()}
        sent = one_sgd_step(model, x, y)
        torch.manual_seed(0)
        decision, _ = Guard(Spelled(how)).decide(received, sent, x, y)
        decisions[how] = (decision.action, decision.exact_samples, decision.psnr)
    assert decisions["plain"][1], decisions
    assert decisions["in place"] == decisions["checkpointed"] == decisions["plain"]


class PixelsInside(nn.Module):
    """Takes uint8 pixels and scales them itself, then a first layer without a bias."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 48, bias=False)
        self.fc2 = nn.Linear(48, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.float() / 16)))


def test_integer_pixels_and_a_blank_image_are_judged_as_what_they_show():
    """Digits as integers, scaled inside the model, trap weights in a bias-free first layer: the rows are compared
    with the integer pixels at their best scale and offset, so each read digit is named and the update blocked; an
    all-zero image in the batch is matched by no row (its offset alone is the fit) and named by none."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[1100:1132], dtype=torch.int64)
    x[5] = 0
    y = torch.tensor(digits.target[1100:1132])
    model = PixelsInside()
    trap = trap_mlp(torch.tensor(digits.data[1400:], dtype=torch.float32), units=48, batch=32, seed=9)
    with torch.no_grad():
        model.fc1.weight.copy_(trap[0].weight * 16)
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y)
    read = {
        n
        for readout in read_rows_in_range(sent["fc1.weight"] - received["fc1.weight"], 0.0, 16.0)
        for n, sample in enumerate(x.double().numpy())
        if n != 5 and psnr(readout, sample) >= THRESHOLD
    }
    decision, _ = Guard(PixelsInside()).decide(received, sent, x, y)
    assert read and read <= set(decision.exact_samples) and decision.action == "block"
    assert 5 not in decision.exact_samples


def test_weights_no_readout_reads_are_listed_as_not_checked():
    """A weight-normalised layer sends its parts (g and v), not a weight: they are named as not checked."""
    model = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(8, 16)), nn.ReLU(), nn.Linear(16, 3))
    x, y = torch.randn(12, 8, generator=torch.Generator().manual_seed(1)), torch.arange(12) % 3
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y)
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert any("parametrizations.weight.original1" in line and "not checked" in line for line in decision.skipped)


def test_hugging_face_token_batches_give_their_input_ids():
    from rankaudit.guard.batch import client_samples

    ids = torch.randint(100, (10, 7), generator=torch.Generator().manual_seed(2))
    batches = [
        {"input_ids": ids[:5], "attention_mask": torch.ones(5, 7), "label": torch.arange(5)},
        {"input_ids": ids[5:], "attention_mask": torch.ones(5, 7), "label": torch.arange(5)},
    ]
    loader = torch.utils.data.DataLoader(batches, batch_size=None)
    samples, labels, _ = client_samples(loader)
    assert samples.dtype == torch.int64 and torch.equal(samples, ids) and labels.tolist() == [0, 1, 2, 3, 4] * 2


class _Identity(nn.Module):
    def forward(self, x):
        return x * 1.0


class HiddenSkip(nn.Module):
    """fc1 reads a ReLU layer's features beside the pixels themselves, passed on a way autograd does not follow."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, 4), nn.Linear(68, 40), nn.Linear(40, 10)
        self.through = _Identity()
        if how == "backward hook":  # every gradient through the identity made zero
            self.through.register_full_backward_hook(lambda module, grad_in, grad_out: (grad_in[0] * 0,))

    def forward(self, x):
        if self.how == "detach":
            skip = x.detach()
        elif self.how == "data":
            skip = x.data
        elif self.how == "round":  # digits' pixels are sixteenths: rounded to them, they are the pixels
            skip = torch.round(x * 16) / 16
        elif self.how == "round in place":  # the tensor itself kept, not what round_ returns
            scaled = x * 16
            scaled.round_()
            skip = scaled / 16
        elif self.how == "integers":
            skip = (x * 16).long().to(x.dtype) / 16
        elif self.how == "floor division":
            skip = torch.div(x * 16, 1, rounding_mode="floor") / 16
        elif self.how == "bits":  # the same bits read as integers and back
            skip = x.view(torch.int32).view(torch.float32)
        elif self.how == "numbers":
            skip = torch.tensor(x.tolist(), dtype=x.dtype)
        elif self.how == "copy":
            skip = x.new_tensor(x)
        elif self.how == "gradient hook":
            skip = x * 1.0
            if skip.requires_grad:
                skip.register_hook(lambda grad: grad * 0)
        elif self.how == "backward hook":
            skip = self.through(x)
        elif self.how == "property under no_grad":
            with torch.no_grad():
                skip = x.mT.mT
        elif self.how == "inference mode":
            with torch.inference_mode():
                skip = x * 1.0
        else:
            with torch.no_grad():
                skip = x * 1.0
        return self.fc2(torch.relu(self.fc1(torch.cat([torch.relu(self.fc0(x)), skip], 1))))


# Stop-gradients and gradient hooks do not change the values: the features' Jacobian follows the path through them.
FOLLOWED = ["detach", "data", "no_grad", "property under no_grad", "gradient hook", "backward hook"]
# Values that escape autograd altogether: noticed, and the features count as the sample.
ESCAPED = ["round", "round in place", "integers", "floor division", "bits", "numbers", "copy", "inference mode"]


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")
@pytest.mark.parametrize("how", FOLLOWED + ESCAPED)
def test_a_path_autograd_does_not_see_counts_the_features_as_the_sample(how):
    """Features that carry the pixels around autograd (a stop-gradient, a hook that zeroes the gradient, rounding,
    integers, Python numbers, a copy without its gradient, inference mode): their Jacobian alone would call them a
    10-14 dB view. The guard follows the path or counts them as the sample, and blocks, naming every sample whose
    pixels the readout written here reads at 30 dB or more from the update it was asked about."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[:24] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:24])
    torch.manual_seed(0)
    model = HiddenSkip(how)
    with torch.no_grad():  # each fc1 unit fires for one sample
        features = torch.cat([torch.relu(model.fc0(x)), x], 1)
        directions = torch.randn(40, 68, generator=torch.Generator().manual_seed(1)) / 8
        top = (features @ directions.T).topk(2, dim=0).values
        model.fc1.weight.copy_(directions)
        model.fc1.bias.copy_(-(top[0] + top[1]) / 2)
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y)
    decision, to_send = Guard(model).decide(received, sent, x, y)
    rows = (sent["fc1.weight"].double() - received["fc1.weight"].double()).numpy()
    bias = (sent["fc1.bias"].double() - received["fc1.bias"].double()).numpy()
    read = {
        n
        for unit in range(40)
        if abs(bias[unit]) > 1e-12
        for n in range(24)
        if psnr(rows[unit, 4:] / bias[unit], x[n].double().numpy()) >= THRESHOLD
    }
    assert decision.action == "block" and to_send is None
    assert len(read) >= 10 and read <= set(decision.exact_samples)
    noticed = any("Jacobian does not see" in line for line in decision.reasons + decision.notes)
    assert noticed == (how in ESCAPED)


class Monitored(nn.Module):
    """An honest MLP whose forward pass also logs, checks and indexes with values of the sample, none of which
    reaches what fc1 reads."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, 6), nn.Linear(6, 40), nn.Linear(40, 10)
        self.logged: dict[str, object] = {}

    def forward(self, x):
        h = torch.relu(self.fc0(x))
        if self.how == "logged activations":
            self.logged["fc0"] = h.detach()
        elif self.how == "statistic under no_grad":
            with torch.no_grad():
                self.logged["norm"] = x.norm(dim=1).mean()
        elif self.how == "rounded for a histogram":
            self.logged["levels"] = torch.round(x * 4)
        elif self.how == "index from a list":
            h = h[:, x.new_tensor(list(range(6)), dtype=torch.long)]
        elif self.how == "a check":
            if x.abs().max().item() > 1e6:
                raise ValueError("inputs out of range")
        elif self.how == "zeros shaped like it":
            h = h + torch.zeros_like(h)
        elif self.how == "constants made beside it":
            h = h * x.new_tensor([1.0, 2.0, 1.0, 0.5, 1.0, 1.0])
        return self.fc2(torch.relu(self.fc1(h)))


@pytest.mark.parametrize(
    "how",
    [
        "logged activations",
        "statistic under no_grad",
        "rounded for a histogram",
        "index from a list",
        "a check",
        "zeros shaped like it",
        "constants made beside it",
    ],
)
def test_values_that_escape_autograd_but_never_reach_the_features_hide_no_path(how):
    """Logging, checks and statistics that use the sample's values outside autograd without feeding what the read
    layer reads: the features' figure is measured (a 6-feature view, far under 30 dB), not counted as the sample."""
    from rankaudit.guard.features import determined_psnr

    digits = datasets.load_digits()
    x = torch.tensor(digits.data[:12] / 16.0, dtype=torch.float32)
    torch.manual_seed(4)
    model = Monitored(how).eval().requires_grad_(False)
    figures, notes = determined_psnr(model, model.fc1, x, [0, 3, 7])
    assert not notes and all(figure < THRESHOLD for figure in figures.values())


class RotaryLike(nn.Module):
    """Asks its input's device, dtype and size under torch.no_grad, as rotary position embeddings do."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 12), nn.Linear(12, 10)

    def forward(self, x):
        with torch.no_grad():
            angles = torch.arange(x.shape[-1], dtype=x.dtype, device=x.device) / x.size(-1)
        return self.fc2(torch.relu(self.fc1(x * torch.cos(angles))))


def test_asking_what_the_input_is_under_no_grad_hides_no_path():
    """Reading the input's device, dtype or size under torch.no_grad carries nothing of the sample: the features'
    figure is measured, not counted as the sample."""
    from rankaudit.guard.features import determined_psnr

    digits = datasets.load_digits()
    x = torch.tensor(digits.data[:12] / 16.0, dtype=torch.float32)
    model = RotaryLike().eval().requires_grad_(False)
    figures, notes = determined_psnr(model, model.fc2, x, [0, 3])
    assert not notes and all(figure < THRESHOLD for figure in figures.values())


class _RoundThrough(torch.autograd.Function):
    """Rounding whose backward passes the gradient through (a straight-through estimator, as quantisation-aware
    training has): its own backward says what the Jacobian sees."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, grad):
        return grad


class MasksAndIndices(nn.Module):
    """Comparisons that gate the values they come from, a max with its indices, a gather by an argmax, and dtype
    conversions between floats: kinks and selections, none of them a path around autograd."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, 24), nn.Linear(24, 12), nn.Linear(12, 10)

    def forward(self, x):
        h = self.fc0(_RoundThrough.apply(x).to(torch.float64).type_as(x))
        h = h * (h > 0).float() + torch.where(h > 0.5, h, 0.0)
        pooled, _ = h.view(len(h), 12, 2).max(dim=2)
        best = h.view(len(h), 12, 2).gather(2, h.view(len(h), 12, 2).argmax(2, keepdim=True))[..., 0]
        return self.fc2(torch.relu(self.fc1(torch.cat([pooled, best], 1))))


def test_masks_indices_and_float_conversions_hide_no_path():
    """Masks that gate their own values, indices that select them, conversions between float dtypes and a custom
    function's own backward: the features' figure is measured, not counted as the sample."""
    from rankaudit.guard.features import determined_psnr

    digits = datasets.load_digits()
    x = torch.tensor(digits.data[:12] / 16.0, dtype=torch.float32)
    torch.manual_seed(3)
    model = MasksAndIndices().eval().requires_grad_(False)
    figures, notes = determined_psnr(model, model.fc2, x, [0, 3, 7])
    assert not notes and all(figure < THRESHOLD for figure in figures.values())


class Checkpointed(nn.Module):
    """An honest MLP whose hidden block runs under a reentrant checkpoint (which refuses torch.autograd.grad)."""

    def __init__(self):
        super().__init__()
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, 6), nn.Linear(6, 40), nn.Linear(40, 10)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: torch.relu(self.fc0(t)), x, use_reentrant=True) if x.requires_grad else None
        h = torch.relu(self.fc0(x)) if h is None else h
        return self.fc2(torch.relu(self.fc1(h)))


def test_a_reentrant_checkpoint_still_gives_the_features_figure():
    """The features' Jacobian through a reentrant checkpoint is formed by plain backward passes: the figure is
    measured (a 6-feature view), as without the checkpoint, not counted as the sample."""
    from rankaudit.guard.features import determined_psnr

    digits = datasets.load_digits()
    x = torch.tensor(digits.data[:12] / 16.0, dtype=torch.float32)
    torch.manual_seed(4)
    model = Checkpointed().eval().requires_grad_(False)
    figures, notes = determined_psnr(model, model.fc1, x, [0, 3, 7])
    plain = Checkpointed().eval().requires_grad_(False)
    plain.load_state_dict(model.state_dict())
    plain.forward = lambda t: plain.fc2(torch.relu(plain.fc1(torch.relu(plain.fc0(t)))))
    expected, _ = determined_psnr(plain, plain.fc1, x, [0, 3, 7])
    assert not notes and figures == pytest.approx(expected, abs=1e-6)
    assert all(figure < THRESHOLD for figure in figures.values())


@pytest.mark.parametrize("how", ["frozen", "left out of the optimiser", "not sent"])
def test_an_imprint_whose_bias_does_not_move_is_read_by_its_rows(how):
    """Fowl et al.'s binning imprint on digits, one bin per sample (thresholds between neighbouring brightnesses) in
    the first layer's bias, and that bias never updated: frozen, not handed to the optimiser, or left out of what
    the client sends. No ratio exists, but neighbouring rows' update differences are single digits, which a server
    that knows the data's range stretches back. Every digit read that way at 30 dB or more is named, and the update
    blocked."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[1300:1328] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[1300:1328])
    brightness = x.mean(1).sort().values
    thresholds = torch.cat([brightness[:1] - 0.05, (brightness[1:] + brightness[:-1]) / 2])
    units = len(thresholds)
    direction = torch.ones(x.shape[1]) / x.shape[1]
    model = nn.Sequential(nn.Linear(x.shape[1], units), nn.ReLU(), nn.Linear(units, 10))
    with torch.no_grad():
        model[0].weight.copy_(direction.expand(units, -1))
        model[0].bias.copy_(-thresholds)
        model[2].weight.copy_(torch.randn(10, 1, generator=torch.Generator().manual_seed(6)).expand(10, units))
    received = {name: value.clone() for name, value in model.state_dict().items()}
    net = nn.Sequential(nn.Linear(x.shape[1], units), nn.ReLU(), nn.Linear(units, 10))
    net.load_state_dict(received)
    if how == "frozen":
        net[0].bias.requires_grad_(False)
    stepped = [p for name, p in net.named_parameters() if p.requires_grad and name != "0.bias"]
    optimizer = torch.optim.SGD(stepped if how != "not sent" else net.parameters(), lr=0.1)
    optimizer.zero_grad()
    nn.functional.cross_entropy(net(x), y).backward()
    optimizer.step()
    sent = {name: value.detach().clone() for name, value in net.state_dict().items()}
    if how == "not sent":
        del sent["0.bias"]
    update = sent["0.weight"].double() - received["0.weight"].double()
    read = {}
    for readout in read_rows_in_range(update[:-1] - update[1:], 0.0, 1.0) + read_rows_in_range(
        update[1:] - update[:-1], 0.0, 1.0
    ):
        for n, sample in enumerate(x.double().numpy()):
            if psnr(readout, sample) >= THRESHOLD:
                read[n] = max(read.get(n, 0.0), psnr(readout, sample))
    assert len(read) >= 10, read
    decision, to_send = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(read) <= set(decision.exact_samples), (sorted(read), decision.exact_samples)
    assert "0" in decision.layers_checked and not any(line.startswith("0:") for line in decision.skipped)


def test_samples_with_a_nan_are_refused_with_one_line():
    """A NaN in a sample would make every readout compared with it NaN, and nothing would be named: the guard refuses
    such samples and says which, rather than send."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.rand(6, 16)
    y = torch.tensor([0, 1, 2, 0, 1, 2])
    received = {name: value.clone() for name, value in model.state_dict().items()}
    sent = one_sgd_step(model, x, y)
    x[4, 3] = math.nan
    with pytest.raises(UsageError, match=r"NaN or infinite values \(samples \[4\]\)"):
        Guard(model).decide(received, sent, x, y)


def test_a_watched_imprint_in_a_frozen_bias_with_more_samples_than_inputs_is_read():
    """The thresholds in a frozen first-layer bias, and 100 digits against 64 inputs: the update cannot be solved for
    each sample's coefficients, but the watched training's own signals pair the rows. Every digit the server reads
    from neighbouring rows, stretched to the data's range, is named, and what drop sends shows none."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[600:700] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[600:700])
    public = torch.tensor(digits.data[:1200] / 16.0, dtype=torch.float32).mean(1).sort().values
    units = 160
    thresholds = public[torch.linspace(0, len(public) - 1, units).long()]
    model = nn.Sequential(nn.Linear(64, units), nn.ReLU(), nn.Linear(units, 10))
    with torch.no_grad():
        model[0].weight.fill_(1 / 64)
        model[0].bias.copy_(-thresholds)
        model[2].weight.copy_(torch.randn(10, 1, generator=torch.Generator().manual_seed(9)).expand(10, units) * 0.1)
    received = {name: value.clone() for name, value in model.state_dict().items()}
    net = nn.Sequential(nn.Linear(64, units), nn.ReLU(), nn.Linear(units, 10))
    net.load_state_dict(received)
    net[0].bias.requires_grad_(False)
    guard = Guard(model, GuardSettings(action="drop", seed=0))
    optimizer = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.01)
    with guard.watch(net):
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    sent = {name: value.detach().clone() for name, value in net.state_dict().items()}

    def shown(state: dict) -> dict[int, float]:
        update = state["0.weight"].double() - received["0.weight"].double()
        read = {}
        for readout in read_rows_in_range(update[:-1] - update[1:], 0.0, 1.0):
            for n, sample in enumerate(x.double().numpy()):
                if psnr(readout, sample) >= THRESHOLD:
                    read[n] = max(read.get(n, 0.0), psnr(readout, sample))
        return read

    read = shown(sent)
    assert len(read) >= 10, read
    decision, to_send = guard.decide(received, sent, x, y)
    assert set(read) <= set(decision.exact_samples), (sorted(set(read) - set(decision.exact_samples)), read)
    assert decision.action == "block" or shown(to_send) == {}
