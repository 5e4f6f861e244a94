"""The sketch S = R·J of --verify rank: each row rᵀJ = ∂/∂x ⟨r, g(x)⟩, a chunk of Gaussian directions r at a time."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.verify.client import mean_loss
from rankaudit.verify.rank.budget import CPU_CHUNK_BYTES

# On CUDA, a chunk may take this share of the memory that is free after a probe chunk.
CUDA_FREE_SHARE = 0.5
# Beyond this many rows per pass, a larger batch no longer makes the kernels more efficient.
MAX_CHUNK_ROWS = 1024
PROBE_ROWS = 8


class _math_attention:
    """Fused attention kernels have no double backward; the math backend has."""

    def __enter__(self):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        self._context = sdpa_kernel(SDPBackend.MATH)
        return self._context.__enter__()

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


class full_float32:
    """float32 that is float32: CUDA's convolutions (and, where enabled, matrix products) otherwise run in TF32, whose
    10-bit mantissa puts a float32 sketch's error near 1e-3 of its rows, too large for its full-rank test."""

    def __enter__(self):
        self._saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = self._saved
        return False


def shared_names(net: nn.Module, shared, model_name: str) -> tuple[dict, list[str]]:
    """The net's trainable parameters by name, and the names whose gradient is shared (default: every trainable
    one), each checked to be one of them."""
    trainable = {name: p for name, p in net.named_parameters() if p.requires_grad}
    names = list(trainable) if shared is None else list(dict.fromkeys(shared))
    missing = [name for name in names if name not in trainable]
    if missing:
        raise UsageError(
            f"{', '.join(missing)} is not a trainable parameter of {model_name}",
            "name parameters from model.named_parameters() that require grad",
        )
    return trainable, names


def _fill_sketch(
    net: nn.Module,
    x: torch.Tensor,
    labels: torch.Tensor,
    loss: str,
    names: list[str],
    sketch: torch.Tensor,
    *,
    seed: int,
    chunk_rows: int | None,
    progress: Callable[[int, int], None] | None,
) -> tuple[str, int]:
    """Write R·J into ``sketch`` chunk by chunk; returns the method used and the chunk size."""
    shapes = [tuple(dict(net.named_parameters())[name].shape) for name in names]
    fast = _ForwardOverReverse(net, x, labels, loss, names)
    slow: list[_ReverseOverReverse] = []

    def rows_of(directions: list[torch.Tensor]) -> torch.Tensor:
        if not slow:
            try:
                return fast(directions)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as unsupported:  # torch.func refuses the model: plain autograd can still do it
                slow.append(_ReverseOverReverse(net, x, labels, loss, names, why=unsupported))
        return slow[0](directions)

    size = fill_in_chunks(
        sketch,
        shapes,
        rows_of,
        seed=seed,
        chunk_rows=chunk_rows,
        progress=progress,
        activation_numel=lambda: _activation_numel(net, x, labels, loss),
        too_large="one row of the rank sketch does not fit in the GPU's free memory",
        fix="use --device cpu, or a lower --input-shape / --batch-size",
    )
    return ("reverse-over-reverse" if slow else "forward-over-reverse"), size


def fill_in_chunks(
    sketch: torch.Tensor,
    shapes: list[tuple[int, ...]],
    rows_of: Callable[[list[torch.Tensor]], torch.Tensor],
    *,
    seed: int,
    chunk_rows: int | None,
    progress: Callable[[int, int], None] | None,
    activation_numel: Callable[[], int],
    too_large: str,
    fix: str,
) -> int:
    """Write the rows ``rows_of(directions)`` of R·J into ``sketch``, a chunk of Gaussian directions (one tensor per
    shape in ``shapes``) at a time; returns the chunk size used. The single gradient's sketch and the round's
    (verify/round_rank.py) share it.

    On a CPU a chunk is sized from the parameters and ``activation_numel()`` (the entries one pass saves); on CUDA
    a probe chunk measures what a row costs and the rest is sized to the free memory, halving on running out."""
    device = sketch.device
    rows = sketch.shape[0]
    size = chunk_rows or (
        min(PROBE_ROWS, rows)
        if device.type == "cuda"
        else _cpu_chunk(sum(math.prod(shape) for shape in shapes), activation_numel(), rows)
    )
    size = max(1, min(size, rows))
    generator = torch.Generator(device=device)
    buffers: dict = {}  # the drawn rows' memory, reused from chunk to chunk
    done, sized = 0, chunk_rows is not None or device.type != "cuda"
    while done < rows:
        count = min(size, rows - done)
        if device.type == "cuda" and not sized:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        directions = _gaussian_rows(done, count, shapes, seed, generator, dtype=sketch.dtype, reuse=buffers)
        try:
            block = rows_of(directions)
        except torch.cuda.OutOfMemoryError:
            del directions
            torch.cuda.empty_cache()
            if count == 1:
                raise UsageError(too_large, fix) from None
            size, sized = max(1, count // 2), True
            continue
        sketch[done : done + count] = block.reshape(count, -1)
        done += count
        if not sized:
            # The probe chunk measured what one row costs; size the rest to the memory that is free now.
            per_row = max(torch.cuda.max_memory_allocated(device) - before, 1) / count
            free = torch.cuda.mem_get_info(device)[0]
            size, sized = int(max(1, min(MAX_CHUNK_ROWS, CUDA_FREE_SHARE * free / per_row))), True
        del directions, block
        if progress is not None:
            progress(done, rows)
    return size


def _gaussian_rows(
    first: int,
    count: int,
    shapes: list[tuple[int, ...]],
    seed: int,
    generator: torch.Generator,
    dtype: torch.dtype = torch.float64,
    reuse: dict | None = None,
) -> list[torch.Tensor]:
    """Rows first .. first + count - 1 of R, cut into one (count, *shape) tensor of ``dtype`` per shared parameter
    (the float32 and the float64 sketch use the same R).

    Each row has its own seed, so R is the same however it is chunked (the CPU's normal sampler fills blocks of
    16: one stream cut at other places gives other numbers). Drawn in float32, then widened: every entry is still
    an exact float64 Gaussian sample (at float32 resolution, which changes nothing about rank(R·J) = rank(J)), and
    PyTorch's CPU sampler is 5x faster for float32; R has rows x m entries, 3.9e9 for Figure 2(c)'s 1.26M
    parameters, and drawing them dominated its sketch.

    ``reuse``: a dict the caller keeps across chunks; the rows are then drawn into buffers kept there (fresh
    memory of this size costs a page fault per page, seconds over a whole sketch), and the tensors returned are
    views that the next call overwrites.
    """
    width = sum(math.prod(shape) for shape in shapes)
    drawn = _draw_rows(first, count, width, seed, generator, reuse)
    wide = drawn
    if dtype != torch.float32:
        wide = _buffer(reuse, "wide", count, width, dtype, generator.device).copy_(drawn)
    return per_parameter(wide, shapes)


def per_parameter(rows: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """Flat rows (count x m) cut into one (count, *shape) view per parameter: a parameter's column block, viewed in
    its shape (its rows strided, its entries within a row contiguous), nothing copied."""
    sizes = [math.prod(shape) for shape in shapes]
    return [block.view(len(rows), *shape) for block, shape in zip(rows.split(sizes, dim=1), shapes)]


def _draw_rows(
    first: int, count: int, width: int, seed: int, generator: torch.Generator, reuse: dict | None = None
) -> torch.Tensor:
    """Rows first .. first + count - 1 of R as one float32 (count, width) tensor, each row from its own seed."""
    drawn = _buffer(reuse, "draws", count, width, torch.float32, generator.device)

    def draw(offsets: range, source: torch.Generator) -> None:
        for offset in offsets:
            source.manual_seed((seed * 2**24 + first + offset) % 2**63)
            drawn[offset].normal_(generator=source)

    threads = min(torch.get_num_threads(), count) if generator.device.type == "cpu" else 1
    if threads > 1:
        # The CPU's sampler runs on one core; the rows are seeded one by one, so threads that each take every
        # threads-th row draw the same R (torch releases the GIL while it samples).
        with ThreadPoolExecutor(threads) as pool:
            parts = [range(start, count, threads) for start in range(threads)]
            list(pool.map(draw, parts, [torch.Generator() for _ in range(threads)]))
    else:
        draw(range(count), generator)
    return drawn


def _buffer(reuse: dict | None, name: str, count: int, width: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A (count, width) tensor: the first rows of the one kept in ``reuse`` under ``name`` when it is large enough."""
    if reuse is None:
        return torch.empty((count, width), dtype=dtype, device=device)
    kept = reuse.get(name)
    if kept is None or kept.shape[0] < count or kept.shape[1] != width or kept.dtype != dtype:
        kept = reuse[name] = torch.empty((count, width), dtype=dtype, device=device)
    return kept[:count]


def _cpu_chunk(shared_numel: int, activation_numel: int, rows: int) -> int:
    # Per row: the random direction (float32 draws and their float64 copy: 1.5m, counted as 2m), and a tangent
    # of every saved activation in the forward and in the backward pass (2 per entry). Measured peak memory on
    # CNN6 and the DenseNet example at 3x16x16 lies within 10 % of this.
    per_row = 8 * (2 * shared_numel + 2 * activation_numel)
    return int(max(1, min(rows, MAX_CHUNK_ROWS, CPU_CHUNK_BYTES // max(per_row, 1))))


def _activation_numel(net: nn.Module, x: torch.Tensor, labels: torch.Tensor, loss: str) -> int:
    """Entries autograd saves for one forward pass and loss, parameters aside: the activations a row's tangents
    mirror."""
    total = [0]
    parameters = {p.data_ptr() for p in net.parameters()}

    def pack(tensor):
        if tensor.data_ptr() not in parameters:
            total[0] += tensor.numel()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        mean_loss(net(x.clone().requires_grad_()), labels, loss)
    return total[0]


class _ForwardOverReverse:
    """rᵀJ = d/dε ∂L/∂x (θ + ε r): jvp of the input gradient along r, vmapped over a chunk of r."""

    def __init__(self, net, x, labels, loss, names):
        from torch.func import functional_call, grad, jvp, vmap

        parameters = {name: p.detach() for name, p in net.named_parameters()}
        buffers = {name: b.detach() for name, b in net.named_buffers()}
        shared = {name: parameters[name] for name in names}
        fixed = {name: p for name, p in parameters.items() if name not in shared}
        self.names = names

        def loss_of(shared_values, inputs):
            logits = functional_call(net, ({**fixed, **shared_values}, buffers), (inputs,))
            return mean_loss(logits, labels, loss)

        input_gradient = grad(loss_of, argnums=1)

        def row(direction):
            return jvp(lambda values: input_gradient(values, x), (shared,), (direction,))[1]

        self._rows = vmap(row)

    def __call__(self, directions: list[torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return self._rows(dict(zip(self.names, directions)))


class _ReverseOverReverse:
    """rᵀJ = ∂/∂x ⟨r, g(x)⟩ by a double backward through plain autograd, batched with is_grads_batched."""

    def __init__(self, net, x, labels, loss, names, why: Exception):
        self.x = x.clone().requires_grad_()
        named = dict(net.named_parameters())
        parameters = [named[name] for name in names]
        with torch.enable_grad():
            objective = mean_loss(net(self.x), labels, loss)
            custom = _custom_functions(objective.grad_fn)
            severed: list[tuple[str, str]] = []
            hooks = [node.register_hook(_severance_check(node, severed)) for node in custom]
            try:
                gradients = torch.autograd.grad(objective, parameters, create_graph=True, allow_unused=True)
            except RuntimeError as exc:
                raise _no_double_backward(exc, custom) from exc
            finally:
                for hook in hooks:
                    hook.remove()
        if severed:
            name, why = severed[0]
            raise ModelLoadError(
                f"{name} has no double backward: {why}, so ∂g/∂x cannot be taken through it",
                "write its backward with differentiable torch operations (or give the "
                "autograd.Function setup_context and jvp, for torch.func), or replace the op "
                "for this check",
            )
        self.pieces = [(g, p) for g, p in zip(gradients, parameters)]
        differentiable = [g.reshape(-1) for g, _ in self.pieces if g is not None and g.requires_grad]
        self.flat = torch.cat(differentiable) if differentiable else None
        # Which entries of R meet a gradient that depends on x: the rest multiply a constant and drop out.
        self.mask = [g is not None and g.requires_grad for g, _ in self.pieces]
        self.custom = custom
        self.why = why

    def __call__(self, directions: list[torch.Tensor]) -> torch.Tensor:
        count = directions[0].shape[0]
        if self.flat is None:
            return torch.zeros((count, *self.x.shape), dtype=self.x.dtype, device=self.x.device)
        cotangent = torch.cat([d.reshape(count, -1) for d, keep in zip(directions, self.mask) if keep], dim=1)
        try:
            (block,) = torch.autograd.grad(
                self.flat, self.x, grad_outputs=cotangent, retain_graph=True, is_grads_batched=True, allow_unused=True
            )
        except RuntimeError as exc:
            raise _no_double_backward(exc, self.custom) from exc
        if block is None:
            return torch.zeros((count, *self.x.shape), dtype=self.x.dtype, device=self.x.device)
        return block.detach()


def _custom_functions(root) -> list:
    """The custom autograd.Function nodes in a backward graph."""
    seen, stack, found = set(), [root], []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "_forward_cls"):
            found.append(node)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return found


def _function_name(node) -> str:
    cls = node._forward_cls
    return f"{cls.__module__}.{cls.__qualname__}" if cls.__module__ not in ("__main__", None) else cls.__qualname__


def _severance_check(node, severed: list[tuple[str, str]]):
    """A backward run with create_graph must return gradients autograd can differentiate again: ones that still
    require grad when its incoming gradients do, and not wrapped in the error node of @once_differentiable
    (whose inputs were computed without a graph, so a second backward may silently skip it instead of failing)."""

    def hook(grad_inputs, grad_outputs):
        incoming = any(g is not None and g.requires_grad for g in grad_outputs)
        outgoing = [g for g in grad_inputs if g is not None]
        if not incoming or not outgoing:
            return
        if any(g.grad_fn is not None and g.grad_fn.name() in _ERROR_NODES for g in outgoing):
            severed.append((_function_name(node), "its backward is marked @once_differentiable"))
        elif not any(g.requires_grad for g in outgoing):
            severed.append((_function_name(node), "its backward returns gradients computed outside autograd"))

    return hook


_ERROR_NODES = ("torch::autograd::Error", "torch::autograd::DelayedError")


def _no_double_backward(exc: RuntimeError, custom: list) -> ModelLoadError:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    fix = (
        "write the backward with differentiable torch operations (not @once_differentiable), or replace the op "
        "for this check"
    )
    if "once_differentiable" in message:
        marked = [_function_name(n) for n in custom if hasattr(n._forward_cls.backward, "__wrapped__")]
        name = marked[0] if marked else (_function_name(custom[0]) if custom else "a custom autograd.Function")
        return ModelLoadError(
            f"{name} has no double backward: its backward is marked @once_differentiable, so "
            "∂g/∂x cannot be taken through it",
            fix,
        )
    op = re.search(r"derivative for ['\"]?([\w.:]+)['\"]? is not implemented", message)
    if op:
        return ModelLoadError(
            f"{op.group(1)} has no double backward ({message}), so ∂g/∂x cannot be taken through it", fix
        )
    return ModelLoadError(f"the shared gradient cannot be differentiated with respect to the input: {message}", fix)
