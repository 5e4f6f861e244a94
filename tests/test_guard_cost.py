"""What keeps the guard cheap does not change what it finds: the pair search's in-place block gives the pairs its
definition gives, and a re-read of an altered update reuses what each sample's features determine instead of
forming the sample's Jacobian again."""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from rankaudit.guard import features
from rankaudit.guard.pairs import PARALLEL, candidate_pairs
from rankaudit.guard.readout import LayerInputs, find_readouts


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
