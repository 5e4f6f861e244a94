"""--verify dager: DAGER on a real gradient of a language model: the batch's gradient, the span test, the extension."""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from rankaudit.verify import AttackUnsupported, finite
from rankaudit.verify.attacks.dager_call import LanguageModelCall, is_causal, layer_input
from rankaudit.verify.attacks.dager_span import (
    CHUNK_ELEMENTS,
    DISTANCE_THRESHOLD,
    SpanBasis,
    span_basis,
    span_distances,
    span_test_vocabulary,
)

# Greedy extension: prefixes kept per step, and the sequences one step may try before it gives up.
MAX_PREFIXES_PER_SEQUENCE = 4
MAX_TRIALS_PER_STEP = 50_000


def row_space_input(module: nn.Module, gradient: torch.Tensor, d_in: int) -> torch.Tensor:
    """The weight gradient as d_in x d_out: nn.Linear stores (out, in); GPT-2's Conv1D stores (in, out)."""
    if isinstance(module, nn.Linear) or gradient.shape[0] != d_in:
        return gradient.T
    return gradient


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
