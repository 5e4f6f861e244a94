"""Property: on random conv/linear/residual nets, every row's |x|, |W|, |z| is what a real forward pass measures."""

import torch
import torch.nn.functional as F
from conftest import analyse_module
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

COUNTED = (nn.Conv2d, nn.Linear, nn.AvgPool2d, nn.MaxPool2d)


class Residual(nn.Module):
    def __init__(self, channels_in, channels_out, stride, kernel):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, kernel, stride=stride, padding=kernel // 2, bias=False)
        self.bn = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, kernel, padding=kernel // 2)
        self.shortcut = None
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride=stride, bias=False), nn.BatchNorm2d(channels_out)
            )

    def forward(self, x):
        out = self.conv2(F.leaky_relu(self.bn(self.conv1(x))))
        out += x if self.shortcut is None else self.shortcut(x)
        return torch.tanh(out)


class RandomNet(nn.Module):
    def __init__(self, plan, channels, size, classes):
        super().__init__()
        self.body = nn.Sequential()
        for step in plan:
            kind = step[0]
            if kind == "conv":
                _, out, kernel, stride, padding, bias = step
                kernel = min(kernel, size + 2 * padding)
                self.body.append(nn.Conv2d(channels, out, kernel, stride=stride, padding=padding, bias=bias))
                self.body.append(nn.ReLU())
                size = (size + 2 * padding - kernel) // stride + 1
                channels = out
            elif kind == "residual":
                _, out, stride, kernel = step
                self.body.append(Residual(channels, out, stride, kernel))
                size = (size + 2 * (kernel // 2) - kernel) // stride + 1
                channels = out
            elif kind == "pool" and size >= 2:
                self.body.append(nn.AvgPool2d(2) if step[1] else nn.MaxPool2d(2))
                size //= 2
        self.head = nn.Linear(channels * size * size, classes)

    def forward(self, x):
        return self.head(self.body(x).flatten(1))


steps = st.one_of(
    st.tuples(
        st.just("conv"), st.integers(1, 6), st.integers(1, 4), st.integers(1, 3), st.integers(0, 2), st.booleans()
    ),
    st.tuples(st.just("residual"), st.integers(1, 6), st.integers(1, 2), st.sampled_from([1, 3])),
    st.tuples(st.just("pool"), st.booleans()),
)


def measured_counts(model, input_shape):
    counts = {}

    def hook(name):
        def record(module, inputs, output):
            params = sum(p.numel() for p in module.parameters())
            counts[name] = (inputs[0].numel(), params, output.numel())

        return record

    for name, module in model.named_modules():
        if isinstance(module, COUNTED):
            module.register_forward_hook(hook(name))
    model.eval()
    with torch.no_grad():
        model(torch.randn((1,) + input_shape))
    return counts


@settings(max_examples=40, deadline=None)
@given(
    plan=st.lists(steps, min_size=1, max_size=5),
    channels=st.integers(1, 3),
    size=st.integers(6, 14),
    classes=st.integers(1, 4),
    batch=st.integers(1, 3),
)
def test_counts_match_a_real_forward_pass(plan, channels, size, classes, batch):
    input_shape = (channels, size, size)
    real = RandomNet(plan, channels, size, classes)
    expected = measured_counts(real, input_shape)
    result = analyse_module(lambda: RandomNet(plan, channels, size, classes), input_shape, batch)
    rows = {r.name: r for r in result.layers}
    folded = {name for r in result.layers for name in r.folded}
    assert set(rows) | folded == set(expected)
    for name, r in rows.items():
        x, w, z = expected[name]
        assert (r.inputs, r.own_weights, r.outputs) == (batch * x, w, batch * z), name
        assert r.weights == w + sum(expected[f][1] for f in r.folded)
        assert r.ra_i == r.inputs - r.weights - r.outputs - r.virtual
    assert result.critical_layer is None or rows[result.critical_layer].ra_i == max(
        r.ra_i for r in result.layers if not r.dense
    )
