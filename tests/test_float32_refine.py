"""Full rank from a float32 sketch whose smallest singular values sit near its error: the trailing rows recomputed in
float64 give σ_min(S) from below, and the float64 sketch (an independent measurement) sits at or above it."""

from __future__ import annotations

import torch
from torch import nn

from rankaudit.verify.rank import jacobian as rank
from rankaudit.verify.rank.refine import trailing_rows_bound
from rankaudit.verify.rank.sketch import _draw_rows, _gaussian_rows


def _synthetic(seed: int, d: int = 40, m: int = 90, tiny: float = 1e-6, few: int = 3):
    """S = R·J with J's `few` smallest singular values at `tiny`; the float32 stand-in S + E with ‖E‖₂ = 2·σ_min(S)."""
    generator = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(m, d, generator=generator, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(d, d, generator=generator, dtype=torch.float64))
    singular = torch.logspace(0, -1, d, dtype=torch.float64)
    singular[-few:] = tiny
    jacobian = u @ torch.diag(singular) @ v.T
    rows = d + 16
    directions = torch.randn(rows, m, generator=generator, dtype=torch.float64)
    exact = directions @ jacobian
    sigma_min = float(torch.linalg.svdvals(exact)[-1])
    noise = torch.randn(rows, d, generator=generator, dtype=torch.float64)
    error = 2 * sigma_min
    perturbed = exact + noise * (error / float(torch.linalg.matrix_norm(noise, ord=2)))
    return perturbed, error, directions, jacobian, sigma_min


def test_the_bound_sits_under_the_float64_sketchs_smallest_singular_value_where_weyl_alone_says_nothing():
    for seed in range(12):
        perturbed, error, directions, jacobian, sigma_min = _synthetic(seed)
        # Weyl alone: σ_min(S) >= σ_min(S + E) − ‖E‖ is no bound at all here.
        assert float(torch.linalg.svdvals(perturbed)[-1]) - error <= 0
        refined = trailing_rows_bound(
            perturbed,
            error,
            draw_rows=lambda first, count, r=directions: r[first : first + count].float(),
            exact_rows=lambda chosen, j=jacobian: chosen @ j,
            margin=1.0,
            width=directions.shape[1],
        )
        assert refined is not None and refined.trailing == 8
        assert 0.5 * sigma_min <= refined.sigma_min_at_least <= sigma_min


def test_no_bound_when_every_singular_value_meets_the_error():
    perturbed, _, directions, jacobian, sigma_min = _synthetic(0)
    refined = trailing_rows_bound(
        perturbed,
        10.0,  # above σ_max: no trailing block leaves the rest clear of it
        draw_rows=lambda first, count: directions[first : first + count],
        exact_rows=lambda chosen: chosen @ jacobian,
        margin=1.0,
        width=directions.shape[1],
    )
    assert refined is None


def test_no_bound_when_what_it_needs_does_not_fit_the_memory_it_may_use():
    from rankaudit.verify.rank.refine import needed_bytes

    perturbed, error, directions, jacobian, _ = _synthetic(0)
    rows, d = perturbed.shape
    common = dict(
        draw_rows=lambda first, count: directions[first : first + count],
        exact_rows=lambda chosen: chosen @ jacobian,
        margin=1.0,
        width=directions.shape[1],
    )
    assert trailing_rows_bound(perturbed, error, memory_bytes=needed_bytes(rows, d, 90, 8) - 1, **common) is None
    assert trailing_rows_bound(perturbed, error, memory_bytes=needed_bytes(rows, d, 90, 8), **common) is not None


class Dimmed(nn.Module):
    """Eight of the 48 input values are scaled by `tiny` before an MLP: J's eight smallest singular values follow."""

    def __init__(self, tiny: float):
        super().__init__()
        scale = torch.ones(48)
        scale[:8] = tiny
        self.register_buffer("scale", scale)
        self.body = nn.Sequential(nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x):
        return self.body(x.flatten(1) * self.scale)


def test_auto_precision_keeps_float32_rows_with_the_trailing_rows_in_float64_and_the_float64_sketch_agrees():
    for tiny in (1e-5, 3e-6):
        torch.manual_seed(0)
        model = Dimmed(tiny)
        x = torch.rand(1, 3, 4, 4)
        chosen = rank.measure(model, x, torch.tensor([3]), precision="auto")
        reference = rank.measure(model, x, torch.tensor([3]), precision="float64")
        # The plain float32 check would have refused: σ_min within ten times the float32 error.
        assert chosen.precision == "float32" and "8 trailing ones recomputed in float64" in chosen.precision_note
        assert "is only" in chosen.precision_note and "margin 10" in chosen.precision_note
        assert chosen.rank == reference.rank == 48 and chosen.reliable
        # The same R: the float64 sketch's σ_min is the quantity bounded.
        assert 0.5 * reference.sigma_min_kept <= chosen.sigma_min_kept <= reference.sigma_min_kept
        assert chosen.gap <= reference.gap


def test_threads_draw_the_same_rows_as_one_generator_seeded_row_by_row():
    width, seed, first, count = 1000, 3, 5, 7
    drawn = _draw_rows(first, count, width, seed, torch.Generator())
    one = torch.Generator()
    for offset in range(count):
        one.manual_seed(seed * 2**24 + first + offset)
        assert torch.equal(drawn[offset], torch.empty(width).normal_(generator=one))


def test_reused_buffers_give_the_same_rows_and_views_of_each_parameters_shape():
    shapes = [(4, 3), (5,), (2, 2, 2)]
    reuse: dict = {}
    for first, count in ((0, 6), (6, 3), (9, 6)):
        fresh = _gaussian_rows(first, count, shapes, 1, torch.Generator())
        kept = _gaussian_rows(first, count, shapes, 1, torch.Generator(), reuse=reuse)
        assert [tuple(t.shape) for t in kept] == [(count, *shape) for shape in shapes]
        assert all(torch.equal(a, b) and b.dtype == torch.float64 for a, b in zip(fresh, kept))


def test_float32_rows_are_taken_without_tf32_and_the_settings_come_back():
    from rankaudit.verify.rank.sketch import full_float32

    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with full_float32():
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before
