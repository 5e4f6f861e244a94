"""Tests for the optimisation attack (rankaudit.verify.attacks.invert) and the progress bar (rankaudit.verify.progress)."""

import io
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rankaudit.verify.attacks.invert import client_gradient, invert_gradients, run_inverting
from rankaudit.verify.attacks.invert_match import LossSpec, infer_label_idlg, infer_label_logistic
from rankaudit.verify.progress import ProgressBar


@pytest.fixture(autouse=True)
def single_thread():
    # These nets are tiny: extra threads only add contention on a shared 2-core CI runner.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def photo_patches(channels: int, size: int, count: int) -> torch.Tensor:
    """Natural-image patches in [0, 1]: crops of scikit-learn's sample photo, or smooth synthetic scenes."""
    try:
        from sklearn.datasets import load_sample_image

        photo = torch.tensor(load_sample_image("china.jpg"), dtype=torch.float32).permute(2, 0, 1) / 255.0
    except Exception:  # scikit-learn or its bundled images missing: fall back to synthetic scenes
        photo = None
    patches = []
    for index in range(count):
        if photo is not None:
            down = 4 if size >= 16 else 8
            span = size * down
            top = (60 + 70 * index) % (photo.shape[1] - span)
            left = (150 + 90 * index) % (photo.shape[2] - span)
            crop = photo[:, top : top + span, left : left + span]
            patch = F.avg_pool2d(crop.unsqueeze(0), down)[0]
            patch = patch[:channels] if channels == 3 else patch.mean(0, keepdim=True)
        else:
            generator = torch.Generator().manual_seed(index)
            coarse = torch.rand((1, channels, 3, 3), generator=generator)
            patch = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=True)[0]
        patches.append(patch.clamp(0, 1))
    return torch.stack(patches)


def over_determined_net() -> nn.Module:
    # 64 unknowns against a 64x256 first-layer gradient with bias: x is a ratio of two gradient rows.
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))


def under_determined_net() -> nn.Module:
    # 768 unknowns, 185 gradient entries: many inputs share the client's gradient.
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 2, kernel_size=5, stride=3), nn.Flatten(), nn.Linear(2 * 4 * 4, 1))


def test_over_determined_input_is_recovered():
    images = photo_patches(1, 8, 3)
    result = run_inverting(over_determined_net(), images, "cross-entropy", steps=300, restarts=1, device="cpu", seed=0)
    assert result.recovered_labels == result.labels
    assert max(result.mse) < 1e-3, result.mse
    assert result.median_psnr > 60.0
    assert len(result.seconds) == 3 and all(s > 0 for s in result.seconds)
    assert result.x_hat.shape == images.shape
    assert float(result.x_hat.min()) >= 0.0 and float(result.x_hat.max()) <= 1.0


def test_under_determined_input_is_not_recovered():
    images = photo_patches(3, 16, 2)
    result = run_inverting(under_determined_net(), images, "logistic", steps=150, restarts=1, device="cpu", seed=0)
    # The attack does fit the gradient; the input just is not pinned down by it.
    assert max(result.final_losses) < 1e-6, result.final_losses
    assert min(result.mse) > 1e-2, result.mse
    assert result.median_psnr < 20.0


def test_attack_objective_decreases():
    model = over_determined_net()
    image = photo_patches(1, 8, 1)[0]
    target = client_gradient(model, image, 3, "cross-entropy")
    outcome = invert_gradients(model, target, (1, 8, 8), 3, steps=200, restarts=2, device="cpu", seed=1)
    assert outcome.steps_run == 400
    assert len(outcome.restart_losses) == 2
    assert outcome.final_loss == min(outcome.restart_losses)
    assert outcome.initial_loss > 0.05
    assert outcome.final_loss < outcome.initial_loss / 1e4


def test_attack_is_deterministic_under_seed():
    model = over_determined_net()
    image = photo_patches(1, 8, 1)[0]
    target = client_gradient(model, image, 5, "cross-entropy")
    first = invert_gradients(model, target, (1, 8, 8), "cross-entropy", steps=30, restarts=2, device="cpu", seed=7)
    second = invert_gradients(model, target, (1, 8, 8), "cross-entropy", steps=30, restarts=2, device="cpu", seed=7)
    other = invert_gradients(model, target, (1, 8, 8), "cross-entropy", steps=30, restarts=2, device="cpu", seed=8)
    assert torch.equal(first.x_hat, second.x_hat)
    assert first.restart_losses == second.restart_losses
    assert not torch.equal(first.x_hat, other.x_hat)


def test_attack_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    model.train()
    before = {name: t.detach().clone() for name, t in model.state_dict().items()}
    target = client_gradient(model, photo_patches(1, 8, 1)[0], 2, "cross-entropy")
    with torch.no_grad():  # the attack differentiates twice whatever the caller's grad mode
        outcome = invert_gradients(model, target, (1, 8, 8), "cross-entropy", steps=5, restarts=1, device="cpu")
    assert outcome.label == 2
    assert model.training
    assert all(p.grad is None for p in model.parameters())
    # Eval-mode BatchNorm: the running statistics are read, never updated.
    assert all(torch.equal(before[name], t) for name, t in model.state_dict().items())


def test_tv_released_late_removes_the_prior_floor():
    images = photo_patches(1, 8, 3)
    model = over_determined_net()
    throughout = run_inverting(model, images, "cross-entropy", steps=300, restarts=1, device="cpu", tv_until=1.0)
    released = run_inverting(model, images, "cross-entropy", steps=300, restarts=1, device="cpu")
    assert max(throughout.mse) > 1e-4
    assert max(released.mse) < 1e-6


def test_idlg_recovers_ten_random_labels_without_bias():
    torch.manual_seed(0)
    # No bias and a LeakyReLU before the head, so the weight gradient alone must carry the label
    # and the features may be negative: the plain row-sum rule's h >= 0 assumption does not hold.
    model = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.LeakyReLU(0.2), nn.Linear(32, 10, bias=False))
    labels = torch.randint(0, 10, (10,), generator=torch.Generator().manual_seed(1)).tolist()
    recovered = []
    for index, label in enumerate(labels):
        x = torch.randn((3, 4, 4), generator=torch.Generator().manual_seed(100 + index))
        grads = client_gradient(model, x, label, "cross-entropy")
        recovered.append(infer_label_idlg(grads["3.weight"]))
    assert len(set(labels)) >= 5
    assert recovered == labels


def test_idlg_uses_the_bias_gradient_when_given():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 7))
    for label in range(7):
        grads = client_gradient(model, torch.rand(3, 2, 2), label, "cross-entropy")
        assert infer_label_idlg(grads["1.weight"], grads["1.bias"]) == label


def test_logistic_label_is_read_off_the_bias_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 1))
    for label in (-1, 1):
        grads = client_gradient(model, torch.rand(3, 2, 2), label, "logistic")
        assert infer_label_logistic(grads["1.weight"], grads["1.bias"]) == label


def test_logistic_sign_without_bias_is_settled_by_a_probe():
    torch.manual_seed(0)
    # LeakyReLU features can be negative, so the weight gradient's sign says nothing about the label.
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1, bias=False))
    for index, label in enumerate((-1, 1, 1, -1)):
        x = torch.rand((3, 2, 2), generator=torch.Generator().manual_seed(index))
        grads = client_gradient(model, x, label, "logistic")
        assert infer_label_logistic(grads["3.weight"]) is None
        outcome = invert_gradients(model, grads, (3, 2, 2), "logistic", steps=160, restarts=1, device="cpu")
        assert outcome.label == label
        assert outcome.candidate_labels == [label]
        assert len(outcome.probe_losses) == 2
        assert 4 * min(outcome.probe_losses) < max(outcome.probe_losses)
        assert outcome.steps_run == 2 * 20 + 160


def test_loss_spec_rejects_bad_labels():
    with pytest.raises(ValueError):
        LossSpec("logistic", 0)
    with pytest.raises(ValueError):
        LossSpec("hinge")


def test_progress_callback_reaches_the_total():
    model = over_determined_net()
    target = client_gradient(model, photo_patches(1, 8, 1)[0], 1, "cross-entropy")
    seen = []
    report = lambda done, total: seen.append((done, total))  # noqa: E731
    invert_gradients(model, target, (1, 8, 8), 1, steps=4, restarts=2, device="cpu", progress=report)
    # The two restarts step side by side: each batched step counts a step for each of them.
    assert seen == [(2 * i, 8) for i in range(1, 5)]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_is_silent_off_a_terminal(capfd):
    with ProgressBar(8, "invert") as bar:
        for _ in range(3):
            bar.update()
        bar(5, 8)
    captured = capfd.readouterr()
    assert captured.err == "" and captured.out == ""


def test_progress_bar_is_silent_when_disabled():
    stream = FakeTerminal()
    with ProgressBar(8, "invert", enabled=False, stream=stream) as bar:
        bar.update(3)
    assert stream.getvalue() == ""


def test_progress_bar_draws_on_a_terminal(monkeypatch):
    fake = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", fake)
    with ProgressBar(8, "invert", width=10) as bar:
        for _ in range(3):
            bar.update()
    text = fake.getvalue()
    assert "3/8" in text
    final = text.rstrip("\n").split("\r")[-1]
    assert final.startswith("invert [####------] 3/8 ")
    assert final.rstrip().endswith("s")
    assert text.endswith("\n")


def test_progress_bar_as_callback(monkeypatch):
    fake = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", fake)
    with ProgressBar(1, "steps", width=4) as bar:
        bar(6, 6)
    assert "steps [####] 6/6" in fake.getvalue()
    bar(99, 100)
    assert "99/100" not in fake.getvalue()  # closed bars stay quiet


def test_batched_run_matches_one_image_at_a_time():
    # float64: signed Adam steps turn float32 round-off (which differs with the batch size) into visible drift.
    model = over_determined_net().double()
    images = photo_patches(1, 8, 3).double()
    batched = run_inverting(model, images, "cross-entropy", steps=100, restarts=2, device="cpu", seed=4)
    for index in range(3):
        target = client_gradient(model, images[index], batched.labels[index], "cross-entropy")
        alone = invert_gradients(
            model, target, (1, 8, 8), "cross-entropy", steps=100, restarts=2, device="cpu", seed=4 + index
        )
        assert alone.per_sample_gradients == "vmap"
        assert torch.allclose(alone.x_hat, batched.x_hat[index], atol=1e-9, rtol=0)
        assert alone.restart_losses == pytest.approx(batched.outcomes[index].restart_losses, rel=1e-9)
    assert batched.steps_run == [200, 200, 200]


def test_batches_split_to_fit_memory_give_the_same_reconstructions(monkeypatch):
    from rankaudit.verify.attacks import invert_loop

    model = over_determined_net()
    images = photo_patches(1, 8, 2)
    whole = run_inverting(model, images, "cross-entropy", steps=60, restarts=2, device="cpu", seed=2)
    monkeypatch.setattr(invert_loop, "_group_size", lambda bytes_per_candidate, device: 1)
    split = run_inverting(model, images, "cross-entropy", steps=60, restarts=2, device="cpu", seed=2)
    assert torch.allclose(whole.x_hat, split.x_hat, atol=1e-6, rtol=0)
    assert split.steps_run == [120, 120]


def cosine_distance(model, x, label, target):
    grads = client_gradient(model, x, label, "cross-entropy")
    dummy = torch.cat([grads[name].reshape(-1) for name in target]).double()
    truth = torch.cat([target[name].reshape(-1) for name in target]).double()
    # Half the squared distance of the unit vectors: 1 - cos without the cancellation of computing 1 - cos.
    return float(0.5 * (dummy / dummy.norm() - truth / truth.norm()).pow(2).sum())


def test_batchnorm_reads_its_running_statistics_per_candidate():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    model.train()  # the attack must switch to eval itself, as the client does
    images = photo_patches(1, 8, 2)
    result = run_inverting(model, images, "cross-entropy", steps=80, restarts=2, device="cpu", seed=0)
    assert model.training
    for index in range(2):
        target = client_gradient(model, images[index], result.labels[index], "cross-entropy")
        # Each candidate's batched gradient is the eval-mode gradient of that candidate alone: the distance the
        # attack reports is the one a single-sample forward pass gives for its reconstruction.
        measured = cosine_distance(model, result.x_hat[index], result.labels[index], target)
        assert measured == pytest.approx(result.final_losses[index], rel=1e-3, abs=1e-7)
        assert result.final_losses[index] < result.outcomes[index].initial_loss / 4  # measured: 0.39 -> 0.073


class SignGatedNet(nn.Module):
    """Branches on the sign of its input's sum: Python control flow that vmap cannot batch."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(64, 256)
        self.head = nn.Linear(256, 10)

    def forward(self, x):
        h = self.hidden(x.flatten(1))
        h = torch.relu(h) if x.sum() > 0 else F.leaky_relu(h, 0.1)
        return self.head(h)


def test_models_vmap_cannot_batch_fall_back_to_one_candidate_at_a_time():
    torch.manual_seed(0)
    model = SignGatedNet()
    images = photo_patches(1, 8, 2)
    result = run_inverting(model, images, "cross-entropy", steps=150, restarts=2, device="cpu", seed=0)
    assert [o.per_sample_gradients for o in result.outcomes] == ["loop", "loop"]
    assert result.recovered_labels == result.labels
    assert max(result.mse) < 1e-3, result.mse
    for index in range(2):
        target = client_gradient(model, images[index], result.labels[index], "cross-entropy")
        measured = cosine_distance(model, result.x_hat[index], result.labels[index], target)
        assert measured == pytest.approx(result.final_losses[index], rel=1e-3, abs=1e-7)


def test_tolerance_stops_each_restart_on_its_own():
    model = over_determined_net()
    image = photo_patches(1, 8, 1)[0]
    target = client_gradient(model, image, 3, "cross-entropy")
    full = invert_gradients(model, target, (1, 8, 8), 3, steps=300, restarts=2, device="cpu", seed=1)
    early = invert_gradients(model, target, (1, 8, 8), 3, steps=300, restarts=2, device="cpu", seed=1, tolerance=1e-4)
    assert full.steps_run == 600
    assert early.final_loss <= 1e-4
    assert early.steps_run < 600 and early.steps_run % 10 == 0
    assert all(loss <= 1e-4 for loss in early.restart_losses)


def test_adam_update_is_torch_adam():
    from rankaudit.verify.attacks.invert_loop import adam_update

    generator = torch.Generator().manual_seed(0)
    start = torch.rand((4, 3), generator=generator, dtype=torch.float64)
    reference = start.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([reference], lr=0.1)
    x, first, second = start.clone(), torch.zeros_like(start), torch.zeros_like(start)
    steps_done = torch.zeros((), dtype=torch.float64)
    lr = torch.full((), 0.1, dtype=torch.float64)
    for step in range(12):
        gradient = torch.randn((4, 3), generator=generator, dtype=torch.float64)
        if step == 6:  # a learning-rate cut midway, as the attack's schedule makes
            lr.mul_(0.1)
            optimizer.param_groups[0]["lr"] = 0.1 * 0.1
        reference.grad = gradient.clone()
        optimizer.step()
        x = adam_update(x, gradient, first, second, steps_done, lr, (0.9, 0.999), 1e-8)
    assert int(steps_done) == 12
    assert torch.allclose(x, reference.detach(), atol=1e-14, rtol=0)
