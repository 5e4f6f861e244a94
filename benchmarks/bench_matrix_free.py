"""The matrix-free rank check (block Lanczos on JᵀJ) against the dense sketch it stands beside, one sample each.

For each net and input size: the dense check (`rankaudit.verify.rank.jacobian.measure`, a Gaussian sketch with
n + 16 rows and its SVD, what `--rank-method dense` runs) and the matrix-free one
(`rankaudit.verify.rank.gram.measure_matrix_free`, `--rank-method matrix-free`) on the same photo-like sample,
weights and label: seconds, the rank each finds, the sample's hidden share each finds, and the ratio of times.
The dense check costs about n second-order products whatever the rank; the matrix-free one about rank + one block,
twice over (a J and a Jᵀ product each), and memory d × rank instead of n².

    python benchmarks/bench_matrix_free.py [--sizes 8 16 32] [--device cpu]

Writes a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from torch import nn

from rankaudit.verify.rank import jacobian as dense
from rankaudit.verify.rank.gram import measure_matrix_free
from rankaudit.verify.rank.hidden import centred


def pooling_mlp(size: int) -> nn.Module:
    """Average-pool 4 before an MLP: each sample's rank is at most 3·(size/4)² (the pooled values)."""
    pooled = 3 * (size // 4) ** 2
    return nn.Sequential(nn.AvgPool2d(4), nn.Flatten(), nn.Linear(pooled, 32), nn.ReLU(), nn.Linear(32, 10))


def strided_cnn(size: int) -> nn.Module:
    """A 3×3 stride-2 convolution with four channels: a rank near the input's size."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(4 * (size // 2) ** 2, 10)
    )


def photo(size: int) -> torch.Tensor:
    """A smooth sample in [0, 1] (a blurred random field), so the hidden share is not that of white noise."""
    field = torch.rand(1, 3, size // 4 + 1, size // 4 + 1, generator=torch.Generator().manual_seed(size))
    return nn.functional.interpolate(field, size=(size, size), mode="bilinear", align_corners=False)


def hidden_share(invisible, x: torch.Tensor) -> float:
    c = centred(x).reshape(-1).double()
    return float((torch.as_tensor(invisible).reshape(-1) ** 2).sum() / (c**2).sum())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="*", default=[8, 16, 32])
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    print(
        "| net | input | n | dense rank | matrix-free rank | hidden (dense / matrix-free) | dense s | "
        "matrix-free s | dense ÷ matrix-free |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    # One run of each method first: torch.func's first transforms of a process cost seconds that are not the
    # method's.
    warm_net, warm_x = pooling_mlp(8), photo(8)
    dense.measure(warm_net, warm_x, torch.tensor([3]), device=args.device)
    measure_matrix_free(warm_net, warm_x, torch.tensor([3]), device=args.device)
    for make in (pooling_mlp, strided_cnn):
        for size in args.sizes:
            torch.manual_seed(0)
            net, x, y = make(size), photo(size), torch.tensor([3])
            started = time.perf_counter()
            reference = dense.measure(net, x, y, hidden=True, device=args.device)
            dense_seconds = time.perf_counter() - started
            started = time.perf_counter()
            reading = measure_matrix_free(net, x, y, device=args.device)
            free_seconds = time.perf_counter() - started
            print(
                "| %s | 3×%d×%d | %d | %d | %d%s | %.4f / %.4f | %.1f | %.1f | %.2f |"
                % (
                    make.__name__,
                    size,
                    size,
                    x.numel(),
                    reference.rank,
                    reading.rank_at_least,
                    "" if reading.exact else " (at least)",
                    hidden_share(reference.invisible, x),
                    reading.hidden_share_at_most,
                    dense_seconds,
                    free_seconds,
                    dense_seconds / free_seconds,
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
