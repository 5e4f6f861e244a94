"""--verify fisher: each sample's Fisher information under DP noise, checked against an independent dense Jacobian.

The independent computation forms J = ∂ clip_C(g(x))/∂x with torch.func.jacrev in float64 (its own clipping, its own
loss), and dFIL = q·T·‖J‖_F² / ((σC)² d); the verifier's matrix-free estimate must match it within 2 %.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rankaudit.bound import fisher as fisher_bound
from rankaudit.verify.jacobian_products import ClippedGradientProducts
from rankaudit.verify.rank.fisher import exact_frobenius_squared, hutchinson, measure_samples

MODEL = """
import torch.nn as nn

INPUT_SHAPE = (1, 4, 4)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fc = nn.Linear(32, 3)

    def forward(self, x):
        return self.fc(nn.functional.softplus(self.conv(x)).flatten(1))
"""


def _net(seed: int = 0, scale: float = 1.0) -> nn.Module:
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        for parameter in net.parameters():
            parameter.mul_(scale)
    return net


def _independent_dfil(net, x, label, clip, noise, participation) -> tuple[float, float]:
    """(dFIL, ‖g‖) from the dense Jacobian of the clipped gradient, written apart from the verifier's code."""
    from torch.func import functional_call, grad, jacrev

    params = {name: p.detach() for name, p in net.named_parameters()}

    def clipped_gradient(sample):
        loss = lambda values: F.cross_entropy(  # noqa: E731
            functional_call(net, values, (sample.unsqueeze(0),)), torch.tensor([label])
        )
        flat = torch.cat([g.reshape(-1) for g in grad(loss)(params).values()])
        return flat * torch.clamp(clip / flat.norm(), max=1.0)

    jacobian = jacrev(clipped_gradient)(x)
    return participation * float(jacobian.pow(2).sum()) / ((noise * clip) ** 2 * x.numel()), float(
        clipped_gradient(x).norm()
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_matrix_free_dfil_matches_the_dense_jacobian_within_two_percent(seed):
    net = _net(seed)
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.rand(3, 6, generator=generator, dtype=torch.float64)
    labels = torch.tensor([0, 2, 1])
    # exact_dimension=0: every sample goes through Hutchinson alone, as an image does.
    measured = measure_samples(
        net, inputs, labels, clip=10.0, loss="cross-entropy", seed=seed, target=0.006, exact_dimension=0, chunk=512
    )
    line = fisher_bound.read_samples(measured, dimension=6, noise_multiplier=0.7, sample_rate=0.25, steps=8)
    for x, label, sample in zip(inputs, labels, line["samples"]):
        expected, _ = _independent_dfil(net, x, int(label), 10.0, 0.7, 0.25 * 8)
        assert not sample["exact"]
        assert sample["dfil"] == pytest.approx(expected, rel=0.02)
        assert sample["mse_floor"] == pytest.approx(1 / sample["dfil"])
        assert sample["psnr_ceiling"] == pytest.approx(10 * math.log10(sample["dfil"]))


def test_the_exact_path_is_the_dense_frobenius_norm_and_the_estimate_checks_it():
    net = _net(3)
    x = torch.rand(6, dtype=torch.float64)
    products = ClippedGradientProducts(net, 1, clip=5.0, loss="cross-entropy")
    exact = exact_frobenius_squared(products, x)
    assert exact == pytest.approx(float(products.jacobian(x).pow(2).sum()), rel=1e-10)
    estimate = hutchinson(products, x, seed=0)
    assert estimate["relative_se"] <= 0.02
    assert abs(estimate["value"] - exact) <= 4 * estimate["standard_error"]
    # The vector-Jacobian product is the transpose of the Jacobian-vector product.
    v, u = torch.randn(2, 6, dtype=torch.float64), torch.randn(2, products.size, dtype=torch.float64)
    assert torch.allclose(u @ products.jvp(x, v).T, products.vjp(x, u) @ v.T)


def test_doubling_sigma_divides_dfil_by_four():
    net = _net(4)
    inputs = torch.rand(2, 6, dtype=torch.float64)
    measured = measure_samples(net, inputs, torch.tensor([0, 1]), clip=1.0, loss="cross-entropy")
    once = fisher_bound.read_samples(measured, dimension=6, noise_multiplier=1.0, sample_rate=1.0, steps=1)
    twice = fisher_bound.at_noise(once, 2.0)
    for one, two in zip(once["samples"], twice["samples"]):
        assert two["dfil"] == pytest.approx(one["dfil"] / 4)
        assert two["psnr_ceiling"] == pytest.approx(one["psnr_ceiling"] - 20 * math.log10(2))
    # The least σ for the target is where the worst sample's ceiling meets it.
    at_least = fisher_bound.at_noise(once, once["least_noise"])
    assert at_least["worst"]["psnr_ceiling"] == pytest.approx(once["psnr_target"])


def test_with_clipping_active_the_clipped_gradients_jacobian_is_used():
    net = _net(5, scale=6.0)  # large weights: the per-sample gradient norm is far above C
    x = torch.rand(6, dtype=torch.float64)
    clip = 0.05
    products = ClippedGradientProducts(net, 2, clip=clip, loss="cross-entropy")
    assert products.clipped(x)
    measured = measure_samples(net, x[None], torch.tensor([2]), clip=clip, loss="cross-entropy")[0]
    assert measured["clipped"] and measured["exact"]
    dfil = fisher_bound.dfil(measured["frobenius_squared"], 6, 1.0, 1.0)
    expected, norm = _independent_dfil(net, x, 2, clip, 1.0, 1.0)
    assert norm == pytest.approx(clip)
    assert dfil == pytest.approx(expected, rel=1e-8)
    # Not the unclipped gradient's Jacobian scaled by C/‖g‖ alone: the rescaling's own derivative counts.
    unclipped, _ = _independent_dfil(net, x, 2, 1e9, 1.0, 1.0)
    g_norm = float(ClippedGradientProducts(net, 2, clip=1e9, loss="cross-entropy").gradient(x).norm()) * 1e9
    assert dfil != pytest.approx(unclipped * (1e9 / clip) ** 2 * (clip / g_norm) ** 2, rel=1e-3)


def test_cli_reports_each_sample_and_refuses_without_noise(run_cli, tmp_path):
    model = tmp_path / "tiny.py"
    model.write_text(MODEL)
    code, out, err = run_cli("check", model, "--verify", "fisher")
    assert code == 2 and "--dp-noise" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(
        "check", model, "--verify", "fisher", "--dp-noise", "2", "--samples", "2", "--format", "json", "-q"
    )
    record = json.loads(out)
    fisher = record["verification"]["fisher"]
    assert len(fisher["samples"]) == 2
    for sample in fisher["samples"]:
        assert {"label", "dfil", "mse_floor", "psnr_ceiling"} <= set(sample)
        assert sample["exact"] and sample["estimate_agrees"]  # d = 16: the exact norm, the estimate its check
    assert fisher["worst"]["dfil"] == max(sample["dfil"] for sample in fisher["samples"])
    assert "unbiased" in fisher["covers"]
    assert record["dp"]["fisher"]["median_psnr_ceiling"] == fisher["median_psnr_ceiling"]


def test_suggest_names_each_edits_least_sigma_beside_the_bounds_and_ranks_by_it(run_cli, tmp_path):
    model = tmp_path / "tiny.py"
    model.write_text(MODEL)
    (tmp_path / "pyproject.toml").write_text("[tool.rankaudit]\npsnr-target = 15\n")
    code, out, err = run_cli(
        "suggest", model, "--dp-noise", "1", "--dp-clip", "1e-4", "--max-reconstruction", "0.05", "--format", "json"
    )
    assert code == 0, err
    fisher = json.loads(out)["fisher"]
    assert fisher["psnr_target"] == 15.0  # from [tool.rankaudit]
    measured = [edit for edit in fisher["edits"] if edit["least_noise"] is not None]
    assert {edit["edit"] for edit in measured} >= {"remove-bias"}
    # Ranked by the least σ against the attacker who fills what the update cannot see with the mean.
    ranked = [edit["least_noise_with_prior"] for edit in measured]
    assert ranked == sorted(ranked) and all(value is not None for value in ranked)
    assert fisher["as_is"]["least_noise"] > 0 and fisher["as_is"]["least_noise_with_prior"] > 0
    code, out, err = run_cli(
        "suggest", model, "--dp-noise", "1", "--dp-clip", "1e-4", "--max-reconstruction", "0.05", "--psnr-target", "25"
    )
    assert code == 0, err
    assert "the least σ keeping every measured sample's PSNR ceiling at or below 25 dB" in out
    assert "for the reconstruction bound (any attacker)" in out


def test_compare_shows_each_designs_floor_at_the_same_sigma(run_cli, tmp_path):
    first, second = tmp_path / "a.py", tmp_path / "b.py"
    first.write_text(MODEL)
    second.write_text(MODEL.replace("nn.Conv2d(1, 2, 3, padding=1)", "nn.Conv2d(1, 2, 3, padding=1, bias=False)"))
    code, out, err = run_cli("compare", first, second, "--dp-noise", "2", "--dp-clip", "1e-4", "--format", "json")
    report = json.loads(out)
    lines = [report[side]["verification"]["fisher"] for side in ("a", "b")]
    assert [line["noise_multiplier"] for line in lines] == [2.0, 2.0]
    assert report["a"]["dp"]["reconstruction_bound"] == report["b"]["dp"]["reconstruction_bound"]
    assert lines[0]["median_dfil"] != lines[1]["median_dfil"]  # the design moves the Fisher line, not B(κ)
    for line in lines:
        assert line["least_noise_with_prior"] > 0 and all(one["rank_exact"] for one in line["samples"])
    code, out, err = run_cli("compare", first, second, "--dp-noise", "2", "--dp-clip", "1e-4")
    assert "Fisher floor at σ 2" in out and "for both designs (the architecture does not enter it)" in out


def test_a_layer_narrowed_on_the_real_model_measures_as_the_narrowed_design():
    """suggest's narrow edit, made on the real model (readers' weights zeroed and masked), against the narrowed
    design written out with the same kept weights."""
    from rankaudit.design.fisher_review import narrow_in_place

    torch.manual_seed(0)
    wide = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * 16, 3)).double()
    narrow = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 16, 3)).double()
    with torch.no_grad():
        narrow[0].weight.copy_(wide[0].weight[:2])
        narrow[0].bias.copy_(wide[0].bias[:2])
        narrow[3].weight.copy_(wide[3].weight[:, :32])
        narrow[3].bias.copy_(wide[3].bias)
    masks = narrow_in_place("0", 2, ["3"])(wide)
    inputs, labels = torch.rand(2, 1, 4, 4, dtype=torch.float64), torch.tensor([0, 2])
    edited = measure_samples(wide, inputs, labels, clip=1e-4, loss="cross-entropy", masks=masks)
    written = measure_samples(narrow, inputs, labels, clip=1e-4, loss="cross-entropy")
    for one, two in zip(edited, written):
        assert one["exact"] and two["exact"]
        assert one["frobenius_squared"] == pytest.approx(two["frobenius_squared"], rel=1e-9)
