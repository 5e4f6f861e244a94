"""What keeps the guard cheap does not change what it finds: the pair search's in-place block gives the pairs its
definition gives, and a re-read of an altered update reuses what each sample's features determine instead of
forming the sample's Jacobian again."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from rankaudit.guard import features, placements
from rankaudit.guard.measure import MeasuredInputs, live_judge, measure
from rankaudit.guard.pairs import PARALLEL, candidate_pairs
from rankaudit.guard.readout import LayerInputs, find_readouts
from rankaudit.settings.guard_options import GuardSettings


def pairs_by_definition(signals: torch.Tensor) -> set[tuple[int, int, int]]:
    """(i, j, s) for units i < j whose signals, sample s left out, have squared sine at most PARALLEL, and whose
    combination leaves something at s: straight from the definition, in float64, one pair at a time."""
    found = set()
    count, units = signals.shape
    for i in range(units):
        for j in range(i + 1, units):
            a, b = signals[:, i], signals[:, j]
            for s in range(count):
                keep = torch.arange(count) != s
                a_, b_ = a[keep], b[keep]
                if float(a_ @ a_) == 0 or float(b_ @ b_) == 0:
                    continue
                sine = 1 - float(a_ @ b_) ** 2 / (float(a_ @ a_) * float(b_ @ b_))
                ratio = float(a_ @ b_) / float(b_ @ b_)
                if sine <= PARALLEL and abs(float(a[s] - ratio * b[s])) > 1e-6 * math.sqrt(float(a @ a)):
                    found.add((i, j, s))
    return found


def test_the_pair_search_finds_exactly_the_pairs_of_its_definition():
    generator = torch.Generator().manual_seed(3)
    signals = torch.randn(24, 12, generator=generator, dtype=torch.float64)
    signals *= torch.rand(24, 12, generator=generator, dtype=torch.float64) < 0.6  # ReLU-like zeros
    signals[:, 7] = -250.0 * signals[:, 2]  # any scale and sign
    signals[5, 7] += 3.0
    signals[:, 9] = 1e-3 * signals[:, 4]
    signals[11, 4] = 0.5 if float(signals[11, 4]) == 0 else 0.0
    found = {(i, j, s) for i, j, s, _ in candidate_pairs(signals)}
    assert found == pairs_by_definition(signals)
    assert {(2, 7, 5), (4, 9, 11)} <= found


def test_the_pair_search_leaves_out_no_pair_of_its_definition_on_imprints_and_dominant_samples():
    """The search first leaves out pairs that no sample can make parallel (from sums over the samples); on signals
    built to sit near that line (an imprint's nested thresholds, units carried by one sample, near-parallel pairs,
    tanh-like signals without zeros) it still finds every pair its definition gives."""
    generator = torch.Generator().manual_seed(11)
    count = 36
    upstream = torch.randn(count, generator=generator, dtype=torch.float64)
    brightness = torch.rand(count, generator=generator, dtype=torch.float64)
    thresholds = torch.sort(brightness).values[[3, 4, 9, 10, 11, 20]]
    imprint = upstream[:, None] * (brightness[:, None] >= thresholds[None, :]) * torch.tensor([1.0, -3.0, 1e4, 1, 2, 5])
    carried = 1e-3 * torch.randn(count, 3, generator=generator, dtype=torch.float64)
    carried[7, 0], carried[7, 1], carried[19, 2] = 40.0, -25.0, 8.0  # each unit's energy mostly one sample's
    base = torch.randn(count, generator=generator, dtype=torch.float64)
    near = torch.stack([base, 2.0 * base + 1e-6 * torch.randn(count, generator=generator, dtype=torch.float64)], 1)
    near[30, 1] += 4.0
    smooth = torch.tanh(torch.randn(count, 3, generator=generator, dtype=torch.float64))
    signals = torch.cat([imprint, carried, near, smooth], 1)[:, torch.randperm(14, generator=generator)]
    found = {(i, j, s) for i, j, s, _ in candidate_pairs(signals)}
    expected = pairs_by_definition(signals)
    assert found == expected and len(expected) >= 6


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(48, 16)
        self.fc2 = nn.Linear(16, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def test_a_re_read_of_an_update_forms_each_samples_jacobian_once(monkeypatch):
    """fc1's unit 0 fires for sample 2 alone: fc2 reads sample 2's features, which determine it. A re-read with
    the same received weights (what drop and noise do after altering the update) reuses the figure, the same."""
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    model = MLP()
    x, y = torch.rand(8, 3, 4, 4, generator=generator), torch.randint(10, (8,), generator=generator)
    flat = x.flatten(1)
    with torch.no_grad():
        direction = flat[2] - flat.mean(0)
        scores = flat @ direction
        runner_up = scores[torch.arange(8) != 2].max()
        model.fc1.weight.zero_()
        model.fc1.weight[0] = direction
        model.fc1.bias.fill_(-1.0)
        model.fc1.bias[0] = -(scores[2] + runner_up) / 2
    received = {name: value.clone() for name, value in model.state_dict().items()}
    trained = copy.deepcopy(model)
    optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
    nn.functional.cross_entropy(trained(x), y).backward()
    optimizer.step()
    sent = trained.state_dict()
    formed = []
    original = features.jacobian

    def counted(net, module, sample):
        formed.append((id(module), sample.numpy().tobytes()))
        return original(net, module, sample)

    monkeypatch.setattr(features, "jacobian", counted)
    inputs = LayerInputs(model, received, list(received))
    reads = [find_readouts(inputs, received, sent, x, 30.0, labels=y)[0] for _ in range(2)]
    first, again = ({(r.layer, tuple(r.units), r.sample): r.sample_psnr for r in found} for found in reads)
    assert first == again and any(layer == "fc2" and sample == 2 for layer, _, sample in first)
    assert len(formed) == len(set(formed)) == len({(layer, sample) for layer, _, sample in first if layer == "fc2"})
    # The same through the guard's own path (what Guard.decide and its drop/noise re-reads call).
    formed.clear()
    measured, layer_inputs = measure(model, received, sent, x, y, GuardSettings())
    view = MeasuredInputs(measured, received, x, judge=live_judge(layer_inputs))
    reads = [view.find(received, sent, y, 30.0, check_features=True)[0] for _ in range(2)]
    first, again = ({(r.layer, tuple(r.units), r.sample): r.sample_psnr for r in found} for found in reads)
    assert first == again and formed and len(formed) == len(set(formed))


def test_a_layer_read_with_the_features_at_both_weights_searches_its_pairs_once(monkeypatch):
    """Without the watch, a hidden layer's readouts are matched with its features at the received and at the sent
    weights; the pairs come from the same signals both times, so each signal table is searched once, and what is
    found is what a search for each match finds (here an imprint on the features of a layer that passes the
    digits on)."""
    from sklearn.datasets import load_digits

    from rankaudit.guard import readout

    digits = load_digits()
    x = torch.tensor(digits.data[:24] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:24])
    torch.manual_seed(0)
    model = MaskedDigits()
    model.mask.fill_(1.0)
    with torch.no_grad():
        model.fc0.weight.copy_(torch.eye(64))
        model.fc0.bias.fill_(1.0)
        brightness = (x + 1).mean(1).sort().values
        model.fc1.weight.fill_(1 / 64)
        model.fc1.bias.zero_()
        model.fc1.bias[:23] = -(brightness[1:] + brightness[:-1]) / 2  # a bin between each two samples
        model.fc2.weight[:, :23] = torch.randn(10, 1, generator=torch.Generator().manual_seed(1))  # one column
    received = {name: value.clone() for name, value in model.state_dict().items()}
    trained = copy.deepcopy(model)
    nn.functional.cross_entropy(trained(x), y).backward()
    torch.optim.SGD(trained.parameters(), lr=0.1).step()
    sent = trained.state_dict()
    shared = list(received)

    def found(share_searches: bool):
        searched = []
        original_search, original_layer = readout.isolating_and_nearly, readout.layer_readouts

        def search(table):
            searched.append(table)
            return original_search(table)

        def layer(*args):
            return original_layer(*args) if share_searches else original_layer(*args[:8], None, *args[9:])

        monkeypatch.setattr(readout, "isolating_and_nearly", search)
        monkeypatch.setattr(readout, "layer_readouts", layer)
        inputs, at_sent = LayerInputs(model, received, shared), LayerInputs(model, {**received, **sent}, shared)
        readouts = find_readouts(inputs, received, sent, x, 30.0, labels=y, at_sent=at_sent)[0]
        monkeypatch.undo()
        return {(r.layer, tuple(r.units), r.kind, r.sample, r.psnr) for r in readouts}, searched

    shared_found, once = found(True)
    own_found, each = found(False)
    assert shared_found == own_found
    assert sum(kind == "pair" and layer == "fc1" for layer, _, kind, _, _ in shared_found) >= 10
    assert len({id(table) for table in once}) == len(once) < len(each)


class _Cube(torch.autograd.Function):
    """x³ with its own backward, in the old style that vmap cannot batch."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x**3

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 3 * x**2 * grad


class SmallCNN(nn.Module):
    def __init__(self, custom: bool = False):
        super().__init__()
        self.custom = custom
        self.conv = nn.Conv2d(3, 4, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc1 = nn.Linear(4 * 3 * 3, 12)
        self.fc2 = nn.Linear(12, 10)

    def forward(self, x):
        x = self.conv(x)
        x = _Cube.apply(x) if self.custom else torch.relu(x)
        h = torch.relu(self.fc1(self.pool(x).flatten(1)))
        return self.fc2(h)


@pytest.mark.parametrize("custom", [False, True], ids=["batched", "copies"])
def test_a_features_jacobian_is_autograds_own_jacobian(custom):
    """The rows the guard forms (batched vector-Jacobian products, or, for an operation vmap cannot batch, one
    backward over copies of the sample) are torch.autograd.functional.jacobian's, the zero rows left out."""
    torch.manual_seed(1)
    net = SmallCNN(custom).eval().requires_grad_(False)
    x = torch.randn(3, 8, 8, generator=torch.Generator().manual_seed(2))
    for module in (net.fc1, net.fc2):
        rows = features.jacobian(net, module, x)
        full = torch.autograd.functional.jacobian(lambda one, at=module: features._features(net, at, one[None])[0], x)
        full = full.reshape(len(full), -1)
        nonzero = full[full.abs().sum(1) > 0]
        assert len(nonzero) <= len(rows) <= len(full)
        kept = [row for row in rows if bool(row.any())]
        assert torch.allclose(torch.stack(kept), nonzero, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("schedule", ["in order", "then shuffled", "shuffled first"])
def test_the_watched_tables_are_the_same_in_the_trainings_order_or_any_other(schedule):
    """Steps that run through the samples in order are matched by position, any other order by each sample's
    bytes: the same tables, row for row; also when an epoch in order is followed by shuffled steps, or a shuffled
    step (some samples seen out of order) by steps in order."""
    from rankaudit.guard.watch import Watch

    generator = torch.Generator().manual_seed(4)
    model = MLP()
    x, y = torch.rand(24, 3, 4, 4, generator=generator), torch.randint(10, (24,), generator=generator)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    later = torch.randperm(24, generator=generator)[:16] if schedule == "then shuffled" else torch.arange(16)
    batches = [torch.arange(0, 8), torch.arange(8, 16), torch.arange(16, 24), later[:8], later[8:]]
    if schedule == "shuffled first":  # ending at the last sample: the next step, in order, starts where it left
        batches = [torch.cat([torch.randperm(23, generator=generator)[:9], torch.tensor([23])])] + batches
    with Watch(model) as watch:
        for rows in batches:  # an epoch and part of the next
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
    in_order = watch.tables(x)
    order = torch.randperm(24, generator=generator)
    shuffled = watch.tables(x[order])
    assert in_order is not None and shuffled is not None
    for ours, theirs in zip(in_order[:2], shuffled[:2]):
        assert set(ours) == set(theirs) == {"fc1", "fc2"}
        assert all(torch.allclose(ours[name][order], theirs[name], rtol=1e-12, atol=0) for name in ours)
    assert watch.tables(x[:20]) is None  # steps on samples the guard was not given


class TwoConvCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.conv2 = nn.Conv2d(6, 8, 3)
        self.fc1 = nn.Linear(8 * 5 * 5, 12)
        self.fc2 = nn.Linear(12, 10)

    def forward(self, x):
        x = nn.functional.max_pool2d(torch.relu(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def test_the_banded_factorisation_gives_the_whole_matrixs_bound(monkeypatch):
    """The first convolution's bound, its Gram matrix factored a band-wide block at a time, is the one the whole
    matrix gives (one block), on photo crops; with two identical filters the Gram matrix is singular, and neither
    gives a bound."""
    from sklearn.datasets import load_sample_images

    torch.manual_seed(12)
    image = torch.tensor(load_sample_images().images[1]).permute(2, 0, 1).float() / 255
    x = torch.stack([image[:, 40 + 7 * n : 64 + 7 * n, 100 + 5 * n : 124 + 5 * n] for n in range(12)])
    mean = x.double().mean(0).flatten()
    model = TwoConvCNN().eval().requires_grad_(False)
    samples = [0, 3, 5, 8, 11]
    monkeypatch.setattr(placements, "MIN_BLOCK", 1)
    banded = features.first_layer_bounds(model, model.fc1, x, mean, samples)
    monkeypatch.setattr(placements, "MIN_BLOCK", 10**6)
    whole = features.first_layer_bounds(model, model.fc1, x, mean, samples)
    assert set(banded) == set(samples) and banded == pytest.approx(whole, rel=1e-9)
    model.conv1.weight[1] = model.conv1.weight[0]
    model.conv1.bias[1] = model.conv1.bias[0]
    monkeypatch.setattr(placements, "MIN_BLOCK", 1)
    assert features.first_layer_bounds(model, model.fc1, x, mean, samples) == {}
    monkeypatch.setattr(placements, "MIN_BLOCK", 10**6)
    assert features.first_layer_bounds(model, model.fc1, x, mean, samples) == {}


def test_layers_that_read_the_same_samples_share_one_bound_per_sample(monkeypatch):
    """Two layers read some of the same samples' features: the first convolution's bound is formed once per sample,
    for both layers' features together, and it is at least each layer's own bound and each layer's exact figure."""
    from sklearn.datasets import load_sample_images

    torch.manual_seed(5)
    image = torch.tensor(load_sample_images().images[0]).permute(2, 0, 1).float() / 255
    x = torch.stack([image[:, 60 + 9 * n : 88 + 9 * n, 200 + 4 * n : 228 + 4 * n] for n in range(12)])
    model = TwoConvCNN().eval().requires_grad_(False)
    model.fc1.weight[:, 40:] = 0  # fc2's features depend on fewer of the first convolution's outputs than fc1's
    formed = []
    original = placements._seen_through_band
    monkeypatch.setattr(placements, "_seen_through_band", lambda *args: formed.append(1) or original(*args))
    pending = {"fc1": [0, 3, 5, 8], "fc2": [3, 5, 8, 11]}
    figures, _ = features.determined_by_layer(model, {"fc1": model.fc1, "fc2": model.fc2}, x, pending, 30.0)
    assert len(formed) == 5  # samples 0, 3, 5, 8 and 11, once each
    mean = x.double().mean(0).flatten()
    for name in pending:
        layer = getattr(model, name)
        own = features.first_layer_bounds(model, layer, x, mean, pending[name])
        exact, _ = features.determined_psnr(model, layer, x, pending[name])
        assert set(figures[name]) == set(pending[name])
        for n in pending[name]:
            assert own[n] - 1e-9 <= figures[name][n] < 30.0
            assert exact[n] - 1e-6 <= figures[name][n]


class MaskedDigits(nn.Module):
    """An MLP whose input mask is a buffer outside the state dict, which the client changes between rounds."""

    def __init__(self):
        super().__init__()
        mask = torch.ones(64)
        mask[::2] = 0
        self.register_buffer("mask", mask, persistent=False)
        self.fc0, self.fc1, self.fc2 = nn.Linear(64, 64), nn.Linear(64, 40), nn.Linear(40, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.fc0(x * self.mask)))))


def test_a_guard_judges_each_round_with_the_model_as_it_is_then():
    """A guard used for several rounds measures each with the model as it is at that round: state outside the state
    dict (here a mask buffer the client opens between rounds) counts, so a sample whose features show it is read
    and blocked, as a guard made for that round alone does."""
    from sklearn.datasets import load_digits

    from rankaudit.guard.decide import Guard

    digits = load_digits()
    x = torch.tensor(digits.data[:24] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[:24])
    torch.manual_seed(0)
    model = MaskedDigits()

    def update():
        received = {name: value.clone() for name, value in model.state_dict().items()}
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        nn.functional.cross_entropy(trained(x), y).backward()
        optimizer.step()
        return received, trained.state_dict()

    guard = Guard(model)
    guard.decide(*update(), x, y)
    model.mask.fill_(1.0)  # the next round sees every pixel
    with torch.no_grad():  # fc0 passes the pixels on; each fc1 unit fires for one sample (trap weights)
        model.fc0.weight.copy_(torch.eye(64))
        model.fc0.bias.fill_(1.0)
        directions = torch.randn(40, 64, generator=torch.Generator().manual_seed(1)) / 8
        top = ((x + 1) @ directions.T).topk(2, dim=0).values
        model.fc1.weight.copy_(directions)
        model.fc1.bias.copy_(-(top[0] + top[1]) / 2)
    received, sent = update()
    later, _ = guard.decide(received, sent, x, y)
    fresh, _ = Guard(model).decide(received, sent, x, y)
    assert later.action == fresh.action == "block"
    assert later.exact_samples == fresh.exact_samples and len(later.exact_samples) >= 10


@pytest.mark.parametrize("reach", [0, 1, 2, 4])
@pytest.mark.parametrize("min_block", [1, 5, 64])
def test_the_band_blocks_leave_the_gram_matrix_block_tridiagonal(reach, min_block, monkeypatch):
    """The banded factorisation's blocks cover the placements in order, and any two blocks with one between them
    lie more than ``reach`` rows apart (their placements cannot overlap), rows with no placement included."""
    monkeypatch.setattr(placements, "MIN_BLOCK", min_block)
    generator = torch.Generator().manual_seed(reach * 100 + min_block)
    for _ in range(20):
        rows = torch.sort(
            torch.randint(0, 30, (int(torch.randint(1, 200, (1,), generator=generator)),), generator=generator)
        ).values
        blocks = placements._blocks(rows, reach)
        assert blocks[0][0] == 0 and blocks[-1][1] == len(rows)
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(blocks, blocks[1:]))
        for before, after in zip(blocks, blocks[2:]):
            assert int(rows[after[0]]) - int(rows[before[1] - 1]) > reach


def test_watched_records_are_copies_that_a_refilled_buffer_does_not_change():
    """The watch copies each step's batch and layer inputs: a loader that refills one buffer for every step, here
    through NumPy (which no version counter of torch sees), leaves the same tables as fresh batches do."""
    from rankaudit.guard.watch import Watch

    generator = torch.Generator().manual_seed(6)
    x, y = torch.rand(8, 3, 4, 4, generator=generator), torch.randint(10, (8,), generator=generator)
    orders = (torch.arange(8), torch.randperm(8, generator=generator))  # two epochs of one batch
    tables = []
    for refilled in (True, False):
        torch.manual_seed(2)
        model = MLP()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        buffer = torch.empty(8, 3, 4, 4)
        with Watch(model) as watch:
            for rows in orders:
                if refilled:
                    buffer.numpy()[...] = x[rows].numpy()
                batch = buffer if refilled else x[rows].clone()
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(batch), y[rows]).backward()
                optimizer.step()
        tables.append(watch.tables(x))
    assert tables[0] is not None and tables[1] is not None
    for ours, theirs in zip(tables[0][:2], tables[1][:2]):
        assert all(torch.equal(ours[name], theirs[name]) for name in ours)


class KernelFourCNN(nn.Module):
    """A first convolution of kernel 4 and stride 2 (placements overlap one row apart), then two Linear layers."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 4, stride=2)
        self.fc1 = nn.Linear(5 * 9 * 9, 24)
        self.fc2 = nn.Linear(24, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(torch.relu(self.conv(x)).flatten(1))))


def test_the_convolutions_bound_for_several_samples_is_each_samples_own():
    """The first convolution's bound formed for several samples at once (their placements indexed together) is
    the one each sample gets alone, and a sample whose placements' Gram matrix has no factor (two identical
    filters that both reach its features) gets no bound while the others keep theirs; on crops of 20 x 20 of both
    photographs and weights drawn here."""
    from sklearn.datasets import load_sample_images

    torch.manual_seed(21)
    images = [torch.tensor(image).permute(2, 0, 1).float() / 255 for image in load_sample_images().images]
    x = torch.stack([images[n % 2][:, 30 + 37 * n : 50 + 37 * n, 60 + 23 * n : 80 + 23 * n] for n in range(10)])
    x = (x - 0.5) / 0.5
    model = KernelFourCNN().eval().requires_grad_(False)
    # Filter 1 is filter 0, firing only where filter 0's response is high: the samples with such a patch have two
    # identical placements that reach the features, the others none.
    model.conv.weight[1] = model.conv.weight[0]
    model.conv.bias[0] = 50.0
    response = nn.functional.conv2d(x, model.conv.weight[:1], stride=2).amax(dim=(1, 2, 3))
    ordered = torch.sort(response).values
    threshold = float(ordered[4] + ordered[5]) / 2  # between two samples' largest responses: no one at the kink
    model.conv.bias[1] = -threshold
    duplicated = {n for n in range(10) if float(response[n]) > threshold}
    assert 0 < len(duplicated) < 10
    mean = x.double().mean(0).flatten()
    together = features.first_layer_bounds(model, model.fc2, x, mean, list(range(10)))
    assert set(together) == set(range(10)) - duplicated
    for n in range(10):
        alone = features.first_layer_bounds(model, model.fc2, x, mean, [n])
        assert alone == ({} if n in duplicated else pytest.approx({n: together[n]}, rel=1e-9))
    exact, _ = features.determined_psnr(model, model.fc2, x, sorted(together))
    assert all(together[n] >= exact[n] - 1e-6 for n in together), (together, exact)
