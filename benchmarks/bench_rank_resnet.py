"""The rank check of one sample on a ResNet: the CIFAR ResNet-18 of width 16 (examples/resnet18_w16.py) at 3×32×32
three ways (the dense sketch as `--rank-precision auto` runs it, the dense sketch in float64, and the matrix-free
check), and on a GPU a ResNet-50 at 3×224×224 matrix-free within a time budget (its dense sketch, (n + 16) × n
float64 values for n = 150,528, would need 181 GB).

For each: seconds, the rank found (exact, or a lower bound when the budget ran out), the sample's hidden share
(measured, or its upper bound), the products with JᵀJ and what one costs. One photo-like sample, seeded weights
(BatchNorm with running statistics), label 3.

    python benchmarks/bench_rank_resnet.py [--device cpu|cuda] [--budget 110] [--skip-resnet50]

The ResNet-50 runs on CUDA only and needs torchvision. Writes a Markdown table (and the GPU's name) to stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_matrix_free import hidden_share
from torch import nn

from rankaudit.verify.rank import jacobian as dense
from rankaudit.verify.rank.gram import measure_matrix_free
from rankaudit.verify.rank.partial import hidden_at_most


def photo(size: int) -> torch.Tensor:
    """A smooth sample in [0, 1] (a blurred random field), so the hidden share is not that of white noise."""
    field = torch.rand(1, 3, size // 8 + 1, size // 8 + 1, generator=torch.Generator().manual_seed(size))
    return nn.functional.interpolate(field, size=(size, size), mode="bilinear", align_corners=False)


def row(name, size, method, seconds, rank, exact, hidden, products, d):
    per = f"{1000 * seconds / products:.1f}" if products else "–"
    rank_text = f"{rank:,}" if exact else f"≥ {rank:,}"
    hidden_text = f"{hidden:.3g}" if exact else f"≤ {hidden:.3g}"
    print(
        f"| {name} | 3×{size}×{size} | {d:,} | {method} | {seconds:.1f} | {rank_text} | {hidden_text} | {products:,} | {per} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--budget", type=float, default=110.0, help="seconds for the ResNet-50's matrix-free check")
    parser.add_argument("--skip-resnet50", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}, torch {torch.__version__}\n")
    else:
        print(f"device: CPU, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| net | input | n | method | seconds | rank | hidden share | products with JᵀJ | ms per product |")
    print("|---|---|---|---|---|---|---|---|---|")
    from resnet18_w16 import ResNet18W16

    label = torch.tensor([3])
    # torch.func's first transforms of a process cost seconds that are not the method's.
    warm = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 36, 10))
    measure_matrix_free(warm, photo(8), label, device=device)
    dense.measure(warm, photo(8), label, device=device)

    torch.manual_seed(0)
    net, x = ResNet18W16(), photo(32)
    started = time.perf_counter()
    reference = dense.measure(net, x, label, hidden=True, device=device, precision="auto")
    seconds = time.perf_counter() - started
    row(
        "ResNet-18 w16",
        32,
        f"dense, precision auto ({reference.precision} rows)",
        seconds,
        reference.rank,
        True,
        hidden_share(reference.invisible, x),
        0,
        x.numel(),
    )
    started = time.perf_counter()
    exact = dense.measure(net, x, label, hidden=True, device=device, precision="float64")
    seconds = time.perf_counter() - started
    row(
        "ResNet-18 w16", 32, "dense, float64", seconds, exact.rank, True, hidden_share(exact.invisible, x), 0, x.numel()
    )
    sys.stdout.flush()
    started = time.perf_counter()
    reading = measure_matrix_free(net, x, label, device=device)
    seconds = time.perf_counter() - started
    row(
        "ResNet-18 w16",
        32,
        f"matrix-free ({reading.stopped})",
        seconds,
        reading.rank_at_least,
        reading.exact,
        hidden_at_most(reading, x) or 0.0,
        reading.products,
        x.numel(),
    )
    sys.stdout.flush()
    if args.skip_resnet50 or device.type != "cuda":
        return
    from torchvision.models import resnet50

    torch.manual_seed(0)
    net, x = resnet50(num_classes=1000), photo(224)
    started = time.perf_counter()
    reading = measure_matrix_free(net, x, label, device=device, budget_seconds=args.budget)
    seconds = time.perf_counter() - started
    row(
        "ResNet-50",
        224,
        f"matrix-free ({reading.stopped}, budget {args.budget:g} s)",
        seconds,
        reading.rank_at_least,
        reading.exact,
        reading.hidden_share_at_most or 0.0,
        reading.products,
        x.numel(),
    )


if __name__ == "__main__":
    main()
