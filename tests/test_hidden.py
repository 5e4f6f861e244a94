"""method.md: verdicts, measured: the projection onto the invisible subspace, hidden energy, the visible part's PSNR and SSIM."""

import math

import numpy as np
import pytest
import torch

from rankaudit.verify import image_quality
from rankaudit.verify.rank import hidden


def _orthonormal_rows(n: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn((n, n), generator=generator, dtype=torch.float64))
    return q.T.contiguous()


@pytest.mark.parametrize("rank", [3, 9, 12])  # more dropped than kept, fewer, none
def test_projection_matches_the_explicit_projector(rank):
    batch = torch.rand((2, 1, 2, 3), generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    vh = _orthonormal_rows(12)
    part = hidden.invisible_component(batch, vh, rank)
    centred = batch.reshape(2, -1) - batch.reshape(2, -1).mean(dim=1, keepdim=True)
    projector = vh[rank:].T @ vh[rank:]
    expected = (projector @ centred.reshape(-1)).reshape(batch.shape).numpy()
    assert part.shape == (2, 1, 2, 3)
    np.testing.assert_allclose(part, expected, atol=1e-12)
    if rank == 12:
        assert not part.any()


def test_hidden_energy_and_visible_psnr_of_a_known_split():
    # One sample of 4 values, mean 0.5; the invisible subspace is the first coordinate axis.
    x = np.array([[0.5 + 0.3, 0.5 - 0.1, 0.5 - 0.1, 0.5 - 0.1]]).reshape(1, 1, 2, 2)
    vh = torch.eye(4, dtype=torch.float64)[[1, 2, 3, 0]]  # kept rows first, the dropped axis last
    part = hidden.invisible_component(torch.as_tensor(x), vh, 3)
    np.testing.assert_allclose(part.reshape(-1), [0.3, 0, 0, 0], atol=1e-15)
    (share,) = hidden.shares(x, part)
    assert share.hidden_energy == pytest.approx(0.09 / (0.09 + 3 * 0.01))  # 75 %
    assert share.visible_psnr == pytest.approx(10 * math.log10(1 / (0.09 / 4)))  # 16.48 dB
    np.testing.assert_allclose(hidden.visible_parts(x, part).reshape(-1), [0.5, 0.4, 0.4, 0.4])


def test_full_rank_hides_nothing_and_reports_no_infinity():
    x = np.random.default_rng(0).random((2, 3, 8, 8))
    (first, second) = hidden.shares(x, np.zeros_like(x))
    assert first.hidden_energy == 0.0 and first.visible_psnr is None and first.visible_ssim == pytest.approx(1.0)
    assert hidden.median([first.visible_psnr, second.visible_psnr], none_is_infinite=True) is None
    assert hidden.median([12.0, None, 30.0], none_is_infinite=True) == 30.0
    assert hidden.reading([None, None], None) == "the gradient shows the image"
    assert hidden.reading([29.8], 29.8) == "the gradient shows the image"
    assert hidden.reading([20.0], 20.0) == "the gradient shows a degraded image"
    assert hidden.reading([10.0], 10.0) == "the visible part is a poor picture of the image"
    constant = np.full((1, 1, 4, 4), 0.5)
    assert hidden.shares(constant, np.zeros_like(constant))[0].hidden_energy is None  # no energy to share


def test_ssim_on_one_window_equals_the_formula_by_hand():
    rng = np.random.default_rng(3)
    x = rng.random((1, 11, 11))
    y = np.clip(x + 0.1 * rng.standard_normal((1, 11, 11)), 0, 1)
    line = np.exp(-((np.arange(11) - 5) ** 2) / (2 * 1.5**2))
    w = np.outer(line, line) / line.sum() ** 2
    mx, my = (w * x[0]).sum(), (w * y[0]).sum()
    vx, vy = (w * x[0] ** 2).sum() - mx**2, (w * y[0] ** 2).sum() - my**2
    cov = (w * x[0] * y[0]).sum() - mx * my
    c1, c2 = 0.01**2, 0.03**2
    expected = (2 * mx * my + c1) * (2 * cov + c2) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    assert image_quality.ssim(x, y) == pytest.approx(expected, rel=1e-12)
    assert image_quality.ssim(x, x) == pytest.approx(1.0) and image_quality.ssim(x, y) < 0.95
    assert image_quality.ssim(np.zeros(16), np.zeros(16)) is None  # not an image
