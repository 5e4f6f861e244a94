"""The Fisher line in the mode it claims and with what a prior fills in, each figure against an independent reading.

- The least σ is named at the estimate's upper limit: at that σ the ceiling from the exact ‖J‖_F² (a dense Jacobian
  written apart from the verifier's code) is at or under the target, for every seed.
- A Jacobian that is zero (one clipped trainable scalar) reads as no information: no floor, no ceiling, no false note.
- BatchNorm over a batch of several samples has no per-sample gradient: refused with the fix.
- The attacker who fills what J cannot see with the reference mean: rank, null space and hidden part against a dense
  SVD; on an average-pool-first CNN and real photograph crops, against the block-mean image (the noise-free limit)
  and against the best linear unbiased attacker reading a noised update.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.bound import fisher as fisher_bound
from rankaudit.bound.images import load_images
from rankaudit.verify.rank.fisher import measure_samples
from rankaudit.verify.rank.fisher_prior import reference_mean


def _dense_clipped_jacobian(net, x, label, clip) -> torch.Tensor:
    """∂ clip_C(g(x))/∂x / C (|θ| x d), written apart from the verifier's products."""
    from torch.func import functional_call, grad, jacrev

    params = {name: p.detach() for name, p in net.named_parameters() if p.requires_grad}

    def clipped(sample):
        def loss(values):
            return F.cross_entropy(functional_call(net, values, (sample.unsqueeze(0),)), torch.tensor([label]))

        flat = torch.cat([g.reshape(-1) for g in grad(loss)(params).values()])
        return flat * torch.clamp(1.0 / flat.norm(), max=1.0 / clip)

    return jacrev(clipped)(x).reshape(-1, x.numel())


def _mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).double()


def _pooling_cnn(side: int, seed: int = 0) -> nn.Module:
    """A 2x2 average pool first: J sees only the block means, a quarter of the values."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.AvgPool2d(2), nn.Conv2d(3, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * (side // 2) ** 2, 10)
    ).double()


@pytest.mark.parametrize("seed", range(6))
def test_the_least_sigma_holds_at_the_exact_ceiling(seed):
    """Hutchinson alone (as at image sizes), to the design review's loose 5 %: the σ it names keeps the exact
    ceiling at or under the target. Read at the estimate itself, about half of the seeds would miss."""
    net = _mlp(seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.rand(2, 8, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 2])
    measured = measure_samples(
        net, inputs, labels, clip=0.5, loss="cross-entropy", seed=seed, target=0.05, exact_dimension=0
    )
    assert not any(one["exact"] for one in measured)
    line = fisher_bound.read_samples(
        measured, dimension=8, noise_multiplier=1.0, sample_rate=1.0, steps=1, psnr_target=20.0
    )
    sigma = line["least_noise"]
    for x, label in zip(inputs, labels):
        exact = float(_dense_clipped_jacobian(net, x, int(label), 0.5).square().sum())
        ceiling = fisher_bound.psnr_ceiling(fisher_bound.dfil(exact, 8, sigma, 1.0))
        assert ceiling <= 20.0 + 1e-9


SCALAR_MODEL = """
import torch.nn as nn

INPUT_SHAPE = (4,)


class OneScalar(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)
        self.fc.weight.requires_grad_(False)  # only the bias trains: a single scalar

    def forward(self, x):
        return self.fc(x)
"""


def test_an_update_that_carries_no_information_has_no_floor(run_cli, tmp_path):
    """One trainable scalar under clipping: clip_C(g) is ±C whatever the sample, J = 0 exactly."""
    model = tmp_path / "scalar.py"
    model.write_text(SCALAR_MODEL)
    args = ("check", model, "--verify", "fisher", "--dp-noise", "1", "--dp-clip", "1e-6", "--samples", "2")
    code, out, err = run_cli(*args, "--format", "json", "-q")
    fisher = json.loads(out)["verification"]["fisher"]
    for sample in fisher["samples"]:
        assert sample["carries_nothing"] and sample["frobenius_squared"] == 0.0
        assert sample["dfil"] == 0.0 and sample["mse_floor"] is None and sample["psnr_ceiling"] is None
        # Knowing the mean is all an attacker has: its error is the sample's distance from it.
        assert sample["rank"] == 0 and sample["prior_mse_floor"] == pytest.approx(sample["hidden"] / 4)
    assert fisher["median_mse_floor"] is None and fisher["worst"]["psnr_ceiling"] is None
    assert fisher["least_noise"] == 0.0 and fisher["least_noise_with_prior"] == 0.0
    assert not any("misses" in note for note in fisher["notes"])
    code, out, err = run_cli(*args)
    assert "at least infinite" in out and "at most none" in out
    assert "e+" not in out.split("Verification (Fisher")[1]


BATCHNORM_MODEL = """
import torch.nn as nn

INPUT_SHAPE = (1, 4, 4)


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.norm = nn.BatchNorm2d(2)
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc(self.norm(self.conv(x)).tanh().flatten(1))
"""


def test_batchnorm_over_several_samples_is_refused_with_the_fix(run_cli, tmp_path):
    model = tmp_path / "normed.py"
    model.write_text(BATCHNORM_MODEL)
    dp = ("--dp-noise", "1", "--dp-clip", "1e-3", "--samples", "1", "-q")
    code, out, err = run_cli("check", model, "--verify", "fisher", "-b", "4", *dp)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "not defined" in err and "GroupNorm" in err and "--bn-mode eval" in err
    # What is defined: a client that normalises on running statistics, or batches of one sample on its own.
    for extra in (("-b", "4", "--bn-mode", "eval"), ("-b", "1")):
        code, out, err = run_cli("check", model, "--verify", "fisher", *extra, *dp, "--format", "json")
        fisher = json.loads(out)["verification"]["fisher"]
        assert fisher["samples"][0]["dfil"] > 0
    code, out, err = run_cli("compare", model, model, "-b", "4", "--dp-noise", "1", "--dp-clip", "1e-3")
    assert code == 2 and "GroupNorm" in err


def test_rank_and_hidden_part_match_a_dense_svd_at_small_d():
    """The reading with a prior on 3x4x4 crops (d = 48, rank at most 12 behind the pool) against the dense J's SVD,
    and the floor against the exact tr(I_V⁻¹) + hidden it lower-bounds (AM–HM)."""
    net = _pooling_cnn(4, seed=1)
    images = load_images(None, (3, 4, 4), 3, seed=5)[0].double()
    mean, _ = reference_mean((3, 4, 4), None, 5)
    labels = torch.tensor([1, 4, 7])
    clip, sigma = 0.5, 0.01
    measured = measure_samples(net, images, labels, clip=clip, loss="cross-entropy", mean=mean)
    line = fisher_bound.read_samples(measured, dimension=48, noise_multiplier=sigma, sample_rate=1.0, steps=1)
    for x, label, one, read in zip(images, labels, measured, line["samples"]):
        jacobian = _dense_clipped_jacobian(net, x, int(label), clip)
        _, values, right = torch.linalg.svd(jacobian, full_matrices=True)
        rank = int((values > values[0] * max(jacobian.shape) * 2.2e-16).sum())
        null = right[rank:]
        hidden = float((null @ (x - mean).reshape(-1)).square().sum())
        assert one["rank_exact"] and one["rank"] == rank <= 12
        assert one["hidden"] == pytest.approx(hidden, rel=1e-8, abs=1e-12)
        assert one["frobenius_squared"] == pytest.approx(float(values.square().sum()), rel=1e-9)
        error = rank**2 * sigma**2 / float(values.square().sum()) + hidden
        assert read["prior_mse_floor"] == pytest.approx(error / 48, rel=1e-8)
        exact_error = sigma**2 * float((1 / values[:rank].square()).sum()) + hidden
        assert read["prior_mse_floor"] * 48 <= exact_error * (1 + 1e-12)


def _block_means(image: torch.Tensor) -> torch.Tensor:
    return F.interpolate(F.avg_pool2d(image[None], 2), scale_factor=2, mode="nearest")[0]


def _psnr(estimate: torch.Tensor, truth: torch.Tensor) -> float:
    return 10 * math.log10(1.0 / float((estimate - truth).square().mean()))


def test_on_a_pooling_cnn_the_ceiling_sits_over_the_block_mean_limit_and_a_noised_attack():
    """Real photograph crops (3x8x8) through a 2x2-average-pool-first CNN. What J sees is exactly the block means,
    so the best an attacker with the mean can do without noise is each block's mean plus the mean image's detail
    inside the block: the ceiling approaches that image's PSNR from below as σ → 0. With noise, the best linear
    unbiased attacker on the visible part, reading a noised update (the noise drawn, the Jacobian dense and
    independent), scores at or under the ceiling, and above the unbiased-everywhere figure, which understates it."""
    net = _pooling_cnn(8)
    shape, clip = (3, 8, 8), 1.4
    images = load_images(None, shape, 2, seed=11)[0].double()
    mean, _ = reference_mean(shape, None, 11)
    labels = torch.tensor([3, 0])
    measured = measure_samples(net, images, labels, clip=clip, loss="cross-entropy", mean=mean)
    generator = torch.Generator().manual_seed(0)
    for x, label, one in zip(images, labels, measured):
        assert one["rank_exact"] and one["rank"] == 48  # 3 channels x 4 x 4 blocks
        limit = _block_means(x) + mean - _block_means(mean)
        tiny = fisher_bound.read_samples([one], dimension=192, noise_multiplier=1e-9, sample_rate=1.0, steps=1)
        assert tiny["samples"][0]["prior_psnr_ceiling"] == pytest.approx(_psnr(limit, x), abs=0.01)
        assert tiny["samples"][0]["prior_psnr_ceiling"] <= _psnr(limit, x) + 1e-9

        jacobian = _dense_clipped_jacobian(net, x, int(label), clip)
        pseudo_inverse = torch.linalg.pinv(jacobian, rtol=1e-10)
        for sigma in (0.003, 0.03):
            read = fisher_bound.read_samples([one], dimension=192, noise_multiplier=sigma, sample_rate=1.0, steps=1)
            errors = []
            for _ in range(64):
                noise = sigma * torch.randn(jacobian.shape[0], generator=generator, dtype=torch.float64)
                # Locally the noised update is J x + noise: the estimate of the visible part is unbiased.
                visible = pseudo_inverse @ (jacobian @ x.reshape(-1) + noise)
                guess = visible + (mean.reshape(-1) - pseudo_inverse @ (jacobian @ mean.reshape(-1)))
                errors.append(float((guess - x.reshape(-1)).square().mean()))
            attack = 10 * math.log10(1.0 / (sum(errors) / len(errors)))
            assert attack <= read["samples"][0]["prior_psnr_ceiling"] + 0.05
            if sigma == 0.03:  # where the noise dominates, dFIL spread over all 192 values misses by 7 dB
                assert attack > read["samples"][0]["psnr_ceiling"] + 5
