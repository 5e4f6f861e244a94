"""--verify dager: DAGER's span test for a language model's token set, on random token batches of its vocabulary."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rankaudit.errors import ModelLoadError, UsageError
from rankaudit.verify.progress import ProgressBar
from rankaudit.verify.registry import Need, Verifier, VerifyContext

if TYPE_CHECKING:
    from rankaudit.result import Result


def run(context: VerifyContext) -> dict:
    """DAGER reads token batches it draws itself: --data has no images to give it."""
    if context.data:
        raise UsageError(
            "--verify dager draws random token batches from the vocabulary and reads no --data",
            "leave out --data with --verify dager",
        )
    return verify_tokens(
        context.result, context.spec, seed=context.seed, device=context.device, show_progress=context.show_progress
    )


VERIFIER = Verifier(
    name="dager",
    help="a language model's token set from the span of a first-block projection's gradient (DAGER's test; "
    "random token batches of the vocabulary).",
    needs=frozenset({Need.TOKENS, Need.GPU}),
    run=run,
    order=10,
)


def _dager_layer(result: Result):
    """The layer DAGER reads: the first shared layer the static finding exposes, else the first one whose gradient is
    sent at all (to show the test failing where the finding says it does)."""
    tokens = result.token_leakage
    layers = tokens.layers if tokens is not None else []
    sent = [layer for layer in layers if layer.shared and layer.trainable]
    if not sent:
        raise UsageError(
            "no shared, trainable layer reads per-token vectors, so DAGER's span test has no gradient "
            "to read" + ("" if layers else " (the model reads no token ids, or the trace found no such layer)"),
            "verify a language model whose first-block projections' gradients are sent, or skip --verify dager",
        )
    return next((layer for layer in sent if layer.exposed), sent[0])


def _token_call(result: Result, spec: str, seed: int, device: str):
    """The real model in float64 on `device`, where its weights came from, and how to call it with token ids."""
    import torch

    from rankaudit.model.load import load_model
    from rankaudit.trace.inputs import input_specs
    from rankaudit.verify.attacks import dager_call
    from rankaudit.verify.model import build_real_model, current_model_arguments

    named = {info.name: info for info in result.inputs}
    dtypes = {name: getattr(torch, info.dtype) for name, info in named.items()}
    if len(named) == 1:
        (info,) = named.values()
        shape, dtype = tuple(info.shape), dtypes[info.name]
    else:
        shape, dtype = {name: tuple(info.shape) for name, info in named.items()}, dtypes
    model, weights = build_real_model(spec, shape, seed)
    model = model.to(device)
    loaded = load_model(spec, shape, device="meta", input_dtype=dtype, model_args=current_model_arguments())
    specs = [s for s in input_specs(model, shape, dtype) if s.name in named or s.same_as]
    return model, weights, dager_call.forward_call(model, specs, loaded.forward_kwargs)


def verify_tokens(
    result: Result, spec: str, *, seed: int = 0, device: str = "auto", extend: bool = True, show_progress: bool = True
) -> dict:
    """DAGER (Petrov et al., NeurIPS 2024) on a real gradient: random token batches of the model's vocabulary at
    the analysed batch size and sequence length; fill result.verification['dager']."""
    from rankaudit.verify import AttackUnsupported
    from rankaudit.verify.attacks import dager
    from rankaudit.verify.model import resolve_device

    device = resolve_device(device)
    target = _dager_layer(result)
    # Every sent layer reading the same vectors adds its gradient's row space: q, k and v of the first block.
    group = [
        layer
        for layer in result.token_leakage.layers
        if layer.shared and layer.trainable and layer.reads == target.reads
    ]
    vocabulary = max(embedding.vocab_size for embedding in result.token_leakage.embeddings)
    model, weights, call = _token_call(result, spec, seed, device)
    rows = vocabulary if target.position_dependent else -(-vocabulary // target.positions)
    begin = time.perf_counter()
    try:
        with ProgressBar(rows, f"DAGER span test over {vocabulary:,} tokens", enabled=show_progress) as bar:
            outcome = dager.run_dager(
                call,
                [layer.name for layer in group],
                batch_size=result.batch_size,
                positions=target.positions,
                vocab_size=vocabulary,
                position_dependent=target.position_dependent,
                device=device,
                seed=seed,
                extend=extend,
                norm=target.reads,
                progress=bar,
            )
    except AttackUnsupported as exc:
        raise ModelLoadError(
            f"DAGER cannot read {exc.layer}: {exc.reason}",
            "share the first block's projections, or skip --verify dager",
        ) from exc
    seconds = time.perf_counter() - begin
    verification = dager_summary(outcome, group, result.batch_size, vocabulary, weights, device, seconds)
    result.verification["dager"] = verification
    return verification


def dager_summary(outcome, group, batch_size: int, vocabulary: int, weights: str, device: str, seconds: float) -> dict:
    """The JSON shape of verification.dager, and whether the run agrees with the static finding: exposed when any
    layer of the group is (their gradients together span at least what the exposed one's does)."""
    from rankaudit.verify.attacks import dager_span

    target = next((layer for layer in group if layer.exposed), group[0])

    true_tokens = {token for token, _ in outcome.true_pairs}
    found_tokens = {token for token, _, _ in outcome.passed}
    hits = len(true_tokens & found_tokens)
    precision = hits / len(found_tokens) if found_tokens else 0.0
    recall = hits / len(true_tokens) if true_tokens else 0.0
    found_pairs = {(token, position) for token, position, _ in outcome.passed}
    pair_hits = len(outcome.true_pairs & found_pairs)
    exact = precision == 1.0 and recall == 1.0
    # The condition holds on distinct vectors: a token repeated (at the same position, when vectors depend on it)
    # adds nothing to the span, so a batch of B·n >= d_in tokens can still fall short of d_in distinct vectors.
    distinct = len(outcome.true_pairs) if outcome.position_dependent else len(true_tokens)
    expected = distinct < target.safe_from
    fewer = (
        f"; the batch held {distinct} distinct vectors for B·n = {target.tokens_per_batch} (repeats count once), "
        f"fewer than the {target.safe_from} the test needs to fail"
        if expected and not target.exposed
        else ""
    )
    if expected:
        confirms = exact
        judgement = (
            "confirms exposed: the span test recovered the batch's token set exactly"
            if confirms
            else f"disagrees: the finding says exposed, but token precision {precision:.3f}, recall {recall:.3f}"
        )
        judgement += fewer
    else:
        confirms = not exact
        judgement = (
            f"confirms not exposed at {distinct} distinct vectors (B·n = {target.tokens_per_batch}): token "
            f"precision {precision:.3f}, recall {recall:.3f}"
            if confirms
            else "disagrees: the finding says not exposed, yet the span test recovered the token set exactly"
        )
    basis = outcome.basis
    notes = [
        f"weights: {weights}",
        f"loss: {outcome.loss}",
        f"numerical rank: singular values of the gradient{'s' if len(group) > 1 else ''} ({outcome.d_in} rows"
        f"{', each layer scaled to unit norm' if len(group) > 1 else ''}) above σ_1 · max(rows, columns) · ε "
        f"(float64) = {basis.tolerance:.3g}",
        f"a candidate is in the span when its distance to it is below {dager_span.DISTANCE_THRESHOLD:g} of its norm; "
        f"tested {outcome.method}, {outcome.candidates_tested:,} vectors",
    ] + outcome.notes
    if outcome.nearest_rejected is not None:
        notes.append(f"the nearest rejected candidate lay at {outcome.nearest_rejected:.3g} of its norm")
    return {
        "layer": outcome.layers[0],
        "layers": outcome.layers,
        "device": device,
        "weights": weights,
        "batch_size": batch_size,
        "positions": target.positions,
        "tokens_per_batch": target.tokens_per_batch,
        "d_in": outcome.d_in,
        "vocabulary": vocabulary,
        "rank": basis.rank,
        "rank_tolerance": basis.tolerance,
        "singular_gap": [basis.last_kept, basis.first_dropped],
        "distance_threshold": dager_span.DISTANCE_THRESHOLD,
        "position_dependent": outcome.position_dependent,
        "candidates_tested": outcome.candidates_tested,
        "true_tokens": len(true_tokens),
        "recovered_tokens": len(found_tokens),
        "token_precision": precision,
        "token_recall": recall,
        "pair_precision": (pair_hits / len(found_pairs) if found_pairs else 0.0)
        if outcome.position_dependent
        else None,
        "pair_recall": (pair_hits / len(outcome.true_pairs) if outcome.true_pairs else 0.0)
        if outcome.position_dependent
        else None,
        "distinct_vectors": distinct,
        "expected_exposed": expected,
        "decoder": outcome.causal,
        "extension": outcome.extension,
        "exact_sequence_rate": (outcome.extension or {}).get("exact_sequence_rate"),
        "static_exposed": target.exposed,
        "confirms": confirms,
        "judgement": judgement,
        "seconds": round(seconds, 3),
        "span_seconds": round(outcome.span_seconds, 3),
        "notes": notes,
    }
