"""Every pair of units read against every sample, at a layer that reads the samples: without the watch, each
minibatch step of an imprint isolates its own samples, which no one set of signals at the received or the sent weights
shows; with it, a bin can mix a sample with a little of another. Each leak is judged by a readout written here, from
the float32 update the guard lets out."""

from __future__ import annotations

import torch
from sklearn import datasets
from torch import nn

from rankaudit.guard.decide import Guard

THRESHOLD = 30.0


def server_reads(received: dict, sent: dict, x: torch.Tensor, layer: str) -> dict[int, float]:
    """Every unit's ratio and every pair's (ΔW_i − ΔW_j) / (Δb_i − Δb_j), each against every sample: {sample: the
    best PSNR} at 30 dB or above (peak: the sample's own range)."""
    rows = sent[f"{layer}.weight"].double() - received[f"{layer}.weight"].double()
    bias = sent[f"{layer}.bias"].double() - received[f"{layer}.bias"].double()
    first, second = torch.triu_indices(len(bias), len(bias), 1)
    numerators = torch.cat([rows, rows[first] - rows[second]])
    denominators = torch.cat([bias, bias[first] - bias[second]])
    usable = denominators != 0
    readouts = numerators[usable] / denominators[usable][:, None]
    samples = x.double().flatten(1)
    errors = ((readouts[:, None, :] - samples[None, :, :]) ** 2).mean(2)
    peak = samples.amax(1) - samples.amin(1)
    psnr = (10 * torch.log10(peak[None, :] ** 2 / errors.clamp_min(1e-300))).amax(0)
    return {n: float(psnr[n]) for n in range(len(samples)) if psnr[n] >= THRESHOLD}


def test_an_imprint_over_minibatch_steps_that_were_not_watched_is_read_by_every_pair():
    """Fowl et al.'s binning imprint (rows of 1/64, bins on public digits' brightness, one column after) and a
    client that trains as most do: one epoch of SGD on shuffled minibatches of 8. Each step's bins hold that step's
    own samples; over the 96 samples the bins hold many, so the signals at either end of the round propose no pair
    that isolates one, while the server reads the samples each step isolated. Without the watch, every pair is read
    against every sample: each is named and the update blocked."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[600:696] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[600:696])
    brightness = torch.tensor(digits.data[1100:1700] / 16.0, dtype=torch.float32).mean(1).sort().values
    bins = 12

    def imprinted() -> nn.Sequential:
        model = nn.Sequential(nn.Linear(64, bins), nn.ReLU(), nn.Linear(bins, 10))
        with torch.no_grad():
            model[0].weight.fill_(1 / 64)
            model[0].bias.copy_(-brightness[torch.linspace(0, len(brightness) - 1, bins).long()])
            model[2].weight.copy_(torch.randn(10, 1, generator=torch.Generator().manual_seed(4)).expand(10, bins))
        return model

    model = imprinted()
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for batch in torch.randperm(len(x), generator=torch.Generator().manual_seed(7)).split(8):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
        optimizer.step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}

    read = server_reads(received, sent, x, "0")
    assert len(read) >= 3
    decision, to_send = Guard(imprinted()).decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(read) <= set(decision.exact_samples), (read, decision.exact_samples)


class Imprinted(nn.Module):
    def __init__(self, bins: int, edges: torch.Tensor | None = None):
        super().__init__()
        self.fc1 = nn.Linear(64, bins)
        self.fc2 = nn.Linear(bins, 10)
        if edges is not None:
            with torch.no_grad():
                self.fc1.weight.fill_(1 / 64)
                self.fc1.bias.copy_(-edges)
                self.fc2.weight.copy_(torch.randn(10, 1, generator=torch.Generator().manual_seed(2)).expand(10, bins))

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_the_watch_ties_a_keyword_call_to_its_step_and_says_when_it_saw_no_call():
    """A training loop that calls the model with its batch as a keyword is watched like one that passes it first; one
    that calls net.forward(batch) skips the hooks around the call, and the decision says that its steps were not
    seen rather than reading the update silently as an unwatched one."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[40:72] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[40:72])
    brightness = x.mean(1).sort().values
    edges = torch.cat([brightness[:1] - 1, (brightness[1:] + brightness[:-1]) / 2])  # one digit per bin
    decisions = {}
    for how in ("keyword", "forward"):
        model = Imprinted(len(edges), edges)
        received = {name: value.detach().clone() for name, value in model.state_dict().items()}
        guard = Guard(Imprinted(len(edges)))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with guard.watch(model) as watch:
            optimizer.zero_grad()
            logits = model(x=x) if how == "keyword" else model.forward(x)
            nn.functional.cross_entropy(logits, y).backward()
            optimizer.step()
        assert len(watch.steps) == (1 if how == "keyword" else 0)
        sent = {name: value.detach().clone() for name, value in model.state_dict().items()}
        decisions[how] = guard.decide(received, sent, x, y)[0]
        assert decisions[how].action == "block" and len(decisions[how].exact_samples) >= 20
    assert not any("the watch saw the layers train" in note for note in decisions["keyword"].notes)
    assert any("net.forward(x) called directly" in note for note in decisions["forward"].notes)


def test_unwatched_honest_rounds_on_four_features_block_no_more_than_watched_ones():
    """Iris, standardised (four features), an honest MLP over three epochs of minibatches. With four values per
    sample, the readouts of some pair of units at some scale pass within 30 dB of samples the client never had as
    often as of its own: a scale fitted to the sample is not one a server can choose. Without the watch, a pair is
    read for every sample only where the two units' signals agree at its scale on most samples (an imprint's
    neighbours do); the unwatched guard then blocks no honest round that the watched one, which has the steps'
    own signals, sends."""
    iris = datasets.load_iris()
    data = torch.tensor(iris.data, dtype=torch.float32)
    data = (data - data.mean(0)) / data.std(0)
    labels = torch.tensor(iris.target)
    blocked = {"watched": set(), "unwatched": set()}
    for seed in range(6):
        chosen = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed))[:32]
        x, y = data[chosen], labels[chosen]
        for how in blocked:
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
            received = {name: value.detach().clone() for name, value in model.state_dict().items()}
            guard = Guard(nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)))
            if how == "watched":
                with guard.watch(model):
                    three_epochs(model, x, y, seed)
            else:
                three_epochs(model, x, y, seed)
            sent = {name: value.detach().clone() for name, value in model.state_dict().items()}
            if guard.decide(received, sent, x, y)[0].action == "block":
                blocked[how].add(seed)
    assert blocked["unwatched"] <= blocked["watched"], blocked


def three_epochs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        for batch in torch.randperm(len(x), generator=torch.Generator().manual_seed(10 * seed + epoch)).split(8):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()


def test_a_watched_training_that_left_samples_out_says_so_and_keeps_the_rest():
    """A loader that drops its last incomplete batch runs 24 of 26 digits: the watch's records do not cover every
    sample given, and none is an augmented copy. The decision checks the 24 as trained, says which given samples
    they are, and still names the digits the imprint reads."""
    digits = datasets.load_digits()
    x = torch.tensor(digits.data[100:126] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[100:126])
    brightness = x.mean(1).sort().values
    edges = torch.cat([brightness[:1] - 1, (brightness[1:] + brightness[:-1]) / 2])
    model = Imprinted(len(edges), edges)
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    guard = Guard(Imprinted(len(edges)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, drop_last=True)
    with guard.watch(model):
        for batch, labels in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(batch), labels).backward()
            optimizer.step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}
    decision = guard.decide(received, sent, x, y)[0]
    assert any("ran on 24 of the 26 samples given and on no others" in note for note in decision.notes)
    assert not any("augmented" in note for note in decision.notes)
    assert decision.action == "block" and decision.exact_samples


def test_a_watched_imprint_whose_bin_mixes_two_digits_is_read_by_every_pair():
    """Watched this time: Fowl et al.'s imprint over 80 digits without a 9, in steps of 8, the softmax saturated on
    class 9 (its column -100 for every unit), so every step's signals are alike. One bin ends up holding a digit and
    a little of another: no pair isolates one sample in the steps' signals, and the server's own neighbouring pair
    shows digit 3 at 33 dB. Every pair is read against every sample at a layer that reads them, watched or not."""
    digits = datasets.load_digits()
    keep = (digits.target != 9).nonzero()[0]
    chosen = keep[torch.randperm(len(keep), generator=torch.Generator().manual_seed(9))[:80].numpy()]
    x = torch.tensor(digits.data[chosen] / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target[chosen])
    brightness = torch.tensor(digits.data[1200:1700] / 16.0, dtype=torch.float32).mean(1).sort().values
    edges = brightness[torch.linspace(0, len(brightness) - 1, 10).long()[1:-1]]

    def imprinted() -> nn.Sequential:
        model = nn.Sequential(nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 10))
        with torch.no_grad():
            model[0].weight.fill_(1 / 64)
            model[0].bias.copy_(-edges)
            model[2].weight.copy_(torch.randn(10, 8, generator=torch.Generator().manual_seed(1)) * 0.01)
            model[2].weight[9] = -100.0
            model[2].bias.zero_()
            model[2].bias[9] = 5.0
        return model

    model = imprinted()
    received = {name: value.detach().clone() for name, value in model.state_dict().items()}
    guard = Guard(imprinted())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with guard.watch(model):
        for batch in torch.arange(len(x)).split(8):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[batch]), y[batch]).backward()
            optimizer.step()
    sent = {name: value.detach().clone() for name, value in model.state_dict().items()}

    read = server_reads(received, sent, x, "0")
    assert read
    decision, to_send = guard.decide(received, sent, x, y)
    assert decision.action == "block" and to_send is None
    assert set(read) <= set(decision.exact_samples), (read, decision.exact_samples)
