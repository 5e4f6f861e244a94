"""How large a rank sketch the device can hold: the float64 sketch, its factorisation and the chunks of rows."""

from __future__ import annotations

import os

import torch

from rankaudit import install_hint
from rankaudit.errors import UsageError

# How large a sketch may be follows the device's memory, not a constant. On a CPU the sketch, its
# factorisation and the chunks of rows may take this share of the physical RAM (or of a cgroup's limit, when lower):
# the rest is the operating system's and the other jobs'.
CPU_RAM_SHARE = 0.5
# On CUDA they may take this share of the memory free when the check starts (the allocator needs slack).
CUDA_SKETCH_SHARE = 0.8
# On a CPU there is no allocator to ask; one chunk of rows may take about this much memory.
CPU_CHUNK_BYTES = 1536 * 2**20


def sketch_bytes(rows: int, unknowns: int, *, vectors: bool = False) -> int:
    """Bytes the float64 sketch and its factorisation hold at once.

    The rows x n sketch, and the column-major copy LAPACK's QR or SVD factors (16 bytes per entry); with the
    invisible directions asked for (--artifacts), also the SVD's n x n right and rows x min(rows, n) left vectors
    and gesdd's workspace of about 3·min(rows, n)² values.
    """
    total = 16 * rows * unknowns
    if vectors:
        smaller = min(rows, unknowns)
        total += 8 * (unknowns * unknowns + rows * smaller + 3 * smaller * smaller)
    return total


def memory_budget(device: str | torch.device) -> tuple[int, str]:
    """(bytes the rank check may use on ``device``, how that figure was reached)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(CUDA_SKETCH_SHARE * free), f"{CUDA_SKETCH_SHARE:.0%} of the GPU's {free / 2**30:.1f} GiB free"
    physical, where = _physical_memory()
    # The chunks of rows take up to CPU_CHUNK_BYTES besides the sketch.
    return (
        max(0, int(CPU_RAM_SHARE * physical) - CPU_CHUNK_BYTES),
        f"{CPU_RAM_SHARE:.0%} of the {physical / 2**30:.1f} GiB of {where}, less "
        f"{CPU_CHUNK_BYTES / 2**30:.1f} GiB for the chunks of rows",
    )


def _physical_memory() -> tuple[int, str]:
    """The machine's RAM, or a cgroup's memory limit when that is lower (containers, CI runners)."""
    try:
        physical, where = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "RAM"
    except (AttributeError, ValueError, OSError):
        try:
            import psutil
        except ImportError:
            raise UsageError(
                "cannot tell how much RAM this machine has (no os.sysconf, no psutil)",
                install_hint("bench") + " (psutil), or run --verify rank with --device cuda",
            ) from None
        physical, where = int(psutil.virtual_memory().total), "RAM"
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(limit_file) as handle:
                text = handle.read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < physical:
            physical, where = int(text), "this container's memory limit"
        break
    try:  # the model's process's own limit (--memory-limit), when lower still
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_DATA)
        if soft != resource.RLIM_INFINITY and 0 < soft < physical:
            physical, where = soft, "the memory limit (--memory-limit)"
    except (ImportError, ValueError, OSError):
        pass
    return physical, where


def check_size(
    unknowns: int,
    rows: int,
    input_shape: tuple[int, ...],
    batch_size: int,
    *,
    device: str | torch.device = "cpu",
    vectors: bool = False,
    counted_by: dict[str, int] | None = None,
):
    """Refuse a sketch whose float64 matrix and factorisation do not fit the device's memory budget, before any
    work; the message gives both figures and the fixes. ``counted_by``: the flags whose product is the number of
    samples (a round's --clients and --local-samples; default --batch-size), each named in the message."""
    needed = sketch_bytes(rows, unknowns, vectors=vectors)
    budget, rule = memory_budget(device)
    if needed <= budget:
        return
    shape = "x".join(str(d) for d in input_shape)
    device = torch.device(device)
    samples = " x ".join(f"{value:,} ({flag})" for flag, value in counted_by.items()) if counted_by else str(batch_size)
    flags = " or ".join(counted_by or ["--batch-size"])
    fixes = (
        "check it at a lower resolution with --input-shape (a convolutional or patch-based model is "
        f"resolution-independent), or lower {flags}"
    )
    if device.type == "cpu":
        fixes += "; or use --device cuda on a machine whose GPU has the memory"
    raise UsageError(
        f"--verify rank needs {needed / 2**30:.1f} GiB for its {rows:,} x {unknowns:,} float64 sketch and its "
        f"{'SVD with vectors' if vectors else 'factorisation'} (n = {samples} x {shape} = {unknowns:,} unknowns), "
        f"more than the {budget / 2**30:.1f} GiB it may use on {device.type} ({rule})",
        fixes,
    )


def largest_unknowns(budget: int, extra_rows: int, *, vectors: bool = False) -> int:
    """The most unknowns whose sketch (n + extra_rows rows, the most it ever has) fits ``budget`` bytes (README's
    table)."""
    low, high = 0, 1
    while sketch_bytes(high + extra_rows, high, vectors=vectors) <= budget:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if sketch_bytes(middle + extra_rows, middle, vectors=vectors) <= budget:
            low = middle
        else:
            high = middle
    return low
