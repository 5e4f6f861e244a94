"""--verify dager: DAGER's span test on a real gradient of a language model: recovered tokens against the true ones."""

from __future__ import annotations

import inspect
import math
import re
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from rankaudit.verify import AttackUnsupported, finite

# A candidate is in the gradient's row space when its distance to it is below this fraction of its own norm. In
# float64 the batch's own vectors sit near 1e-8 (the floor of ||x||² - ||Qᵀx||²), the others at sqrt(1 - r/d).
DISTANCE_THRESHOLD = 1e-5
# Candidate vectors per chunk: the layer inputs of (chunk x n) sequences are held at once.
CHUNK_ELEMENTS = 1 << 24
# Greedy extension: prefixes kept per step, and the sequences one step may try before it gives up.
MAX_PREFIXES_PER_SEQUENCE = 4
MAX_TRIALS_PER_STEP = 50_000


@dataclass
class SpanBasis:
    """An orthonormal basis of a gradient's row space in the layer's input space, and how its rank was set."""

    basis: torch.Tensor  # d_in x rank
    rank: int
    tolerance: float  # singular values above it count
    largest: float  # σ_1
    last_kept: float | None  # σ_rank
    first_dropped: float | None  # σ_rank+1


def span_basis(gradient: torch.Tensor) -> SpanBasis:
    """`gradient`: d_in x d_out (each column a combination of the batch's input vectors). Numerical rank: singular
    values above σ_1 · max(d_in, d_out) · ε of the dtype (NumPy's matrix_rank rule)."""
    threads = torch.get_num_threads()
    # A d_in x d_out SVD is small: one thread does it in milliseconds, while LAPACK's threads on a loaded CPU
    # can spin for seconds (7 s instead of 0.02 s for 128 x 384 on a busy two-core machine).
    torch.set_num_threads(1)
    try:
        left, singular, _ = torch.linalg.svd(gradient.cpu(), full_matrices=False)
    finally:
        torch.set_num_threads(threads)
    largest = float(singular[0]) if singular.numel() else 0.0
    tolerance = largest * max(gradient.shape) * torch.finfo(gradient.dtype).eps
    rank = int((singular > tolerance).sum()) if largest > 0 else 0
    return SpanBasis(
        left[:, :rank].contiguous().to(gradient.device),
        rank,
        tolerance,
        largest,
        float(singular[rank - 1]) if rank else None,
        float(singular[rank]) if rank < singular.numel() else None,
    )


def span_distances(basis: torch.Tensor, vectors: torch.Tensor) -> torch.Tensor:
    """Distance of each row of `vectors` (N x d_in) to span(basis), relative to the row's norm: one matrix product
    per batch of candidates (||x||² - ||Qᵀx||², Q orthonormal)."""
    squared = vectors.pow(2).sum(dim=1)
    projected = (vectors @ basis).pow(2).sum(dim=1)
    return (squared - projected).clamp_min(0).sqrt() / squared.sqrt().clamp_min(torch.finfo(vectors.dtype).tiny)


class _Captured(Exception):
    """Raised from a forward pre-hook once the layer's input is in hand: nothing after it needs to run."""


@dataclass
class LanguageModelCall:
    """How to call a language model's forward() with token ids, and what its other inputs get."""

    model: nn.Module
    token_input: str
    positional: bool
    other_inputs: dict[str, str] = field(default_factory=dict)  # name -> same | mask | positions | zeros
    switches: dict = field(default_factory=dict)

    def __call__(self, ids: torch.Tensor):
        kwargs = dict(self.switches)
        for name, kind in self.other_inputs.items():
            if kind == "same":
                kwargs[name] = ids
            elif kind == "mask":
                kwargs[name] = torch.ones_like(ids)
            elif kind == "positions":
                kwargs[name] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
            else:
                kwargs[name] = torch.zeros_like(ids)
        if self.positional:
            return self.model(ids, **kwargs)
        return self.model(**{self.token_input: ids}, **kwargs)

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return first_tensor(self(ids))


def first_tensor(output) -> torch.Tensor:
    """The logits among a model's outputs: an entry named `logits`, else the first tensor."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict):
        if isinstance(output.get("logits"), torch.Tensor):
            return output["logits"]
        output = list(output.values())
    for value in output:
        if isinstance(value, torch.Tensor):
            return value
    raise AttackUnsupported("output", "forward() returned no tensor to compute a loss from")


def layer_input(call: LanguageModelCall, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The input `module` receives when the model reads `ids` (the forward stops there)."""
    captured = {}

    def hook(_, args, kwargs):
        captured["x"] = args[0] if args else next(iter(kwargs.values()))
        raise _Captured

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            call(ids)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "x" not in captured:
        raise AttackUnsupported(type(module).__name__, "the model's forward() never called this layer")
    return captured["x"]


def row_space_input(module: nn.Module, gradient: torch.Tensor, d_in: int) -> torch.Tensor:
    """The weight gradient as d_in x d_out: nn.Linear stores (out, in); GPT-2's Conv1D stores (in, out)."""
    if isinstance(module, nn.Linear) or gradient.shape[0] != d_in:
        return gradient.T
    return gradient


def is_causal(call: LanguageModelCall, vocab_size: int, positions: int, device) -> bool:
    """A decoder: changing the last token leaves the first position's output unchanged, while changing the first
    token changes the last position's (a model that treats each position alone is no decoder)."""
    if positions < 2:
        return False
    generator = torch.Generator().manual_seed(12345)
    ids = torch.randint(vocab_size, (1, positions), generator=generator).to(device)
    last_changed, first_changed = ids.clone(), ids.clone()
    last_changed[0, -1] = (last_changed[0, -1] + 1) % vocab_size
    first_changed[0, 0] = (first_changed[0, 0] + 1) % vocab_size
    with torch.no_grad():
        logits, after_last, after_first = (call.logits(x) for x in (ids, last_changed, first_changed))
    if logits.dim() < 3 or logits.shape[1] != positions:
        return False
    return bool(torch.equal(logits[:, 0], after_last[:, 0]) and not torch.equal(logits[:, -1], after_first[:, -1]))


def next_block(name: str, model: nn.Module) -> str | None:
    """The same layer one block later (h.0.attn.c_attn -> h.1.attn.c_attn), if the model has it."""
    match = re.search(r"(?:^|\.)(\d+)(?=\.)", name)
    if match is None:
        return None
    start, end = match.span(1)
    candidate = f"{name[:start]}{int(match.group(1)) + 1}{name[end:]}"
    try:
        model.get_submodule(candidate)
    except AttributeError:
        return None
    return candidate


def wake_lora(model: nn.Module, names: list[str], seed: int) -> list[str]:
    """peft initialises every B to zero, so the first round's ∇A is zero. Draw B at random for the adapters whose
    A is attacked, as after some rounds of training; returns the modules changed."""
    changed = []
    generator = torch.Generator().manual_seed(seed + 31)
    for name in names:
        if ".lora_A." not in f".{name}.":
            continue
        partner = name.replace("lora_A", "lora_B")
        try:
            b_module = model.get_submodule(partner)
        except AttributeError:
            continue
        weight = getattr(b_module, "weight", None)
        if weight is not None and not weight.detach().any():
            with torch.no_grad():
                bound = 1.0 / math.sqrt(weight.shape[1])
                draw = torch.rand(weight.shape, generator=generator, dtype=torch.float64) * 2 - 1
                weight.copy_((draw * bound).to(weight))
            changed.append(partner)
    return changed


def _loss(
    logits: torch.Tensor,
    ids: torch.Tensor,
    targets: torch.Tensor,
    causal: bool,
    vocab_size: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, str]:
    """Next-token cross-entropy for a decoder, cross-entropy on random labels for a classifier."""
    functional = nn.functional
    if logits.dim() == 3 and causal and logits.shape[-1] == vocab_size:
        return (
            functional.cross_entropy(logits.reshape(-1, vocab_size), targets.reshape(-1)),
            "next-token cross-entropy (each sequence's n targets: the tokens after its n inputs)",
        )
    if logits.dim() == 3:
        labels = torch.randint(logits.shape[-1], logits.shape[:2], generator=generator).to(logits.device)
        return (
            functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)),
            "cross-entropy on random per-position labels",
        )
    if logits.dim() == 2:
        labels = torch.randint(logits.shape[-1], logits.shape[:1], generator=generator).to(logits.device)
        return functional.cross_entropy(logits, labels), "cross-entropy on random class labels"
    return logits.pow(2).sum(), "the sum of the squared outputs"


@dataclass
class DagerOutcome:
    layers: list[str]  # the layers whose gradients span the test's subspace
    d_in: int
    basis: SpanBasis
    true_pairs: set[tuple[int, int]]  # (token, position) of the batch
    passed: list[tuple[int, int, float]]  # (token, position, distance) accepted by the span test
    candidates_tested: int
    position_dependent: bool
    causal: bool
    loss: str
    span_seconds: float
    sequences: list[tuple[int, ...]]
    recovered_sequences: list[tuple[int, ...]] = field(default_factory=list)
    extension: dict | None = None
    notes: list[str] = field(default_factory=list)
    nearest_rejected: float | None = None  # the smallest distance among the candidates the test rejected
    method: str = ""  # how the candidates' vectors were obtained


def _candidate_layout(vocab_size: int, positions: int, position_dependent: bool):
    """Sequences that put every candidate at the input of the attacked layer, and which (token, position) each
    entry is. Position-dependent vectors: sequence j holds token (j + p) mod V at position p, so V sequences cover
    every (token, position) pair. Otherwise each token once, n to a sequence."""
    if position_dependent:
        rows = vocab_size

        def tokens(start: int, stop: int) -> torch.Tensor:
            offsets = torch.arange(start, stop).unsqueeze(1) + torch.arange(positions).unsqueeze(0)
            return offsets % vocab_size
    else:
        rows = -(-vocab_size // positions)

        def tokens(start: int, stop: int) -> torch.Tensor:
            return (torch.arange(start * positions, stop * positions) % vocab_size).reshape(stop - start, positions)

    return rows, tokens


@dataclass
class SpanTest:
    """The span test over the vocabulary: what passed, how many vectors were tested, and how."""

    accepted: list[tuple[int, int, float]]  # (token, position, relative distance) below the threshold
    tested: int
    nearest_rejected: float | None  # the smallest distance among the rejected: the margin left
    method: str  # how the candidates' vectors were obtained


def span_test_vocabulary(
    call: LanguageModelCall,
    module: nn.Module,
    basis: torch.Tensor,
    *,
    vocab_size: int,
    positions: int,
    position_dependent: bool,
    device,
    threshold: float = DISTANCE_THRESHOLD,
    norm: nn.Module | None = None,
    progress=None,
) -> SpanTest:
    """Test every candidate's input vector to `module` against the span.

    With `norm` (the LayerNorm the layer reads) and position-dependent vectors, first try the exact shortcut of
    `layer_norm_shortcut`; otherwise, or when its checks fail, run every candidate through the model."""
    if norm is not None and position_dependent and isinstance(norm, nn.LayerNorm):
        shortcut = layer_norm_shortcut(
            call,
            module,
            norm,
            basis,
            vocab_size=vocab_size,
            positions=positions,
            device=device,
            threshold=threshold,
            progress=progress,
        )
        if shortcut is not None:
            return shortcut
    return _span_test_through_model(
        call,
        module,
        basis,
        vocab_size=vocab_size,
        positions=positions,
        position_dependent=position_dependent,
        device=device,
        threshold=threshold,
        progress=progress,
    )


def _span_test_through_model(
    call, module, basis, *, vocab_size, positions, position_dependent, device, threshold, progress
) -> SpanTest:
    rows, tokens = _candidate_layout(vocab_size, positions, position_dependent)
    d_in = basis.shape[0]
    chunk = max(1, CHUNK_ELEMENTS // max(1, positions * d_in))
    accepted: list[tuple[int, int, float]] = []
    tested, nearest_rejected = 0, math.inf
    seen = torch.zeros((vocab_size, positions if position_dependent else 1), dtype=torch.bool)
    for start in range(0, rows, chunk):
        stop = min(rows, start + chunk)
        ids = tokens(start, stop)
        vectors = layer_input(call, module, ids.to(device)).reshape(stop - start, positions, -1)
        distances = (
            span_distances(basis, vectors.reshape(-1, vectors.shape[-1]).to(basis.dtype))
            .reshape(stop - start, positions)
            .cpu()
        )
        flat_ids = ids.reshape(-1)
        flat_positions = torch.arange(positions).repeat(stop - start)
        flat_distances = distances.reshape(-1)
        column = flat_positions if position_dependent else torch.zeros_like(flat_positions)
        fresh = ~seen[flat_ids, column]
        seen[flat_ids, column] = True
        flat_ids, column, flat_distances = flat_ids[fresh], column[fresh], flat_distances[fresh]
        tested += int(fresh.sum())
        hits = flat_distances < threshold
        for token, position, distance in zip(
            flat_ids[hits].tolist(), column[hits].tolist(), flat_distances[hits].tolist()
        ):
            accepted.append((token, position, distance))
        if (~hits).any():
            nearest_rejected = min(nearest_rejected, float(flat_distances[~hits].min()))
        if progress is not None:
            progress(stop, rows)
    what = "every (token, position) pair" if position_dependent else "every token once"
    return SpanTest(
        accepted,
        tested,
        None if nearest_rejected == math.inf else nearest_rejected,
        f"{what} run through the model up to the layer",
    )


# The shortcut's checks: pairs drawn at random, and the largest relative difference allowed from the model's own
# layer input (float64 arithmetic in a different order differs by about 1e-15).
SHORTCUT_CHECKS = 256
SHORTCUT_AGREEMENT = 1e-9


def layer_norm_shortcut(
    call: LanguageModelCall,
    module: nn.Module,
    norm: nn.LayerNorm,
    basis: torch.Tensor,
    *,
    vocab_size: int,
    positions: int,
    device,
    threshold: float = DISTANCE_THRESHOLD,
    progress=None,
) -> SpanTest | None:
    """The span test for x = LayerNorm(a_v + c_p) without forming the V·n vectors: the distance of x to the span
    expands into inner products of the centred, scaled a_v and c_p (V x n matrix products), as GPT-2 and BERT add
    a position embedding to the token's before the norm.

    a_v and c_p are read off the model (the norm's input for each token at position 0, and for one token at every
    position); the shortcut is used only if, on SHORTCUT_CHECKS random (token, position) pairs, a_v + c_p is the
    norm's input and LayerNorm(a_v + c_p) the layer's input to within SHORTCUT_AGREEMENT. None otherwise."""
    if tuple(norm.normalized_shape) != (basis.shape[0],):
        return None
    dtype = basis.dtype
    first = [
        layer_input(call, norm, torch.arange(start, min(vocab_size, start + 4096)).unsqueeze(1).to(device))
        for start in range(0, vocab_size, 4096)
    ]
    token_part = torch.cat([x.reshape(-1, x.shape[-1]) for x in first]).to(dtype)  # a_v + c_0
    along = layer_input(call, norm, torch.zeros((1, positions), dtype=torch.long, device=device))
    offsets = along.reshape(positions, -1).to(dtype) - along.reshape(positions, -1)[0].to(dtype)  # c_p - c_0
    if not _shortcut_agrees(call, module, norm, token_part, offsets, vocab_size, positions, device):
        return None
    d = basis.shape[0]
    gamma = norm.weight.detach().to(dtype) if norm.weight is not None else torch.ones(d, dtype=dtype, device=device)
    beta = (
        norm.bias.detach().to(dtype)
        if getattr(norm, "bias", None) is not None
        else torch.zeros(d, dtype=dtype, device=device)
    )

    def complement(v):  # v minus its projection on the span
        return v - (v @ basis) @ basis.T

    w = offsets - offsets.mean(dim=1, keepdim=True)  # centred c_p
    scaled_w, beta_out = gamma * w, complement(beta)
    w_out = complement(scaled_w)
    w_sq, scaled_w_sq, w_out_sq = (w * w).sum(1), (scaled_w * scaled_w).sum(1), (w_out * w_out).sum(1)
    accepted: list[tuple[int, int, float]] = []
    nearest_rejected = math.inf
    chunk = max(1, CHUNK_ELEMENTS // max(1, d + positions))
    for start in range(0, vocab_size, chunk):
        u = token_part[start : start + chunk]
        u = u - u.mean(dim=1, keepdim=True)  # centred a_v
        scaled_u = gamma * u
        u_out = complement(scaled_u)
        variance = ((u * u).sum(1, keepdim=True) + 2 * u @ w.T + w_sq) / d + norm.eps
        sigma = variance.sqrt()
        full = (
            ((scaled_u * scaled_u).sum(1, keepdim=True) + 2 * scaled_u @ scaled_w.T + scaled_w_sq) / variance
            + 2 * ((scaled_u @ beta).unsqueeze(1) + scaled_w @ beta) / sigma
            + beta @ beta
        )
        outside = (
            ((u_out * u_out).sum(1, keepdim=True) + 2 * u_out @ w_out.T + w_out_sq) / variance
            + 2 * ((u_out @ beta_out).unsqueeze(1) + w_out @ beta_out) / sigma
            + beta_out @ beta_out
        )
        distance = (outside.clamp_min(0) / full.clamp_min(torch.finfo(dtype).tiny)).sqrt().cpu()
        hits = distance < threshold
        for token, position in hits.nonzero().tolist():
            accepted.append((start + token, position, float(distance[token, position])))
        if (~hits).any():
            nearest_rejected = min(nearest_rejected, float(distance[~hits].min()))
        if progress is not None:
            progress(min(vocab_size, start + chunk), vocab_size)
    return SpanTest(
        accepted,
        vocab_size * positions,
        None if nearest_rejected == math.inf else nearest_rejected,
        f"every (token, position) pair, through LayerNorm(token part + position part) in closed form "
        f"(checked against the model's own layer input on {SHORTCUT_CHECKS} random pairs)",
    )


def _shortcut_agrees(call, module, norm, token_part, offsets, vocab_size, positions, device) -> bool:
    generator = torch.Generator().manual_seed(2024)
    ids = torch.randint(vocab_size, (-(-SHORTCUT_CHECKS // positions), positions), generator=generator).to(device)
    inside = layer_input(call, norm, ids).reshape(-1, token_part.shape[1]).to(token_part.dtype)
    predicted = token_part[ids.reshape(-1)] + offsets.repeat(ids.shape[0], 1)
    if not _close(inside, predicted):
        return False
    with torch.no_grad():
        normed = norm(predicted.to(norm.weight.dtype if norm.weight is not None else predicted.dtype))
    reached = layer_input(call, module, ids).reshape(-1, token_part.shape[1])
    return _close(reached.to(token_part.dtype), normed.to(token_part.dtype))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a - b).norm(dim=1) <= SHORTCUT_AGREEMENT * b.norm(dim=1).clamp_min(1e-30)).all())


def extend_sequences(
    call: LanguageModelCall,
    module: nn.Module,
    basis: torch.Tensor,
    per_position: list[list[int]],
    *,
    batch_size: int,
    device,
    threshold: float = DISTANCE_THRESHOLD,
) -> tuple[list[tuple], str]:
    """DAGER's greedy decoder search: grow prefixes one token at a time, keeping a prefix when the second layer's
    input at its last position (a function of the whole prefix, through causal attention) lies in the span of the
    second layer's gradient. Returns the full-length sequences found and a note."""
    prefixes: list[tuple[int, ...]] = [()]
    keep = MAX_PREFIXES_PER_SEQUENCE * batch_size
    for position, candidates in enumerate(per_position):
        trials = [prefix + (token,) for prefix in prefixes for token in candidates]
        if not trials:
            return [], f"no candidate passed at position {position}"
        if len(trials) > MAX_TRIALS_PER_STEP:
            return [], (
                f"stopped at position {position}: {len(trials):,} prefixes to try (the first layer's test "
                "let too many tokens through)"
            )
        ids = torch.tensor(trials, dtype=torch.long)
        chunk = max(1, CHUNK_ELEMENTS // max(1, (position + 1) * basis.shape[0]))
        distances = []
        for start in range(0, len(trials), chunk):
            vectors = layer_input(call, module, ids[start : start + chunk].to(device))
            last = vectors.reshape(min(chunk, len(trials) - start), position + 1, -1)[:, -1]
            distances.append(span_distances(basis, last.to(basis.dtype)).cpu())
        distance = torch.cat(distances)
        order = torch.argsort(distance)
        passing = [int(i) for i in order if distance[i] < threshold][:keep]
        prefixes = [trials[i] for i in passing]
        if not prefixes:
            return [], f"no prefix passed the second layer's test at position {position}"
    return prefixes, f"kept at most {keep} prefixes per step ({MAX_PREFIXES_PER_SEQUENCE} per sequence)"


def _norm_module(model: nn.Module, name: str | None) -> nn.Module | None:
    """The norm the attacked layers read, by the traced name (an op of a decomposed norm carries a #k suffix)."""
    if not name:
        return None
    try:
        return model.get_submodule(re.sub(r"#\d+$", "", name))
    except AttributeError:
        return None


def _module(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError as exc:
        raise AttackUnsupported(name, "the real model has no module of this name (the trace named it)") from exc


def group_gradient(
    call: LanguageModelCall, modules: list[nn.Module], names: list[str], inputs: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The weight gradients of layers that read the same per-token vectors (q, k and v), each as d_in x d_out and
    scaled to unit norm, side by side: their row spaces all lie in span{x_t}, and together they cover every
    position (a causal decoder's query at position 0 attends to itself alone, so ∇W_q never sees x_0)."""
    d_in = layer_input(call, modules[0], inputs[:1]).shape[-1]
    blocks = []
    for name, module in zip(names, modules):
        grad = module.weight.grad
        if grad is None or not grad.any():
            continue
        block = row_space_input(module, grad.detach().to(torch.float64), d_in)
        if block.shape[0] != d_in:
            raise AttackUnsupported(name, f"its weight does not read vectors of width {d_in} like {names[0]}")
        blocks.append(block / block.norm())
    if not blocks:
        raise AttackUnsupported(names[0], "the gradient is zero for this batch")
    return torch.cat(blocks, dim=1), d_in


def _weighted(names: list[str], model: nn.Module) -> list[nn.Module]:
    modules = []
    for name in names:
        module = _module(model, name)
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise AttackUnsupported(name, "the layer has no 2-D weight whose gradient could be read")
        if not weight.requires_grad:
            raise AttackUnsupported(name, "its weight is frozen: no gradient to read")
        modules.append(module)
    return modules


def run_dager(
    call: LanguageModelCall,
    layers: list[str],
    *,
    batch_size: int,
    positions: int,
    vocab_size: int,
    position_dependent: bool,
    device,
    seed: int = 0,
    extend: bool = True,
    threshold: float = DISTANCE_THRESHOLD,
    ids: torch.Tensor | None = None,
    norm: str | None = None,
    progress=None,
) -> DagerOutcome:
    """One client batch (random tokens unless `ids` is given), its real gradient, the span test of every
    candidate against the gradients of `layers` (layers reading the same per-token vectors) and, for a decoder,
    the greedy extension with the same layers of the next block."""
    model = call.model
    modules = _weighted(layers, model)
    generator = torch.Generator().manual_seed(seed)
    if ids is None:
        ids = torch.randint(vocab_size, (batch_size, positions + 1), generator=generator)
    inputs, targets = ids[:, :positions].to(device), ids[:, 1 : positions + 1].to(device)
    causal = is_causal(call, vocab_size, positions, device)
    second = [next_block(layer, model) for layer in layers] if extend and causal else []
    second = [name for name in second if name is not None]
    woken = wake_lora(model, layers + second, seed)
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        logits = call.logits(inputs)
        loss, loss_name = _loss(logits, inputs, targets, causal, vocab_size, generator)
        loss.backward()
    # The span test on a NaN gradient would accept or reject tokens at random: refuse, naming the op that broke it.
    sent = [p for p in model.parameters() if p.requires_grad]
    finite.require_finite(
        "--verify dager",
        (logits, loss),
        [p.grad for p in sent if p.grad is not None],
        model=model,
        parameters=sent,
        rerun=lambda: _logits_and_loss(call, inputs, targets, causal, vocab_size, seed),
    )
    started = time.perf_counter()
    gradient, d_in = group_gradient(call, modules, layers, inputs)
    basis = span_basis(gradient)
    second_basis = None
    if second:
        try:
            second_basis = span_basis(group_gradient(call, _weighted(second, model), second, inputs)[0])
        except AttackUnsupported:
            second_basis = None
    model.zero_grad(set_to_none=True)
    test = span_test_vocabulary(
        call,
        modules[0],
        basis.basis.to(device),
        vocab_size=vocab_size,
        positions=positions,
        position_dependent=position_dependent,
        device=device,
        threshold=threshold,
        norm=_norm_module(model, norm),
        progress=progress,
    )
    span_seconds = time.perf_counter() - started
    true_pairs = {(int(t), p) for row in inputs.cpu() for p, t in enumerate(row.tolist())}
    outcome = DagerOutcome(
        list(layers),
        d_in,
        basis,
        true_pairs,
        test.accepted,
        test.tested,
        position_dependent,
        causal,
        loss_name,
        span_seconds,
        [tuple(row) for row in inputs.cpu().tolist()],
        notes=[],
        nearest_rejected=test.nearest_rejected,
        method=test.method,
    )
    if woken:
        outcome.notes.append(
            f"peft initialises LoRA's B to zero, which makes the first round's ∇A zero; drew "
            f"{', '.join(woken)} at random, as after some rounds of training"
        )
    if causal and extend:
        outcome.extension = _extension(
            call,
            model,
            second,
            second_basis,
            test.accepted,
            outcome,
            batch_size,
            positions,
            position_dependent,
            device,
            threshold,
        )
    return outcome


def _logits_and_loss(call, inputs, targets, causal, vocab_size, seed):
    logits = call.logits(inputs)
    return logits, _loss(logits, inputs, targets, causal, vocab_size, torch.Generator().manual_seed(seed))[0]


def _extension(
    call,
    model,
    second: list[str],
    second_basis,
    passed,
    outcome,
    batch_size,
    positions,
    position_dependent,
    device,
    threshold,
) -> dict:
    sequences = len(set(outcome.sequences))
    if not second:
        return {"layer": None, "note": "the model has no second block with the same layers: no extension"}
    shown = ", ".join(second)
    if second_basis is None:
        return {"layer": shown, "note": f"the gradient of {shown} is zero or missing: no extension"}
    summary = {
        "layer": shown,
        "rank": second_basis.rank,
        "tolerance": second_basis.tolerance,
        "sequences": sequences,
        "exact_sequences": 0,
        "exact_sequence_rate": 0.0,
        "recovered_sequences": 0,
    }
    if second_basis.rank >= second_basis.basis.shape[0] - 1:
        return {
            **summary,
            "note": (
                f"not attempted: the second layer's gradient has rank {second_basis.rank} of "
                f"{second_basis.basis.shape[0]}, so its span test cannot tell prefixes apart"
            ),
        }
    if len(passed) > MAX_PREFIXES_PER_SEQUENCE * len(outcome.true_pairs):
        return {
            **summary,
            "note": (
                f"not attempted: the first layer's test accepted {len(passed):,} candidates for "
                f"{len(outcome.true_pairs)} token positions, so it narrowed nothing down"
            ),
        }
    tokens = sorted({token for token, _, _ in passed})
    if position_dependent:
        per_position = [sorted({token for token, position, _ in passed if position == p}) for p in range(positions)]
    else:
        per_position = [tokens] * positions
    started = time.perf_counter()
    found, note = extend_sequences(
        call,
        _module(model, second[0]),
        second_basis.basis.to(device),
        per_position,
        batch_size=batch_size,
        device=device,
        threshold=threshold,
    )
    outcome.recovered_sequences = found
    exact = sum(1 for sequence in set(outcome.sequences) if sequence in set(found))
    return {
        **summary,
        "recovered_sequences": len(found),
        "exact_sequences": exact,
        "exact_sequence_rate": exact / sequences if sequences else 0.0,
        "seconds": round(time.perf_counter() - started, 3),
        "note": note,
    }


def forward_call(model: nn.Module, specs, forward_kwargs: dict) -> LanguageModelCall:
    """A LanguageModelCall from the trace's input specs: token ids to the token input, ones to masks, positions
    to position ids, zeros to other ids; use_cache=False where forward() takes it, then the file's FORWARD_KWARGS."""
    token = next(spec for spec in specs if spec.role == "tokens" and not spec.same_as)
    others = {}
    for spec in specs:
        if spec is token:
            continue
        if spec.same_as:
            others[spec.name] = "same"
        elif spec.role == "mask":
            others[spec.name] = "mask"
        elif spec.name.endswith("position_ids"):
            others[spec.name] = "positions"
        else:
            others[spec.name] = "zeros"
    parameters = inspect.signature(model.forward).parameters
    switches = {}
    if "use_cache" in parameters:
        switches["use_cache"] = False
    if "return_dict" in parameters:
        switches["return_dict"] = True
    switches.update(forward_kwargs or {})
    return LanguageModelCall(model, token.name, token.positional, others, switches)
