"""GDBR label recovery from one hidden layer's weight gradient: accuracy, exactness at B=1, refusals, metrics."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn as nn
from conftest import EXAMPLES

from rankaudit.verify.attacks import gdbr, gdbr_bridge, gdbr_victims
from rankaudit.verify.attacks.gdbr_bridge import GDBRUnsupported

LENET_SHAPE = (1, 28, 28)


def load_example(file_name: str, class_name: str):
    spec = importlib.util.spec_from_file_location(file_name.removesuffix(".py"), EXAMPLES / file_name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name), tuple(module.INPUT_SHAPE)


LeNet10, _ = load_example("lenet10.py", "LeNet10")  # ReLU convs, Linear 588->84 -> ReLU -> Linear 84->10


class ConvHead(nn.Module):
    """LeNet10's convs, then a 7x7 conv to a 1x1 output (the paper's stand-in for average pooling) and Linear 32->10."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 12, kernel_size=5, stride=2, padding=2, bias=False)
        self.conv2 = nn.Conv2d(12, 12, kernel_size=5, stride=2, padding=2, bias=False)
        self.conv3 = nn.Conv2d(12, 12, kernel_size=5, stride=1, padding=2, bias=False)
        self.conv4 = nn.Conv2d(12, 32, kernel_size=7)
        self.act = nn.ReLU()
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(32, 10)

    def forward(self, x):
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            x = self.act(conv(x))
        return self.fc(self.flatten(x))


class Bottleneck(nn.Module):
    """64 -> 32 then 32 -> 128 before the classifier: the widening layer blocks the bridge."""

    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64, 64)
        self.squeeze = nn.Linear(64, 32)
        self.widen = nn.Linear(32, 128)
        self.classifier = nn.Linear(128, 10)
        self.act = nn.ReLU()

    def forward(self, x):
        x = self.act(self.fc1(self.flatten(x)))
        x = self.act(self.squeeze(x))
        x = self.act(self.widen(x))
        return self.classifier(x)


class SigmoidHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(64, 32)
        self.gate = nn.Sigmoid()
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(self.gate(self.fc1(self.flatten(x))))


def paper_lenet(seed: int = 0) -> LeNet10:
    torch.manual_seed(seed)
    return gdbr_victims.init_like_paper(LeNet10(), ["fc1", "fc2"], seed=seed)


@pytest.fixture(scope="module")
def mlp6_parts():
    return load_example("mlp6.py", "MLP6")


# --------------------------------------------------------------------------- accuracy at batch 64


def test_mlp6_fc2_gradient_through_a_five_layer_bridge(mlp6_parts):
    """fc2's gradient only; ã and p̃ from held-out digits; the bridge inverts fc3..fc6 and the classifier."""
    build, shape = mlp6_parts
    torch.manual_seed(0)
    model = gdbr_victims.init_like_paper(build(), ["fc2", "fc3", "fc4", "fc5", "fc6", "classifier"], seed=0)
    result = gdbr.run_gdbr(
        model, "fc2", 64, trials=5, aux=gdbr_victims.held_out_images(shape), device="cpu", seed=0, input_shape=shape
    )
    # measured: InsAcc 0.984 (trials 0.984-1.0), ClsAcc 1.0
    assert result.ins_acc >= 0.80
    assert result.cls_acc >= 0.95
    assert result.trials == 5 and len(result.per_trial) == 5
    assert sum(result.recovered.values()) == 64 and sum(result.true.values()) == 64
    assert result.features_from == "aux"


def test_mlp6_penultimate_gradient_with_dummy_inputs(mlp6_parts):
    """The paper's default: the penultimate layer (fc6) shared, ã and p̃ from N(0, 1) dummies."""
    build, shape = mlp6_parts
    torch.manual_seed(0)
    model = gdbr_victims.init_like_paper(build(), ["fc6", "classifier"], seed=0)
    result = gdbr.run_gdbr(model, "fc6", 64, trials=5, device="cpu", seed=0, input_shape=shape)
    # measured: InsAcc 1.0 and ClsAcc 1.0 in all five trials
    assert result.ins_acc >= 0.80
    assert result.cls_acc >= 0.95
    assert result.features_from == "dummy"


def test_lenet10_first_fc_gradient_with_dummy_inputs():
    result = gdbr.run_gdbr(paper_lenet(), "fc1", 64, trials=5, device="cpu", seed=0, input_shape=LENET_SHAPE)
    # measured: InsAcc 0.859 (trials 0.828-0.875), ClsAcc 1.0
    assert result.ins_acc >= 0.80
    assert result.cls_acc >= 0.95


def test_conv_with_1x1_output_as_the_shared_layer():
    """Theorem 2 / Eq. 17: ⟨∇W_k, W_k⟩_F ⊘ Ã_k for a conv whose output is 1x1."""
    torch.manual_seed(0)
    model = gdbr_victims.init_like_paper(ConvHead(), ["conv4", "fc"], seed=0)
    result = gdbr.run_gdbr(model, "conv4", 64, trials=3, device="cpu", seed=0, input_shape=LENET_SHAPE)
    # measured: InsAcc 0.875, ClsAcc 1.0
    assert result.ins_acc >= 0.80
    assert result.cls_acc >= 0.95


# --------------------------------------------------------------------------- batch size 1


def one_image_per_class(shape):
    images, labels = gdbr_victims.victim_batch(10, shape, 20, class_dist="uniform", seed=5)
    return [(images[labels == c][:1], labels[labels == c][:1]) for c in range(10)]


@pytest.mark.parametrize("estimator", gdbr.ESTIMATORS)
def test_batch_of_one_recovers_every_label_exactly_on_lenet10(estimator):
    model = paper_lenet()
    for image, label in one_image_per_class(LENET_SHAPE):
        grads = gdbr_victims.client_gradient(model, image, label)
        counts = gdbr.gdbr_attack(
            model,
            "fc1",
            {"fc1.weight": grads["fc1.weight"]},
            1,
            device="cpu",
            input_shape=LENET_SHAPE,
            estimator=estimator,
            n_dummy=200,
        )
        assert counts.tolist() == torch.nn.functional.one_hot(label, 10).squeeze(0).tolist()


def test_batch_of_one_recovers_every_label_exactly_on_mlp6(mlp6_parts):
    build, shape = mlp6_parts
    torch.manual_seed(0)
    model = gdbr_victims.init_like_paper(build(), ["fc6", "classifier"], seed=0)
    for image, label in one_image_per_class(shape):
        grads = gdbr_victims.client_gradient(model, image, label)
        counts = gdbr.gdbr_attack(
            model, "fc6", {"fc6.weight": grads["fc6.weight"]}, 1, device="cpu", input_shape=shape, n_dummy=200
        )
        assert counts.tolist() == torch.nn.functional.one_hot(label, 10).squeeze(0).tolist()


# --------------------------------------------------------------------------- what the bridge refuses


def test_widening_layer_blocks_the_bridge():
    model = Bottleneck()
    with pytest.raises(GDBRUnsupported) as info:
        gdbr_bridge.bridge_path(model, "fc1")
    assert info.value.layer == "widen"
    assert "widens 32 -> 128" in info.value.reason
    images, labels = gdbr_victims.victim_batch(10, (1, 8, 8), 4, seed=0)
    grads = gdbr_victims.client_gradient(model, images, labels)
    with pytest.raises(GDBRUnsupported) as info:
        gdbr.gdbr_attack(
            model, "squeeze", {"squeeze.weight": grads["squeeze.weight"]}, 4, device="cpu", input_shape=(1, 8, 8)
        )
    assert info.value.layer == "widen"


def test_rank_deficient_layer_blocks_the_bridge():
    model = Bottleneck()
    model.widen = nn.Linear(32, 16)
    model.classifier = nn.Linear(16, 10)
    with torch.no_grad():
        model.widen.weight[1] = 2.0 * model.widen.weight[0]
    images, labels = gdbr_victims.victim_batch(10, (1, 8, 8), 4, seed=0)
    grads = gdbr_victims.client_gradient(model, images, labels)
    with pytest.raises(GDBRUnsupported) as info:
        gdbr.gdbr_attack(
            model, "squeeze", {"squeeze.weight": grads["squeeze.weight"]}, 4, device="cpu", input_shape=(1, 8, 8)
        )
    assert info.value.layer == "widen"
    assert "not full row rank" in info.value.reason


def test_sigmoid_on_the_bridge_is_named():
    with pytest.raises(GDBRUnsupported) as info:
        gdbr_bridge.bridge_path(SigmoidHead(), "fc1")
    assert info.value.layer == "gate"
    assert "Sigmoid" in info.value.reason


def test_conv_with_spatial_output_is_refused():
    model = paper_lenet()
    images, labels = gdbr_victims.victim_batch(10, LENET_SHAPE, 4, seed=0)
    grads = gdbr_victims.client_gradient(model, images, labels)
    with pytest.raises(GDBRUnsupported) as info:
        gdbr.gdbr_attack(
            model, "conv3", {"conv3.weight": grads["conv3.weight"]}, 4, device="cpu", input_shape=LENET_SHAPE, n_dummy=8
        )
    assert info.value.layer == "conv3"
    assert "7x7" in info.value.reason


def test_logits_layer_and_conv_on_the_bridge_are_refused():
    with pytest.raises(GDBRUnsupported) as info:
        gdbr_bridge.bridge_path(LeNet10(), "fc2")
    assert info.value.layer == "fc2" and "logits" in info.value.reason
    with pytest.raises(GDBRUnsupported) as info:
        gdbr_bridge.bridge_path(LeNet10(), "conv2")
    assert info.value.layer == "conv3"


def test_bridge_path_lists_the_ops_to_the_logits():
    links = gdbr_bridge.bridge_path(LeNet10(), "fc1")
    assert [(link.kind, link.name) for link in links] == [("relu", "act"), ("linear", "fc2")]


# --------------------------------------------------------------------------- metrics and rounding


def test_ins_acc_and_cls_acc_on_hand_made_counts():
    true = [3, 0, 2, 5]  # B = 10, classes {0, 2, 3}
    recovered = [2, 1, 2, 5]  # classes {0, 1, 2, 3}
    assert gdbr.ins_acc(recovered, true) == pytest.approx((2 + 0 + 2 + 5) / 10)
    assert gdbr.cls_acc(recovered, true) == pytest.approx(3 / 4)
    assert gdbr.ins_acc([0, 0, 0, 10], [5, 0, 0, 5]) == pytest.approx(0.5)
    assert gdbr.cls_acc([0, 0, 0, 10], [5, 0, 0, 5]) == pytest.approx(0.5)
    assert gdbr.ins_acc(true, true) == 1.0 and gdbr.cls_acc(true, true) == 1.0
    assert gdbr.cls_acc([4, 0], [0, 4]) == 0.0


def test_largest_remainder_rounding():
    # clip -1.0 to 0; quotas 10 * [2.6, 0, 4.4, 3.0] / 10 -> floors 2, 0, 4, 3; the leftover unit goes to 0.6
    counts = gdbr.largest_remainder(torch.tensor([2.6, -1.0, 4.4, 3.0]), 10)
    assert counts.tolist() == [3, 0, 4, 3]
    # proportional rescaling when the estimate does not sum to B: quotas 4 * [0.5, 0.25, 0.25]
    assert gdbr.largest_remainder(torch.tensor([6.0, 3.0, 3.0]), 4).tolist() == [2, 1, 1]
    assert gdbr.largest_remainder(torch.tensor([-3.0, -1.0]), 5).tolist() == [0, 5]


# --------------------------------------------------------------------------- victim data and determinism


def test_victim_batch_class_distributions():
    images, labels = gdbr_victims.victim_batch(10, (3, 32, 32), 64, class_dist="uniform", seed=1)
    assert images.shape == (64, 3, 32, 32) and labels.shape == (64,)
    assert float(images.min()) >= 0.0 and float(images.max()) <= 1.0
    assert torch.equal(images[:, 0], images[:, 2])
    assert sorted(torch.bincount(labels, minlength=10).tolist()) == [6] * 6 + [7] * 4
    _, single = gdbr_victims.victim_batch(10, (1, 28, 28), 64, class_dist="single", seed=2)
    assert len(set(single.tolist())) == 1
    _, skewed = gdbr_victims.victim_batch(10, (1, 28, 28), 64, class_dist="imbalanced", seed=3)
    counts = sorted(torch.bincount(skewed, minlength=10).tolist(), reverse=True)
    assert counts[0] >= 20 and sum(counts) == 64
    _, few = gdbr_victims.victim_batch(3, (1, 8, 8), 30, seed=4)
    assert set(few.tolist()) <= {0, 1, 2}
    again, _ = gdbr_victims.victim_batch(10, (3, 32, 32), 64, class_dist="uniform", seed=1)
    assert torch.equal(images, again)


def test_held_out_images_never_reach_a_victim_batch():
    held_out = gdbr_victims.held_out_images((1, 8, 8)).flatten(1)
    victims, _ = gdbr_victims.victim_batch(10, (1, 8, 8), 1000, seed=0)
    distance = torch.cdist(victims.flatten(1), held_out, compute_mode="donot_use_mm_for_euclid_dist")
    assert len(held_out) > 500
    assert float(distance.min()) > 1e-6


def test_run_gdbr_is_deterministic_and_reports_progress():
    calls = []
    settings = dict(trials=2, device="cpu", seed=7, input_shape=LENET_SHAPE, n_dummy=200)
    first = gdbr.run_gdbr(paper_lenet(), "fc1", 32, progress=lambda i, n: calls.append((i, n)), **settings)
    second = gdbr.run_gdbr(paper_lenet(), "fc1", 32, **settings)
    assert calls == [(1, 2), (2, 2)]
    assert [t["recovered"] for t in first.per_trial] == [t["recovered"] for t in second.per_trial]
    assert [t["true"] for t in first.per_trial] == [t["true"] for t in second.per_trial]
    assert first.ins_acc == second.ins_acc and first.cls_acc == second.cls_acc
