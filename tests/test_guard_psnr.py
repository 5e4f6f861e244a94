"""The guard's criterion judged by the server's own readouts on real photographs (scikit-learn's sample images,
cropped): each construction's readout is formed here, from the update as sent and the server's knowledge of its
own weights, and every sample it shows at 30 dB or more must be named by the guard and the update blocked; honest
weights of Flower's quickstart CNN are never blocked."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import Lambda
from torch import nn

from rankaudit.guard.decide import Guard
from rankaudit.settings.guard_options import GuardSettings

datasets = pytest.importorskip("sklearn.datasets")
THRESHOLD = 30.0


def photo_crops(count: int, side: int, seed: int) -> torch.Tensor:
    """``count`` random side x side crops of the two sample photographs, in [-1, 1] (Flower's normalisation)."""
    images = [torch.as_tensor(image).permute(2, 0, 1).float() / 255 for image in datasets.load_sample_images().images]
    generator = torch.Generator().manual_seed(seed)
    crops = []
    for _ in range(count):
        image = images[int(torch.randint(len(images), (1,), generator=generator))]
        top = int(torch.randint(image.shape[1] - side, (1,), generator=generator))
        left = int(torch.randint(image.shape[2] - side, (1,), generator=generator))
        crops.append(image[:, top : top + side, left : left + side])
    return torch.stack(crops) * 2 - 1


def psnr(readout: torch.Tensor, sample: torch.Tensor) -> float:
    """The server's figure: PSNR of a readout against the sample, peak the sample's range."""
    readout, sample = readout.double().flatten(), sample.double().flatten()
    mse = float(((readout - sample) ** 2).mean())
    return math.inf if mse == 0 else 10 * math.log10(float(sample.max() - sample.min()) ** 2 / mse)


def sent_after_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float = 0.01, batch: int | None = None):
    """The float32 state dict a client sends after its local SGD steps."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batch = batch or len(x)
    for start in range(0, len(x), batch):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[start : start + batch]), y[start : start + batch]).backward()
        optimizer.step()
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def state(model: nn.Module) -> dict:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def read_pair(received, sent, layer, i, j, scale=0.0):
    """(ΔW_i − scale·ΔW_j) / (Δb_i − scale·Δb_j), from the float32 tensors as sent (scale 0: unit i's ratio)."""
    dw = sent[f"{layer}.weight"] - received[f"{layer}.weight"]
    db = sent[f"{layer}.bias"] - received[f"{layer}.bias"]
    return (dw[i] - scale * dw[j]) / (db[i] - scale * db[j])


def read_by_server(readouts: list[torch.Tensor], x: torch.Tensor) -> dict[int, float]:
    """{sample: best PSNR} over the server's readouts, for the samples shown at the threshold or above."""
    shown = {}
    for readout in readouts:
        if not bool(torch.isfinite(readout).all()):
            continue
        scores = [psnr(readout, sample) for sample in x]
        best = max(range(len(x)), key=lambda n: scores[n])
        if scores[best] >= THRESHOLD:
            shown[best] = max(shown.get(best, -math.inf), scores[best])
    return shown


class MLP(nn.Module):
    def __init__(self, inputs: int, width: int = 32, classes: int = 10):
        super().__init__()
        self.fc1 = nn.Linear(inputs, width)
        self.fc2 = nn.Linear(width, classes)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


class QuickstartCNN(nn.Module):
    """Flower's PyTorch quickstart model: conv 6 - pool - conv 16 - pool - fc 120 - fc 84 - fc 10, on 3x32x32."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(torch.relu(self.conv1(x)))
        x = self.pool(torch.relu(self.conv2(x)))
        x = x.flatten(1)
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def one_sample_unit(x: torch.Tensor, sample: int, bias_gap: float) -> MLP:
    """fc1's unit 0 fires for ``sample`` alone: its row the direction that separates the sample's deviation from
    the batch's mean from the others', scaled so that the sample's pre-activation is bias_gap / 2 and the next
    sample's −bias_gap / 2; the other units fire for nobody."""
    torch.manual_seed(1)
    flat = x.flatten(1)
    model = MLP(flat.shape[1])
    direction = torch.linalg.pinv(flat - flat.mean(0))[:, sample]
    scores = flat @ direction
    runner_up = scores[torch.arange(len(x)) != sample].max()
    row = direction * bias_gap / float(scores[sample] - runner_up)  # the two scores bias_gap apart
    with torch.no_grad():
        model.fc1.weight.zero_()
        model.fc1.weight[0] = row
        model.fc1.bias.fill_(-1.0)
        model.fc1.bias[0] = -float(row @ flat[sample]) + bias_gap / 2
    return model


@pytest.mark.parametrize("bias_gap", [14.0, 2.6])
def test_a_unit_that_fires_for_one_sample_is_read_and_blocked(bias_gap):
    """Units like the two MLP cases a relative-error test sent: the server reads the sample at over 40 dB."""
    x = photo_crops(8, 8, seed=3)
    y = torch.arange(8) % 10
    model = one_sample_unit(x, sample=3, bias_gap=bias_gap)
    received = state(model)
    sent = sent_after_sgd(model, x, y)
    server = read_by_server([read_pair(received, sent, "fc1", 0, 0)], x)
    assert list(server) == [3] and server[3] > 40
    decision, to_send = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert 3 in decision.exact_samples and decision.psnr[3] >= server[3] - 1.0


def test_class_fishing_on_a_softmax_regression_is_read_and_blocked():
    """Wen et al.'s class fishing: the target class's logit pushed 1000 below the others, so its softmax output is
    zero for every sample but the one of that class, whose row update is then that sample."""
    x = photo_crops(8, 8, seed=4)
    y = torch.tensor([0, 1, 2, 3, 7, 1, 2, 0])  # sample 4 alone in class 7
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(x[0].numel(), 10))
    with torch.no_grad():
        model[1].weight.mul_(0.01)
        model[1].weight[7] = 0
        model[1].bias.fill_(0.0)
        model[1].bias[7] = -1000.0
    received = state(model)
    sent = sent_after_sgd(model, x, y, lr=0.1)  # float32 spacing at 1000 is 6e-5: the bias update must clear it
    server = read_by_server([read_pair(received, sent, "1", 7, 7)], x)
    assert list(server) == [4]
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block" and 4 in decision.exact_samples
    assert any(r.units == [7] and r.kind == "ratio" and r.sample == 4 for r in decision.readouts)
    # Sample 3 is alone in its class too, and the near-uniform other logits let rows 3 and 9 cancel the rest.
    row_3_minus_9 = read_pair(received, sent, "1", 3, 9, 1.0)
    assert set(read_by_server([row_3_minus_9], x)) <= set(decision.exact_samples)


def scaled_imprint(x: torch.Tensor, units: int, seed: int):
    """Fowl et al.'s binning imprint in fc1 with each unit scaled down by a factor up to 1e5 (its output column up
    by the same: the same function; scaled up, a float32 row would lose its update to rounding) and the units
    shuffled: (model, the units in threshold order, their scales)."""
    generator = torch.Generator().manual_seed(seed)
    flat = x.flatten(1)
    model = MLP(flat.shape[1], width=units)
    brightness = flat.mean(1).sort().values
    thresholds = torch.cat([brightness[:1] - 1.0, (brightness[1:] + brightness[:-1]) / 2])
    thresholds = torch.cat([thresholds, thresholds[-1] + 1.0 + torch.arange(units - len(thresholds))])
    scales = 10 ** (-5 * torch.rand(units, generator=generator))
    order = torch.randperm(units, generator=generator)  # unit order[k] holds threshold k
    with torch.no_grad():
        column = torch.randn(10, generator=generator)
        for k in range(units):
            unit = int(order[k])
            model.fc1.weight[unit] = scales[unit] / flat.shape[1]
            model.fc1.bias[unit] = -scales[unit] * thresholds[k]
            model.fc2.weight[:, unit] = column / scales[unit]
    return model, order, scales


@pytest.mark.parametrize("seed, batch", [(0, None), (1, None), (2, 16), (3, 16)])
def test_a_scaled_and_shuffled_imprint_is_read_and_every_read_sample_named(seed, batch):
    """One step on 64 samples, or four steps of 16 (the thresholds move between steps; the server reads fewer)."""
    x = photo_crops(64, 8, seed=50 + seed)
    y = torch.randint(10, (64,), generator=torch.Generator().manual_seed(seed))
    model, order, scales = scaled_imprint(x, units=100, seed=seed)
    received = state(model)
    sent = sent_after_sgd(model, x, y, batch=batch)
    # The server's readout: neighbouring thresholds, each unit's update (which carries 1 / its scale) brought back.
    readouts = []
    for k in range(len(order) - 1):
        low, high = int(order[k]), int(order[k + 1])
        readouts.append(read_pair(received, sent, "fc1", low, high, float(scales[high] / scales[low])))
    server = read_by_server(readouts, x)
    assert len(server) >= (50 if batch is None else 5)
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block"
    assert set(server) <= set(decision.exact_samples), (sorted(server), decision.exact_samples)


def test_one_unit_with_a_huge_update_silences_no_other():
    """An imprint beside one always-on unit whose output weight is 1e18: its bias update is over 1e12 times the
    imprint's. Each unit is live on its own, so every sample the server reads is still named."""
    x = photo_crops(32, 8, seed=70)
    y = torch.randint(10, (32,), generator=torch.Generator().manual_seed(7))
    imprint, order, scales = scaled_imprint(x, units=40, seed=4)
    model = MLP(x[0].numel(), width=41)
    with torch.no_grad():
        model.fc1.weight.zero_()
        model.fc1.weight[:40] = imprint.fc1.weight
        model.fc1.bias[:40] = imprint.fc1.bias
        model.fc1.bias[40] = 1.0  # on for every sample
        model.fc2.weight.zero_()
        model.fc2.weight[:, :40] = imprint.fc2.weight
        model.fc2.weight[0, 40] = 1e18
        model.fc2.bias.copy_(imprint.fc2.bias)
    received = state(model)
    sent = sent_after_sgd(model, x, y)
    bias_update = sent["fc1.bias"] - received["fc1.bias"]
    assert float(bias_update[:40].abs().max()) < 1e-12 * float(bias_update[40].abs())
    readouts = []
    for k in range(len(order) - 1):
        low, high = int(order[k]), int(order[k + 1])
        readouts.append(read_pair(received, sent, "fc1", low, high, float(scales[high] / scales[low])))
    server = read_by_server(readouts, x)
    assert len(server) >= 10
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block"
    assert set(server) <= set(decision.exact_samples), (sorted(server), decision.exact_samples)


def decayed_imprint(x: torch.Tensor, units: int, loud: float) -> MLP:
    """A binning imprint on the digits' brightness whose rows also hold ``loud`` random weights on the pixels that
    are 0 in every digit: they change no activation, but weight decay's share of the update (−lr·λ·W₀) buries the
    readout under them."""
    flat = x.flatten(1)
    model = MLP(flat.shape[1], width=units)
    brightness = flat.mean(1).sort().values
    thresholds = torch.quantile(brightness, torch.linspace(0, 1, units + 2)[1:-1])
    dark = torch.tensor(datasets.load_digits().data.max(0) == 0)
    generator = torch.Generator().manual_seed(9)
    with torch.no_grad():
        model.fc1.weight.fill_(1 / flat.shape[1])
        model.fc1.weight[:, dark] = loud * torch.randn(units, int(dark.sum()), generator=generator)
        model.fc1.bias.copy_(-thresholds)
        model.fc2.weight.copy_(torch.randn(10, 1, generator=generator).expand(10, units))
    return model


@pytest.mark.parametrize("action", ["block", "drop"])
def test_an_imprint_under_weight_decay_is_read_and_named(action):
    """One SGD step with weight decay: the server, knowing lr and λ, adds lr·λ·W₀ back to the update and reads the
    imprint. The guard reads each ratio and pair with a share of the received weights added back, names every
    sample the server reads, and what it sends after drop shows none of them."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[:32] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:32])
    model = decayed_imprint(x, units=30, loud=100.0)
    received = state(model)
    trained = copy.deepcopy(model)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1, weight_decay=5e-4)
    nn.functional.cross_entropy(trained(x), y).backward()
    optimizer.step()
    sent = state(trained)

    def server(update_of):
        gradient = {
            name: -(update_of[name] - received[name]) / 0.1 - 5e-4 * received[name]
            for name in ("fc1.weight", "fc1.bias")
        }
        at_zero = {name: torch.zeros_like(value) for name, value in gradient.items()}
        pairs = [read_pair(at_zero, gradient, "fc1", k, k + 1, 1.0) for k in range(29)]
        return read_by_server(pairs + [read_pair(at_zero, gradient, "fc1", k, k) for k in range(30)], x)

    assert read_by_server([read_pair(received, sent, "fc1", k, k + 1, 1.0) for k in range(29)], x) == {}
    shown = server(sent)
    assert len(shown) >= 10
    decision, to_send = Guard(model, GuardSettings(action=action, seed=0)).decide(received, sent, x, y)
    assert decision.action == action
    assert set(shown) <= set(decision.exact_samples), (sorted(shown), decision.exact_samples)
    assert any("weight decay" in line for line in decision.reasons)
    if action == "drop":
        assert server(to_send) == {}


@pytest.mark.parametrize("start", [0, 192])
def test_an_imprint_whose_bins_keep_other_samples_at_a_percent_is_read_and_named(start):
    """A binning imprint beside class fishing: the output layer pushes one class's probability down to 1 %, so
    each sample of that class enters its bin at full weight and every other sample at about 1 %. Neighbouring units
    then read the class's samples at about 40 dB, though no two units' signals agree exactly on the other samples;
    the guard names every sample the server reads that way."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[start : start + 64] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[start : start + 64])
    fished, units = 3, 48
    model = MLP(64, width=units)
    brightness = torch.tensor(digits.data / 16.0, dtype=torch.float32).mean(1)
    thresholds = torch.quantile(brightness, torch.linspace(0, 1, units + 2)[1:-1])
    with torch.no_grad():
        model.fc1.weight.fill_(1 / 64)
        model.fc1.bias.copy_(-thresholds)
        model.fc2.weight.zero_()
        model.fc2.weight[fished] = 1e-3  # a gentle slope: the class's logit stays near its bias
        model.fc2.bias.zero_()
        model.fc2.bias[fished] = math.log(0.01 * 9 / 0.99)  # its probability 1 % against nine logits of 0
    received = state(model)
    sent = sent_after_sgd(model, x, y, lr=0.1)
    server = read_by_server([read_pair(received, sent, "fc1", k, k + 1, 1.0) for k in range(units - 1)], x)
    assert server and set(server) <= set(torch.nonzero(y == fished).flatten().tolist())
    assert min(server.values()) < 50  # mixtures, not exact readouts
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block"
    assert set(server) <= set(decision.exact_samples), (sorted(server), decision.exact_samples)


def brightness_bins(brightness: torch.Tensor) -> MLP:
    """Fowl et al.'s binning imprint on 8x8 digits with one bin per distinct brightness: fc1's unit k fires for the
    digits brighter than threshold k, and every unit has the same output column."""
    levels = brightness.unique()  # sorted
    thresholds = torch.cat([levels[:1] - 0.1, (levels[1:] + levels[:-1]) / 2])
    units = len(thresholds)
    model = MLP(64, width=units)
    with torch.no_grad():
        model.fc1.weight.fill_(1 / 64)
        model.fc1.bias.copy_(-thresholds)
        model.fc2.weight.copy_(torch.randn(10, 1, generator=torch.Generator().manual_seed(5)).expand(10, units))
    return model


def test_a_sample_and_its_copy_in_one_bin_are_both_named():
    """A batch that holds one digit twice, and a binning imprint with one bin per distinct brightness: the copies
    share a bin, so no pair of units isolates either one, but the bin's readout is the digit exactly. Both copies
    are named, with every other sample the server reads."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[900:924] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[900:924])
    x[23], y[23] = x[5], y[5]
    model = brightness_bins(x.mean(1))
    units = model.fc1.out_features
    received = state(model)
    sent = sent_after_sgd(model, x, y, lr=0.1)
    server = read_by_server([read_pair(received, sent, "fc1", k, k + 1, 1.0) for k in range(units - 1)], x)
    assert 5 in server or 23 in server
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block"
    assert set(server) | {5, 23} <= set(decision.exact_samples), (sorted(server), decision.exact_samples)


@pytest.mark.parametrize("noise", [1e-3, 1e-2])
def test_a_sample_and_its_near_copy_in_one_bin_are_both_named(noise):
    """The same digit twice, the second with a little noise (60 or 40 dB from the first), and a binning imprint
    whose thresholds put both in one bin: the bin's readout is a mixture of the two, which shows each of them. The
    server's readouts are formed here and compared with every sample; each sample shown at 30 dB or more is named."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[1200:1224] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[1200:1224])
    x[23] = x[7] + noise * torch.randn(64, generator=torch.Generator().manual_seed(3))
    y[23] = y[7]
    brightness = x.mean(1)
    brightness[23] = brightness[7]  # the thresholds see one brightness for the two
    model = brightness_bins(brightness)
    with torch.no_grad():
        model.fc2.bias.zero_()
    units = model.fc1.out_features
    received = state(model)
    sent = sent_after_sgd(model, x, y, lr=0.1)
    shown: dict[int, float] = {}
    for k in range(units - 1):
        readout = read_pair(received, sent, "fc1", k, k + 1, 1.0)
        for sample in range(len(x)):
            if bool(torch.isfinite(readout).all()) and psnr(readout, x[sample]) >= THRESHOLD:
                shown[sample] = max(shown.get(sample, -math.inf), psnr(readout, x[sample]))
    assert 7 in shown and 23 in shown, shown  # the mixture shows both
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block"
    assert set(shown) <= set(decision.exact_samples), (sorted(shown), decision.exact_samples)


def test_a_photograph_and_its_near_copy_in_a_scaled_imprint_are_both_named():
    """A scaled, shuffled imprint built for 63 photo crops, and a batch that adds a slightly noisy copy of one of
    them (same brightness to a few parts in a million: the same bin). The server's neighbouring-threshold readouts
    are compared here with every sample, and every sample one shows at 30 dB or more is named."""
    base = photo_crops(63, 8, seed=71)
    model, order, scales = scaled_imprint(base, units=80, seed=4)
    noise = 3e-3 * torch.randn(base[0].shape, generator=torch.Generator().manual_seed(8))
    x = torch.cat([base, (base[10] + noise - noise.mean())[None]])
    y = torch.randint(10, (64,), generator=torch.Generator().manual_seed(4))
    received = state(model)
    sent = sent_after_sgd(model, x, y)
    shown: dict[int, float] = {}
    for k in range(len(order) - 1):
        low, high = int(order[k]), int(order[k + 1])
        readout = read_pair(received, sent, "fc1", low, high, float(scales[high] / scales[low]))
        if not bool(torch.isfinite(readout).all()):
            continue
        for sample in range(len(x)):
            if psnr(readout, x[sample]) >= THRESHOLD:
                shown[sample] = max(shown.get(sample, -math.inf), psnr(readout, x[sample]))
    assert 10 in shown and 63 in shown, shown
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block"
    assert set(shown) <= set(decision.exact_samples), (sorted(set(shown) - set(decision.exact_samples)), shown)


def six_crops_and_a_wide_mlp() -> tuple[torch.Tensor, torch.Tensor, MLP]:
    """Six 8x8 photo crops, their labels, and an MLP of 128 units at seeded initialisation: at this width some
    units fire for one crop alone."""
    torch.manual_seed(4)
    x = photo_crops(6, 8, seed=33)
    y = torch.randint(10, (6,), generator=torch.Generator().manual_seed(33))
    return x, y, MLP(x[0].numel(), width=128)


@pytest.mark.parametrize("factor", [3.0, 0.25])
def test_biases_on_their_own_learning_rate_do_not_hide_a_readout(factor):
    """An honest MLP on a few photo crops, trained with its biases on their own learning rate (factor times the
    weights'): each unit that fires for one crop reads it at that factor, and a server that set the client's
    learning rates multiplies it back. Every crop it reads at 30 dB or more is named, and the update blocked."""
    x, y, model = six_crops_and_a_wide_mlp()
    received = state(model)
    net = copy.deepcopy(model)
    weights = [p for name, p in net.named_parameters() if name.endswith("weight")]
    biases = [p for name, p in net.named_parameters() if name.endswith("bias")]
    optimizer = torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.02 * factor}], lr=0.02)
    guard = Guard(model)
    with guard.watch(net):
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()
    sent = state(net)
    shown = read_by_server([read_pair(received, sent, "fc1", k, k) * factor for k in range(128)], x)
    assert len(shown) >= 2, shown
    decision, to_send = guard.decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(shown) <= set(decision.exact_samples), (sorted(shown), decision.exact_samples)
    assert any("own learning rate" in line for line in decision.reasons)


def test_a_watched_training_on_flipped_samples_is_checked_as_trained():
    """The client augments: every crop is flipped left to right before the step, and the guard is handed the crops
    as stored. Watching the step, it checks the flipped crops the update was computed on (the server flips its
    readouts back, or reads the flipped crop as it is), names each one the server reads, and says so."""
    x, y, model = six_crops_and_a_wide_mlp()
    received = state(model)
    net = copy.deepcopy(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.02)
    flipped = x.flip(-1)
    guard = Guard(model)
    with guard.watch(net):
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(flipped), y).backward()
        optimizer.step()
    sent = state(net)
    shown = read_by_server([read_pair(received, sent, "fc1", k, k) for k in range(128)], flipped)
    assert len(shown) >= 2, shown
    decision, to_send = guard.decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(shown) <= set(decision.exact_samples), (sorted(shown), decision.exact_samples)
    assert any("augmented" in line for line in decision.notes)


@pytest.mark.parametrize("watched", [True, False])
def test_one_adam_step_on_an_imprint_is_undone_and_read(watched):
    """Fowl et al.'s imprint on photo crops, its output layer scaled down until fc1's gradients are about Adam's eps:
    the client's one Adam step u = -lr g / (|g| + eps) is then a map the server (who knows lr and eps) inverts, and
    it reads neighbouring bins of the gradient. Every crop it reads at 30 dB or more is named, and the update
    blocked; the guard finds lr and eps from the update itself."""
    x = photo_crops(32, 8, seed=61)
    y = torch.randint(10, (32,), generator=torch.Generator().manual_seed(61))
    units, lr, eps = 40, 2e-3, 1e-8
    flat = x.flatten(1)
    brightness = flat.mean(1).sort().values
    thresholds = torch.cat([brightness[:1] - 0.5, (brightness[1:] + brightness[:-1]) / 2])[:units]
    thresholds = torch.cat([thresholds, thresholds[-1] + 1 + torch.arange(units - len(thresholds))])
    model = MLP(flat.shape[1], width=units)
    with torch.no_grad():
        model.fc1.weight.fill_(1 / flat.shape[1])
        model.fc1.bias.copy_(-thresholds)
        model.fc2.weight.copy_(torch.randn(10, 1, generator=torch.Generator().manual_seed(7)).expand(10, units))
        model.fc2.bias.zero_()
    # The server's calibration: fc2 scaled so that fc1's bias gradients are a few eps.
    probe = copy.deepcopy(model)
    nn.functional.cross_entropy(probe(x), y).backward()
    typical = float(probe.fc1.bias.grad[probe.fc1.bias.grad != 0].abs().median())
    with torch.no_grad():
        model.fc2.weight.mul_(3 * eps / typical)
    received = state(model)
    net = copy.deepcopy(model)
    optimizer = torch.optim.Adam(net.parameters(), lr=lr, eps=eps)
    guard = Guard(model)

    def step():
        optimizer.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        optimizer.step()

    if watched:
        with guard.watch(net):
            step()
    else:
        step()
    sent = state(net)

    def undone(update: torch.Tensor) -> torch.Tensor:
        share = (update.double().abs() / lr).clamp(max=1 - 1e-12)
        return -torch.sign(update.double()) * eps * share / (1 - share)

    gw = undone(sent["fc1.weight"] - received["fc1.weight"])
    gb = undone(sent["fc1.bias"] - received["fc1.bias"])
    readouts = [(gw[k] - gw[k + 1]) / (gb[k] - gb[k + 1]) for k in range(units - 1) if gb[k] != gb[k + 1]]
    shown = read_by_server(readouts, x)
    assert len(shown) >= 5, shown
    raw = sent["fc1.weight"] - received["fc1.weight"], sent["fc1.bias"] - received["fc1.bias"]
    as_sent = [(raw[0][k] - raw[0][k + 1]) / (raw[1][k] - raw[1][k + 1]) for k in range(units - 1)]
    assert len(read_by_server(as_sent, x)) < len(shown)  # the update as sent hides most of them
    decision, to_send = guard.decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(shown) <= set(decision.exact_samples), (sorted(shown), decision.exact_samples)
    assert any("Adam's step" in line for line in decision.reasons)


@pytest.mark.parametrize("action", ["drop", "noise"])
def test_what_is_sent_after_drop_or_noise_shows_no_sample_to_the_server(action):
    x = photo_crops(12, 8, seed=21)
    y = torch.randint(10, (12,), generator=torch.Generator().manual_seed(2))
    model, order, scales = scaled_imprint(x, units=20, seed=2)
    received = state(model)
    decision, sent = Guard(model, GuardSettings(action=action, seed=0)).decide(
        received, sent_after_sgd(model, x, y), x, y
    )
    assert decision.action in (action, "block")
    if sent is None:
        return
    readouts = [read_pair(received, sent, "fc1", unit, unit) for unit in range(len(order))]
    for k in range(len(order) - 1):
        low, high = int(order[k]), int(order[k + 1])
        readouts.append(read_pair(received, sent, "fc1", low, high, float(scales[high] / scales[low])))
    assert read_by_server(readouts, x) == {}


@pytest.mark.parametrize("seed", [0, 1])
def test_flowers_quickstart_cnn_at_initialisation_on_photographs_is_sent(seed):
    """Seeded initial weights, a batch of 32 photo crops, one local step: fc1's units that fire for one sample read
    that sample's 400 conv features, which determine far less of the photograph than 30 dB."""
    torch.manual_seed(seed)
    model = QuickstartCNN()
    x = photo_crops(32, 32, seed=seed)
    y = torch.randint(10, (32,), generator=torch.Generator().manual_seed(seed))
    decision, to_send = Guard(model).decide(state(model), sent_after_sgd(model, x, y, lr=0.01), x, y)
    assert decision.action == "send" and to_send is not None, decision.reasons
    assert decision.exact_samples == []
    assert all(decision.psnr[sample] < THRESHOLD for sample in decision.feature_samples)
    strict, _ = Guard(model, GuardSettings(feature_action="block")).decide(
        state(model), sent_after_sgd(model, x, y, lr=0.01), x, y
    )
    assert strict.action == ("block" if decision.feature_samples else "send")


def test_watching_the_clients_training_gives_the_same_decision():
    """The records of the client's own steps stand in for the guard's pass, over two steps."""
    x = photo_crops(12, 8, seed=31)
    y = torch.randint(10, (12,), generator=torch.Generator().manual_seed(3))
    model, order, scales = scaled_imprint(x, units=20, seed=3)
    guard = Guard(model)
    net = copy.deepcopy(model)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    with guard.watch(net):
        for start in (0, 6):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x[start : start + 6]), y[start : start + 6]).backward()
            optimizer.step()
    tables = guard.watching.tables(x)
    assert tables is not None and set(tables[0]) == {"fc1", "fc2"}
    watched, _ = guard.decide(state(model), state(net), x, y)
    alone, _ = Guard(model).decide(state(model), state(net), x, y)
    assert watched.action == alone.action == "block"
    assert watched.exact_samples == alone.exact_samples
    readouts = []
    for k in range(len(order) - 1):
        low, high = int(order[k]), int(order[k + 1])
        readouts.append(read_pair(state(model), state(net), "fc1", low, high, float(scales[high] / scales[low])))
    server = read_by_server(readouts, x)
    assert len(server) >= 3 and set(server) <= set(watched.exact_samples)


class ResidualBlock(nn.Module):
    """A small ResNet-style net: a stem, one residual block of two convolutions, global pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.a = nn.Conv2d(16, 16, 3, padding=1)
        self.b = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = torch.relu(self.stem(x))
        x = torch.relu(x + self.b(torch.relu(self.a(x))))
        return self.head(x.mean(dim=(2, 3)))


class AroundTheFirstLayer(nn.Module):
    """An MLP whose hidden layer also reads eight of the sample's values straight from the input."""

    def __init__(self, inputs: int):
        super().__init__()
        self.fc1 = nn.Linear(inputs, 24)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        flat = x.flatten(1)
        return self.fc2(torch.cat([torch.relu(self.fc1(flat)), flat[:, :8]], 1))


class FlippedFirst(MLP):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1).flip(1))))


@pytest.mark.parametrize("seed, width", [(5, 48), (6, 96)])
def test_the_first_linear_layers_bound_is_at_least_the_exact_figure(seed, width):
    """A first Linear with fewer outputs than inputs bounds what the next layer's features determine, for every
    sample, without their Jacobians: never under the exact figure (the bound errs only towards a block), and on
    photographs under 30 dB. A path around the layer, or an input it reads rearranged, leaves no bound."""
    from rankaudit.guard.features import determined_psnr, first_layer_bounds

    torch.manual_seed(seed)
    x = photo_crops(24, 8, seed=seed + 40)
    mean = x.double().mean(0).flatten()
    samples = list(range(0, 24, 3))
    model = MLP(3 * 8 * 8, width).eval().requires_grad_(False)
    bounds = first_layer_bounds(model, model.fc2, x, mean, samples)
    exact, _ = determined_psnr(model, model.fc2, x, samples)
    assert set(bounds) == set(samples)
    assert all(bounds[n] >= exact[n] - 1e-6 for n in samples), (bounds, exact)
    assert max(bounds.values()) < THRESHOLD
    # The same figures, up to the order in which the mean's float64 sum is taken.
    assert determined_psnr(model, model.fc2, x, samples, THRESHOLD)[0] == pytest.approx(bounds, rel=1e-9)
    for other in (AroundTheFirstLayer(3 * 8 * 8), FlippedFirst(3 * 8 * 8, width)):
        other = other.eval().requires_grad_(False)
        assert first_layer_bounds(other, other.fc2, x, mean, samples) == {}


class StridedCNN(nn.Module):
    def __init__(self, padding: int = 0):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=padding)
        self.fc1 = nn.Linear(4 * (5 + padding) ** 2, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


class InPlaceFirst(StridedCNN):
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(nn.functional.relu(self.conv(x), inplace=True).flatten(1))))


class ReshapedFirst(StridedCNN):
    def forward(self, x):
        return super().forward(x.reshape(len(x), 3, 12, 12))


def test_the_first_convolutions_bound_is_the_projection_on_its_reached_placements():
    """A strided first convolution: the bound is the PSNR of the mean plus the deviation's projection on the filter
    placements whose outputs reach the features, formed here densely from the placements themselves; a padded
    convolution leaves no bound (its border placements are cut)."""
    from rankaudit.guard.features import _features, first_layer_bounds

    torch.manual_seed(8)
    model = StridedCNN().eval().requires_grad_(False)
    x = photo_crops(10, 12, seed=48)
    mean = x.double().mean(0).flatten()
    bounds = first_layer_bounds(model, model.fc2, x, mean, list(range(10)))
    assert set(bounds) == set(range(10))
    for n in range(0, 10, 2):
        sample = x[n : n + 1].clone().requires_grad_(True)
        outputs: list[torch.Tensor] = []
        hook = model.conv.register_forward_hook(lambda mod, args, out, into=outputs: into.append(out))
        features = _features(model, model.fc2, sample)
        hook.remove()
        reached = torch.zeros(outputs[0].shape, dtype=torch.bool)
        for mix in torch.randn((3, *features.shape), generator=torch.Generator().manual_seed(n)):
            (grad,) = torch.autograd.grad((features * mix).sum(), outputs[0], retain_graph=True)
            reached |= grad != 0
        where = torch.nonzero(reached.flatten()).flatten()
        picks = torch.zeros(len(where), reached.numel())
        picks[torch.arange(len(where)), where] = 1
        placements = nn.functional.conv_transpose2d(picks.reshape(-1, *reached.shape[1:]), model.conv.weight, stride=2)
        placements = nn.functional.pad(placements, (0, 12 - placements.shape[-1], 0, 12 - placements.shape[-2]))
        deviation = x[n].double().flatten() - mean
        basis = torch.linalg.svd(placements.reshape(len(where), -1).double(), full_matrices=False)[2]
        unknown = float(deviation @ deviation - ((basis @ deviation) ** 2).sum())
        spread = float(x[n].max() - x[n].min())
        dense = 10 * math.log10(spread**2 / (unknown / deviation.numel()))
        assert dense <= bounds[n] <= dense + 0.05, (n, dense, bounds[n])
    in_place = InPlaceFirst().eval().requires_grad_(False)
    in_place.load_state_dict(model.state_dict())  # a ReLU that changes the first layer's output in place
    assert first_layer_bounds(in_place, in_place.fc2, x, mean, list(range(10))) == bounds
    padded = StridedCNN(padding=1).eval().requires_grad_(False)
    assert first_layer_bounds(padded, padded.fc2, x, mean, list(range(10))) == {}
    # The same values in another layout (a 3x6x24 sample read as 3x12x12): the placements would be others'.
    reshaped = ReshapedFirst().eval().requires_grad_(False)
    wide = x.reshape(10, 3, 6, 24)
    assert first_layer_bounds(reshaped, reshaped.fc2, wide, wide.double().mean(0).flatten(), list(range(10))) == {}


@pytest.mark.parametrize("seed", [2, 3])
def test_the_quickstart_cnns_bound_is_at_least_the_exact_figure_and_under_the_threshold(seed):
    """Flower's quickstart CNN at seeded initial weights, photo crops: the first convolution's bound on what fc1's
    and fc2's features determine is never under the exact figure, and under 30 dB, so no Jacobian is formed."""
    from rankaudit.guard.features import determined_psnr, first_layer_bounds

    torch.manual_seed(seed)
    model = QuickstartCNN().eval().requires_grad_(False)
    x = photo_crops(40, 32, seed=seed + 60)
    mean = x.double().mean(0).flatten()
    samples = [0, 7, 19, 33]
    for layer in (model.fc1, model.fc2):
        bounds = first_layer_bounds(model, layer, x, mean, samples)
        exact, _ = determined_psnr(model, layer, x, samples)
        assert set(bounds) == set(samples)
        assert all(exact[n] - 1e-6 <= bounds[n] < THRESHOLD for n in samples), (bounds, exact)


def test_an_ill_conditioned_first_layer_gives_no_bound():
    """A first Linear with a direction of tiny singular value that the next layer amplifies (weights a server may
    choose): that direction is in J's row space, so the first layer's bound must not drop it; it gives no bound and
    the exact figure decides."""
    from rankaudit.guard.features import determined_psnr, first_layer_bounds

    torch.manual_seed(3)
    x = photo_crops(12, 8, seed=71)
    mean = x.double().mean(0).flatten()
    model = MLP(3 * 8 * 8, 48).eval().requires_grad_(False)
    u, _, v = torch.linalg.svd(model.fc1.weight.double(), full_matrices=False)
    singular = torch.ones(48, dtype=torch.float64)
    singular[0] = 1e-9
    model.fc1.weight.copy_((u * singular) @ v)
    assert first_layer_bounds(model, model.fc2, x, mean, [0, 1]) == {}
    exact, _ = determined_psnr(model, model.fc2, x, [0, 1], THRESHOLD)
    assert exact == determined_psnr(model, model.fc2, x, [0, 1])[0]


# A model that normalises each sample before the layer a server reads: the features are the sample up to its scale
# and offset, which a server that knows the data's range puts back blind (its min and max mapped onto that range).


def digit_rows(count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` random rows of scikit-learn's 8x8 digits (values 0 to 16) and their labels."""
    digits = datasets.load_digits()
    chosen = torch.randperm(len(digits.data), generator=torch.Generator().manual_seed(seed))[:count].numpy()
    return torch.tensor(digits.data[chosen], dtype=torch.float32), torch.tensor(digits.target[chosen])


def read_blind(readouts: list[torch.Tensor], x: torch.Tensor, low: float, high: float, channels: int = 1):
    """read_by_server for a server that knows only the data's range: each readout's (each channel's) smallest value
    mapped to ``low`` and its largest to ``high``, no sample used."""
    mapped = []
    for readout in readouts:
        parts = readout.double().reshape(channels, -1)
        least, most = parts.min(1, keepdim=True).values, parts.max(1, keepdim=True).values
        if bool((most > least).all()):
            mapped.append(((parts - least) / (most - least) * (high - low) + low).reshape(x[0].shape))
    return read_by_server(mapped, x)


class NormalisedMLP(nn.Module):
    """A per-sample normalisation of the input, then Linear - ReLU - Linear, PyTorch's default initialisation."""

    def __init__(self, norm: nn.Module, inputs: int, width: int = 128):
        super().__init__()
        self.norm = norm
        self.fc1 = nn.Linear(inputs, width)
        self.fc2 = nn.Linear(width, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.norm(x).flatten(1))))


def standardise(x):
    flat = x.flatten(1)
    return ((flat - flat.mean(1, keepdim=True)) / flat.std(1, keepdim=True)).reshape(x.shape)


NORMALISATIONS = {
    "layer_norm": lambda shape: nn.LayerNorm(shape),
    "standardise": lambda shape: Lambda(standardise),
    "normalize": lambda shape: Lambda(lambda x: nn.functional.normalize(x.flatten(1), dim=1).reshape(x.shape)),
    "rms_norm": lambda shape: Lambda(lambda x: nn.functional.rms_norm(x, shape)),
}


def honest_round_is_blocked(model, x, y, low, high, channels=1):
    """One honest SGD step; the server reads each fc1 unit's ratio blind. Every sample it shows at 30 dB or more
    is named and the update blocked, with the note that says why."""
    received = state(model)
    sent = sent_after_sgd(model, x, y, lr=0.05)
    readouts = [read_pair(received, sent, "fc1", unit, unit) for unit in range(model.fc1.out_features)]
    server = read_blind([r.reshape(x[0].shape) for r in readouts], x, low, high, channels)
    assert server, "the construction shows the server no sample"
    decision, to_send = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None, decision.reasons
    assert set(server) <= set(decision.exact_samples), (server, decision.psnr)
    assert any("scaled or shifted" in line for line in decision.reasons + decision.notes)
    return server


@pytest.mark.parametrize("name", sorted(NORMALISATIONS))
def test_an_honest_round_of_a_model_that_normalises_each_digit_is_blocked(name):
    torch.manual_seed(0)
    x, y = digit_rows(8, seed=100)
    model = NormalisedMLP(NORMALISATIONS[name]((64,)), 64)
    server = honest_round_is_blocked(model, x, y, 0.0, 16.0)
    assert max(server.values()) > 60  # the normalised digit, read exactly and mapped back


@pytest.mark.parametrize("name", ["layer_norm", "standardise"])
def test_an_honest_round_of_a_model_that_normalises_each_photo_crop_is_blocked(name):
    """Crops whose values span [-1, 1] (a range the server knows) put back blind from their normalised features."""
    crops = photo_crops(400, 8, seed=5)
    spans = crops.flatten(1)
    x = crops[(spans.min(1).values < -0.97) & (spans.max(1).values > 0.97)][:8]
    y = torch.arange(len(x)) % 10
    torch.manual_seed(1)
    model = NormalisedMLP(NORMALISATIONS[name]((3 * 8 * 8,)), 3 * 8 * 8)
    model.norm = model.norm if name == "standardise" else nn.LayerNorm((3, 8, 8))
    honest_round_is_blocked(model, x, y, -1.0, 1.0)


@pytest.mark.parametrize("norm", [nn.InstanceNorm2d(3), nn.GroupNorm(3, 3)])
def test_per_channel_normalisation_of_images_is_caught_by_the_whole_sample_tests(norm):
    """InstanceNorm and GroupNorm are blind to each channel's scale and offset, hence to the whole sample's: the
    two whole-sample tests catch them. Three-channel images, each channel a digit (0 to 16): the server puts each
    channel's range back."""
    rows, y = digit_rows(24, seed=8)
    x = rows.reshape(8, 3, 8, 8)
    torch.manual_seed(2)
    honest_round_is_blocked(NormalisedMLP(norm, 3 * 8 * 8), x, y[:8], 0.0, 16.0, channels=3)


def test_one_group_normalisation_of_photo_crops_is_caught():
    crops = photo_crops(400, 8, seed=5)
    spans = crops.flatten(1)
    x = crops[(spans.min(1).values < -0.97) & (spans.max(1).values > 0.97)][:8]
    torch.manual_seed(4)
    honest_round_is_blocked(NormalisedMLP(nn.GroupNorm(1, 3), 3 * 8 * 8), x, torch.arange(len(x)) % 10, -1.0, 1.0)


def test_an_imprint_after_a_layer_norm_is_read_blind_and_every_read_digit_named():
    """Fowl et al.'s binning imprint on the layer-normalised digit, thresholds at quantiles of public digits:
    neighbouring bins give LayerNorm(x) exactly, and the digits' range 0 to 16 gives x."""
    x, y = digit_rows(32, seed=1)
    public, _ = digit_rows(1000, seed=7)
    units = 100
    torch.manual_seed(0)
    model = NormalisedMLP(nn.LayerNorm(64), 64, width=units)
    direction = torch.randn(64, generator=torch.Generator().manual_seed(3))
    direction /= direction.norm()
    with torch.no_grad():
        cuts = (nn.functional.layer_norm(public, (64,)) @ direction).sort().values
        model.fc1.weight[:] = direction
        model.fc1.bias[:] = -cuts[torch.linspace(0, len(cuts) - 1, units).long()]
        model.fc2.weight[:] = torch.randn(10, 1, generator=torch.Generator().manual_seed(4)).expand(10, units) * 0.1
    received = state(model)
    sent = sent_after_sgd(model, x, y, lr=0.01)
    bins = [read_pair(received, sent, "fc1", unit, unit + 1, scale=1.0) for unit in range(units - 1)]
    server = read_blind(bins, x, 0.0, 16.0)
    assert len(server) >= 10
    decision, to_send = Guard(model).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(server) <= set(decision.exact_samples)


def test_a_scale_blind_first_layer_is_caught_before_its_bound():
    """A bias-free Linear then a LayerNorm: the features do not change when the sample is scaled, so the first
    layer's bound (a bound on a first-order figure) is not asked. The features are the normalised W·x, which tells
    a server W·x up to the scale and offset it puts back: the figure is at least that of the mean plus the
    sample's whole part in W's row space, formed here. A plain MLP's figure is unchanged."""
    from rankaudit.guard.features import determined_psnr

    x, _ = digit_rows(8, seed=2)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(64, 48, bias=False), nn.LayerNorm(48), nn.Linear(48, 32), nn.ReLU())
    figures, notes = determined_psnr(model, model[2], x, [0, 5], THRESHOLD)
    assert any("scaled or shifted" in line for line in notes)
    basis = torch.linalg.svd(model[0].weight.detach().double().T, full_matrices=False)[0]
    mean = x.double().mean(0)
    for n in (0, 5):
        sample = x[n].double()
        shown = mean + basis @ (basis.T @ (sample - mean))
        assert figures[n] >= psnr(shown, sample) - 1e-6, (figures[n], psnr(shown, sample))
    plain = nn.Sequential(nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU())
    figures, notes = determined_psnr(plain, plain[2], x, [0, 5], THRESHOLD)
    assert all(figure < THRESHOLD for figure in figures.values()) and notes == []


def test_statistics_that_do_not_come_from_the_sample_and_constant_features_are_not_a_normalisation():
    """A BatchNorm in eval mode (running statistics) and features that no change of the sample moves (every ReLU
    before them off) keep their figures: no note, nothing counted as the sample."""
    from rankaudit.guard.features import determined_psnr

    x, _ = digit_rows(8, seed=2)
    torch.manual_seed(3)
    images = x.reshape(8, 1, 8, 8)
    normed = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 16)).eval()
    with torch.no_grad():
        normed[1].running_mean.uniform_(-1, 1)
        normed[1].running_var.uniform_(0.5, 2)
    figures, notes = determined_psnr(normed, normed[4], images, [0, 5])
    assert notes == [] and all(figure < THRESHOLD for figure in figures.values())
    dead = nn.Sequential(nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    with torch.no_grad():
        dead[0].bias.fill_(-1e4)  # every first unit off: the second layer's output is its bias, for every sample
        dead[2].bias.uniform_(0.5, 1)
    figures, notes = determined_psnr(dead, dead[4], x, [0, 5])
    assert notes == [] and all(figure < THRESHOLD for figure in figures.values())


class NormalisedBottleneck(nn.Module):
    """LayerNorm, then a bottleneck of three units, then two more layers: fc2 and fc3 read three numbers (or functions
    of three) per sample, which cannot show a 64-pixel digit; fc1 reads the normalised digit itself."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.fc1 = nn.Linear(64, 3)
        self.fc2 = nn.Linear(3, 32)
        self.fc3 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(self.norm(x))))))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_normalisation_then_a_bottleneck_blocks_only_on_the_normalised_digit_itself(seed):
    """Features after the bottleneck fix a few directions of the normalised digit: judged with its scale and offset
    given to the server, they show it far under 30 dB. Every block names only digits that fc1's own ratio shows
    the server blind (the normalised digit mapped onto 0..16) at 30 dB or more."""
    torch.manual_seed(seed)
    x, y = digit_rows(8, seed=200 + seed)
    model = NormalisedBottleneck()
    received = state(model)
    sent = sent_after_sgd(model, x, y, lr=0.05)
    readouts = [read_pair(received, sent, "fc1", unit, unit) for unit in range(3)]
    server = read_blind(readouts, x, 0.0, 16.0)
    decision, _ = Guard(model).decide(received, sent, x, y)
    assert set(decision.exact_samples) == set(server), (decision.exact_samples, server, decision.notes)
    deeper = [r for r in decision.readouts if r.layer in ("fc2", "fc3")]
    assert all(r.sample_psnr < THRESHOLD for r in deeper), [(r.layer, r.sample, r.sample_psnr) for r in deeper]
