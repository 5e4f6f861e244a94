"""What a shared gradient gives away beyond the count: labels (GDBR), tokens (DAGER), a sample (bias readout)."""

from __future__ import annotations

import math

from rankaudit.count.op_counting import Role
from rankaudit.result import (
    BiasReadoutFinding,
    EmbeddingExposure,
    LabelLeakage,
    LayerBridge,
    Result,
    SpanExposure,
    TokenLeakage,
)
from rankaudit.settings.levels import count
from rankaudit.trace.records import TracedModel

# --- the labels: a gradient bridge to the logits (GDBR; iDLG where the layer produces them) ----------------------

# ∇z ⊙ z = ∇a ⊙ a (GDBR Lemma 4) holds for positively homogeneous maps only: ReLU and LeakyReLU.
_BRIDGE_ACTIVATIONS = {"ReLU", "relu", "relu_", "LeakyReLU", "leaky_relu", "leaky_relu_"}
_BRIDGE_SHAPE_FAMILIES = {"reshape"}


def _single_position(traced: TracedModel, node_id: str) -> bool:
    """Weights applied at one position per sample: a Linear on a vector or a conv with a 1x1 output."""
    return traced.record(node_id).counting.dense_candidate


def _input_numel(traced: TracedModel, node_id: str) -> int:
    record = traced.record(node_id)
    return traced.record(record.inputs[0]).output_numel if record.inputs else 0


def _bridge_from(traced: TracedModel, layer_id: str) -> tuple[bool, bool, str | None, str, str]:
    """Walk from a shared layer to the logits; return (bridge, direct, blocked_by, kind, reason)."""
    record = traced.record(layer_id)
    if not _single_position(traced, layer_id):
        return (
            False,
            False,
            record.name,
            "positions",
            f"{record.name} applies its weights at several positions, so "
            "⟨∇W, W⟩ mixes them and ∇a of its output cannot be read off (GDBR Eq. 14/17 need one position)",
        )
    outputs = set(traced.output_ids)
    node, passed_layers = layer_id, 0
    while node not in outputs:
        successors = traced.successors.get(node, [])
        if len(successors) != 1:
            return (
                False,
                False,
                traced.record(node).name,
                "branch",
                f"the output of {traced.record(node).name} branches: the bridge follows a chain only",
            )
        node = successors[0]
        step = traced.record(node)
        role = step.counting.role
        if role is Role.LAYER:
            if not _single_position(traced, node):
                return (
                    False,
                    False,
                    step.name,
                    "shared-weights",
                    f"{step.name} ({step.op}) shares weights over positions: no (W Wᵀ)⁻¹W bridge through it",
                )
            width_in, width_out = _input_numel(traced, node), step.counting.out_features or step.output_numel
            if width_out > width_in:
                return (
                    False,
                    False,
                    step.name,
                    "widens",
                    f"{step.name} widens {width_in} -> {width_out}: W Wᵀ is "
                    "singular, so (W Wᵀ)⁻¹W cannot carry the gradient on",
                )
            passed_layers += 1
        elif role is Role.TRANSPARENT:
            if step.family not in _BRIDGE_SHAPE_FAMILIES and step.op not in _BRIDGE_ACTIVATIONS:
                return (
                    False,
                    False,
                    step.name,
                    "activation",
                    f"{step.name} ({step.op}) lies on the bridge; only ReLU, "
                    "LeakyReLU and reshapes keep ∇z ⊙ z = ∇a ⊙ a",
                )
        else:
            return (False, False, step.name, "branch", f"{step.name} merges two paths: the bridge follows a chain only")
    if passed_layers == 0:
        return (
            True,
            True,
            None,
            "direct",
            f"{record.name} produces the logits: the labels follow from the sign of its "
            "gradient (iDLG), no bridge needed",
        )
    return (
        True,
        False,
        None,
        "bridge",
        f"a gradient bridge through {count(passed_layers, 'full-row-rank layer')} reaches the "
        "logits: the batch's label counts follow from this gradient alone (GDBR)",
    )


def label_leakage(traced: TracedModel, result: Result, shared: set[str] | None) -> LabelLeakage:
    """Per parametric layer: can its gradient alone reveal the labels? `shared` None means every layer's is sent."""
    bridges = []
    for node_id in traced.order:
        record = traced.record(node_id)
        if record.counting.role is not Role.LAYER or not record.counting.weights:
            continue
        bridge, direct, blocked_by, kind, reason = _bridge_from(traced, node_id)
        is_shared = shared is None or record.name in shared
        bridges.append(LayerBridge(record.name, is_shared, bridge, direct, blocked_by, kind, reason))
    risk = "high" if any(b.shared and b.bridge for b in bridges) else "low"
    return LabelLeakage(risk, bridges)


# --- the tokens: the embedding's non-zero rows (FILM) and the span test (DAGER) -----------------------------------


def token_leakage(traced: TracedModel, batch_size: int, shared: set[str] | None) -> TokenLeakage | None:
    """A shared, trainable token embedding's gradient is non-zero exactly in the rows of the tokens the loss
    depends on: the server reads the batch's token set off it (FILM; DAGER's first step). None without tokens."""
    if not traced.token_embeddings:
        return None
    lengths = {spec.name: math.prod(spec.shape) for spec in traced.inputs}
    tokens_per_batch = batch_size * max((lengths.get(e.token_input, 0) for e in traced.token_embeddings), default=0)
    exposures = []
    for embedding in traced.token_embeddings:
        is_shared = shared is None or embedding.name in shared
        exposed = is_shared and embedding.trainable
        shape = f"{embedding.vocab_size} x {embedding.dim}"
        if not embedding.trainable:
            reason = f"{embedding.name} ({shape}) is frozen (requires_grad=False): no gradient is sent for it"
        elif not is_shared:
            reason = f"{embedding.name}'s gradient is withheld: the server never sees it"
        elif embedding.tied_with:
            tied = ", ".join(embedding.tied_with)
            reason = (
                f"{embedding.name} ({shape}) is tied with {tied}: every row of the shared gradient also holds "
                f"{tied}'s softmax-weighted term, yet the rows of the batch's tokens stand out by their norm "
                "(by about two orders of magnitude at random weights); tokens the model predicts with high "
                "probability stand out too"
            )
        else:
            reason = (
                f"the gradient of {embedding.name} ({shape}) is non-zero exactly in the rows of the tokens the "
                f"loss depends on: the server reads the batch's token set (at most {tokens_per_batch} distinct "
                f"of {embedding.vocab_size}) off its non-zero rows"
            )
        record = traced.records.get(embedding.record)
        exposures.append(
            EmbeddingExposure(
                embedding.name,
                embedding.weight,
                embedding.vocab_size,
                embedding.dim,
                is_shared,
                embedding.trainable,
                list(embedding.tied_with),
                exposed,
                reason,
                record.source if record else None,
            )
        )
    layers = span_exposures(traced, batch_size, shared)
    safe_tokens, safe_batch = safe_token_budget(layers)
    return TokenLeakage(
        any(e.exposed for e in exposures),
        tokens_per_batch,
        exposures,
        layers,
        any(layer.exposed for layer in layers),
        safe_tokens,
        safe_batch,
    )


# Ops that act on each token position alone, so a per-token input stays per-token through them. Norms over the
# feature dimension (LayerNorm, RMSNorm) belong here; batch norms (statistics over positions) and attention do not.
_PER_TOKEN_FAMILIES = {
    "input",
    "embedding",
    "reshape",
    "layer_norm",
    "monotonic",
    "relu_family",
    "smooth_activation",
    "monotonic_smooth",
    "add",
    "scale",
    "slice",
    "split",
    "reduction",
    "linear",
    "matmul_param",
}
_SPAN_LAYER_FAMILIES = {"linear", "matmul_param"}
# Reshapes that move axes: they can put the positions where the features were.
_AXIS_MOVES = {"transpose", "permute", "t", "movedim", "swapaxes", "swapdims", "mT", "numpy_T"}


def _positions(record) -> int | None:
    """Token positions per sample if the last dimension is the feature dimension: numel / last dimension."""
    shape = record.output_shape
    if not shape or not shape[-1]:
        return None
    return record.output_numel // shape[-1]


def per_token_tensors(traced: TracedModel) -> dict[str, tuple[int, bool]]:
    """Records whose every position is a function of that position's token (and the position) alone, starting
    at the token embeddings: node id -> (positions per sample, position-dependent).

    Followed through element-wise ops, norms over the features, views that keep the last dimension, sums and
    products of per-token tensors and Linears on the last dimension; anything that can mix positions (attention,
    axis moves, a reduction over positions, a batch norm, an op rankaudit does not model) ends it. Adding a tensor
    that is not traced (a position embedding, a segment embedding) makes the vectors position-dependent."""
    per_token: dict[str, tuple[int, bool]] = {}
    starts = {embedding.record for embedding in traced.token_embeddings}
    for node_id in traced.order:
        record = traced.record(node_id)
        if node_id in starts:
            positions = _positions(record)
            if positions:
                per_token[node_id] = (positions, False)
            continue
        inputs = list(dict.fromkeys(record.inputs))
        if (
            not inputs
            or any(i not in per_token for i in inputs)
            or record.family not in _PER_TOKEN_FAMILIES
            or record.op in _AXIS_MOVES
            or "softm" in record.op.lower()
        ):
            continue
        positions = {per_token[i][0] for i in inputs}
        if len(positions) != 1:
            continue
        count = positions.pop()
        if record.output_shape is not None and _positions(record) != count:
            continue  # the positions were regrouped (heads split off the features, a flatten, a slice of positions)
        added = record.family == "add" and record.counting.role is Role.TRANSPARENT
        per_token[node_id] = (count, added or any(per_token[i][1] for i in inputs))
    return per_token


def span_exposures(traced: TracedModel, batch_size: int, shared: set[str] | None) -> list[SpanExposure]:
    """DAGER's condition (Petrov et al., NeurIPS 2024) on every Linear that reads per-token vectors.

    Layers reading the same vectors (q, k, v; LoRA adapters on each) pool their sent gradients: stacked, their
    rank reaches min(B·n, d_in, Σ d_out), so three rank-8 adapters expose what one alone would not."""
    per_token = per_token_tensors(traced)
    vocabulary = max((embedding.vocab_size for embedding in traced.token_embeddings), default=0)
    found = []
    for node_id in traced.order:
        record = traced.record(node_id)
        if (
            record.family not in _SPAN_LAYER_FAMILIES
            or record.counting.role is not Role.LAYER
            or node_id not in per_token
            or not record.inputs
        ):
            continue
        d_in = traced.record(record.inputs[0]).output_shape[-1]
        d_out = record.output_shape[-1]
        if record.counting.out_features not in (None, d_out):
            continue  # W @ x contracts the positions, not the features
        trainable = any(numel == d_in * d_out for _, numel in record.direct_params)
        is_shared = shared is None or record.name in shared
        reads = traced.record(_through_views(traced, record.inputs[0])).name
        found.append((record, d_in, d_out, trainable, is_shared, reads))
    pooled: dict[str, int] = {}
    for _, _, d_out, trainable, is_shared, reads in found:
        if trainable and is_shared:
            pooled[reads] = pooled.get(reads, 0) + d_out
    layers = []
    for record, d_in, d_out, trainable, is_shared, reads in found:
        positions, position_dependent = per_token[record.id]
        tokens = batch_size * positions
        widths = pooled.get(reads, d_out) if trainable and is_shared else d_out
        exposed = is_shared and trainable and tokens < d_in and tokens <= widths
        what = "the token and its position" if position_dependent else "the token alone"
        candidates = vocabulary * (positions if position_dependent else 1)
        if not trainable:
            reason = f"{record.name}'s weight is frozen (requires_grad=False): no gradient is sent for it"
        elif not is_shared:
            reason = f"{record.name}'s gradient is withheld: the server never sees it"
        elif tokens >= d_in:
            reason = (
                f"B·n = {tokens} >= d_in = {d_in}: the gradient's row space can fill every direction "
                f"{record.name} reads, so a span test accepts every candidate"
            )
        elif tokens > widths:
            reason = (
                f"B·n = {tokens} > {widths}, the output width of the sent layers reading {reads}: their "
                "gradients keep only part of the span of the batch's vectors, so the tokens' vectors are not in "
                "it and the exact span test fails (optimisation attacks may still recover them)"
            )
        else:
            pooling = f" (with the other sent layers reading {reads}: {widths} outputs)" if widths != d_out else ""
            reason = (
                f"{record.name} reads per-token vectors of width d_in = {d_in}, a function of {what}; its "
                f"gradient{pooling} has rank up to B·n = {tokens} < d_in: the token set of the batch can be "
                f"read from this layer's gradient by a span test ({candidates:,} candidate vectors, DAGER)"
            )
        layers.append(
            SpanExposure(
                record.name,
                record.op,
                d_in,
                d_out,
                positions,
                tokens,
                min(tokens, d_in, d_out),
                is_shared,
                trainable,
                position_dependent,
                candidates,
                min(d_in, widths + 1),
                exposed,
                reason,
                record.source,
                reads,
            )
        )
    return layers


def _through_views(traced: TracedModel, node_id: str) -> str:
    """The tensor a view chain starts from: GPT-2's c_attn reads a view of ln_1's output, its LoRA adapter ln_1's."""
    record = traced.record(node_id)
    while (
        record.family == "reshape"
        and len(record.inputs) == 1
        and traced.record(record.inputs[0]).output_numel == record.output_numel
    ):
        record = traced.record(record.inputs[0])
    return record.id


def safe_token_budget(layers: list[SpanExposure]) -> tuple[int | None, int | None]:
    """The smallest B·n at which no shared, trainable layer passes the span test, and the smallest batch size
    that reaches it at this sequence length; (None, None) when no such layer is shared."""
    sent = [layer for layer in layers if layer.shared and layer.trainable]
    if not sent:
        return None, None
    safe = max(layer.safe_from for layer in sent)
    return safe, -(-safe // max(1, max(layer.positions for layer in sent)))


# --- the bias readout (method.md: each sample; Qian, Nassar & Hansen, Proposition 1) ------------------------------------------

_READOUT_FAMILIES = {"linear", "conv", "convolution", "conv_transpose", "matmul_param"}
# Activations whose slope vanishes on a region: a unit silent for every other sample passes no gradient for them.
_EXACT_READOUT = {"relu_family"}
# LeakyReLU's slope never vanishes: the other samples leak in at its negative slope (close, not exact).
_LEAKY = {"LeakyReLU", "leaky_relu", "leaky_relu_"}


def _next_through_views(traced: TracedModel, node_id: str) -> str | None:
    """The one op reading node_id's output, looking through reshapes and dropout; None where it forks."""
    successors = traced.successors.get(node_id, [])
    while len(successors) == 1 and traced.record(successors[0]).family == "reshape":
        successors = traced.successors.get(successors[0], [])
    return successors[0] if len(successors) == 1 else None


def _reads_model_input(traced: TracedModel, node_id: str) -> bool:
    record = traced.record(node_id)
    while record.inputs:
        operand = record.inputs[0]
        if operand in traced.input_ids:
            return True
        record = traced.record(operand)
        if record.family != "reshape":
            return False
    return False


def readout_layers(traced: TracedModel, shared: set[str] | None = None) -> list[tuple[str, str, str, bool]]:
    """(node id, layer name, activation op, exact) of every shared layer applied once per sample (a Linear on a
    vector, a convolution with one output position) with a trainable bias and a ReLU-like activation after it."""
    found = []
    for node_id in traced.order:
        record = traced.record(node_id)
        counting = record.counting
        # The ratio needs both the bias's and the weight's gradient: a frozen weight sends no row to divide.
        if (
            record.family not in _READOUT_FAMILIES
            or counting.role is not Role.LAYER
            or not counting.bias_params
            or counting.weights <= counting.bias_params
            or not counting.out_features
            or record.output_numel != counting.out_features
            or not record.inputs
        ):
            continue
        name = record.name.split("#")[0]
        if shared is not None and name not in shared:
            continue
        after = _next_through_views(traced, node_id)
        if after is None:
            continue
        activation = traced.record(after)
        exact = activation.family in _EXACT_READOUT
        if exact or activation.op in _LEAKY:
            found.append((node_id, name, activation.op, exact))
    return found


def bias_readouts(traced: TracedModel, result: Result, shared: set[str] | None) -> list[BiasReadoutFinding]:
    """The per-sample section's static readout finding for every layer of readout_layers: unit k's update row over its bias
    update, (∂u/∂W_k)/(∂u/∂b_k), is one sample's input to the layer whenever k fires for that sample alone."""
    round_ = result.round
    batch = round_.batch_size if round_ is not None else result.batch_size
    samples = round_.clients * round_.samples if round_ is not None else batch
    found = []
    for node_id, name, activation_op, exact in readout_layers(traced, shared):
        record = traced.record(node_id)
        counting = record.counting
        # the ratio's length: what one unit's weight row reads of a sample (a conv's patch where it is smaller)
        units, width = counting.out_features, (counting.weights - counting.bias_params) // counting.out_features
        reads_input = _reads_model_input(traced, node_id)
        what = "the sample itself" if reads_input else f"its {width:,} features at this layer"
        faces = (
            f"a batch of {batch}"
            if round_ is None or round_.fedsgd
            else f"batches of {batch} over {samples:,} samples in {round_.steps} steps"
        )
        whole = units >= batch
        message = (
            f"{name} ({record.op} with bias, {units:,} units, {activation_op}) reads each sample's "
            f"{width:,}-value input{' (the model input)' if reads_input else ''} directly: a unit that fires "
            f"for one sample alone gives {what} {'exactly' if exact else 'up to its negative slope'} as its "
            f"update row over its bias update (bias readout; Qian et al., Prop. 1); it faces {faces}, and "
            + (
                f"with {units:,} units >= {batch} samples per batch it can read the whole batch"
                if whole
                else f"{units:,} units < {batch} samples per batch: not the whole batch at once, yet one unit "
                "suffices for one sample"
            )
        )
        fix = (
            f"withhold {name}'s bias gradient (freeze the bias or do not send it): without ∂u/∂b no ratio gives "
            "the exact sample, though a unit's weight row still points along it (the sample up to scale), so the "
            "per-sample bound above, not this fix, says what stays hidden; widening the layer only helps the "
            "attacker: more units than samples is what Qian et al. show reading the whole batch needs"
        )
        found.append(
            BiasReadoutFinding(
                name,
                record.op,
                units,
                width,
                reads_input,
                activation_op,
                exact,
                batch,
                samples,
                whole,
                message,
                fix,
                record.source,
            )
        )
    return found
