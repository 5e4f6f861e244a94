"""Verdict, policy and model-level caveats from the counted Result."""

from __future__ import annotations

import math

from rankaudit.bound import identifiability, sample_identifiability

# The verdict levels live in levels.py (torch-free, for the CLI); findings is where the rest of the code reads them.
from rankaudit.levels import (  # noqa: F401  (re-exported: the rest of the code reads the levels from findings)
    DEFAULT_FAIL_ON,
    DEFAULT_MAX_RECOVERABLE,
    FAIL_ON_CHOICES,
    FAILING_VERDICTS,
    VERDICT_LEVELS,
    count,
    percent,
    verdict_level,
)
from rankaudit.ops import Role
from rankaudit.result import (
    BiasReadoutFinding,
    Caveat,
    DPBound,
    EmbeddingExposure,
    Identifiability,
    InputInfo,
    LabelLeakage,
    LayerBridge,
    PolicyOutcome,
    Result,
    SpanExposure,
    TokenLeakage,
)
from rankaudit.trace import TracedModel

# Below this estimated hidden share of an image's energy, the visible part is a near-perfect picture of it.
NEAR_PERFECT_HIDDEN = 0.05

# R-GAP's index (spec §4): where its closed-form recursion stops. It no longer gives the verdict.
RA_MEANING = {
    "exposed": "R-GAP's closed form over-determines the input of every layer and reconstructs it layer by layer",
    "boundary": "R-GAP's closed form has exactly as many constraints as unknowns at the critical layer",
    "protected": "R-GAP's closed-form recursion stops at the critical layer (more unknowns than constraints there)",
}
ALL_DENSE_MEANING = "every layer is dense (no weight sharing): R-GAP recovers each layer's input from its own gradient"


def ra_verdict(ra_i: int | None) -> str:
    """Spec §4's reading of RA-i: < 0 exposed, = 0 boundary, > 0 protected; no non-dense layer is exposed."""
    if ra_i is None or ra_i < 0:
        return "exposed"
    return "boundary" if ra_i == 0 else "protected"


def hidden_estimate_sentence(bound: Identifiability) -> str:
    """Spec §11's static estimate of what a deficit hides of a natural image, pointing to the measurement."""
    if bound.certified_deficit <= 0:
        return "nothing of the input is certified hidden"
    hidden = bound.hidden_estimate
    expect = (
        "expect a near-perfect reconstruction"
        if hidden < NEAR_PERFECT_HIDDEN
        else "expect a recognisable reconstruction"
        if bound.verdict == "partial"
        else "expect a degraded reconstruction"
    )
    return (
        f"about {percent(hidden)} of an image's energy can be hidden (estimate: deficit / unknowns; --verify rank "
        f"measures it); {expect}"
    )


def bound_meaning(bound: Identifiability, ra_i: int | None, critical_layer: str | None) -> str:
    """What the verdict means, in one sentence (spec §9, §11)."""
    if bound.verdict == "protected":
        return (
            f"at least {bound.certified_deficit:,} input directions leave every shared gradient unchanged (to "
            f"first order), whatever the attack: at most {percent(bound.recoverable_fraction)} of the input's "
            f"directions can be recovered (ceiling {percent(bound.max_recoverable)}); "
            f"{hidden_estimate_sentence(bound)} (protected is not the same as private: the visible directions "
            "still carry part of the image)"
        )
    if bound.verdict == "partial":
        return (
            f"only {bound.certified_deficit:,} input directions are certified invisible: up to "
            f"{percent(bound.recoverable_fraction)} of the input's directions can still be recovered, above the "
            f"{percent(bound.max_recoverable)} ceiling; {hidden_estimate_sentence(bound)}. This is not "
            "protection: only a reconstruction of the whole input is ruled out"
        )
    if ra_i is not None and ra_i > 0:
        return (
            f"no cut through the graph stops the shared gradient from determining the input; R-GAP's closed "
            f"form stops at {critical_layer}, but optimisation attacks are not stopped"
        )
    return "no cut through the graph stops the shared gradient from determining the input: a server can reconstruct it"


def ra_sentence(result: Result) -> str:
    if result.ra_i is None:
        text = f"RA-i undefined: {ALL_DENSE_MEANING}."
    else:
        text = f"RA-i {result.ra_i} at {result.critical_layer}: {RA_MEANING[ra_verdict(result.ra_i)]}."
    if result.round is not None and result.round.steps > 1:
        text += (
            f" RA-i reads one gradient of one batch of {result.batch_size} (FedSGD): R-GAP has no multi-step "
            "form, so it says nothing about this round's update."
        )
    return text


def round_meaning(bound: Identifiability) -> str:
    """What the round's verdict means, in one sentence (spec §12)."""
    cap = bound.round.explanation
    if not bound.certified_deficit:
        return (
            f"no cap stops the round's update from determining the client's samples ({cap}): a server can "
            "reconstruct them"
        )
    reach = (
        f"at least {bound.certified_deficit:,} of the {bound.unknowns:,} input directions leave the update "
        f"unchanged (to first order), whatever the attack, because {cap}; up to "
        f"{percent(bound.recoverable_fraction)} of them can be recovered"
    )
    if bound.verdict == "partial":
        return (
            reach + f", above the {percent(bound.max_recoverable)} ceiling: this is not protection, only a "
            "reconstruction of every sample in full is ruled out"
        )
    return (
        reach + f" (ceiling {percent(bound.max_recoverable)}); a deficit of the round's inputs as a whole, which "
        "does not prove that each sample keeps a hidden part"
    )


# ---- each sample, not the batch (spec §14) ---------------------------------------------------------------------


def per_sample_view(result: Result) -> bool:
    """Whether the sample level differs from the batch level: anything but FedSGD at batch size 1, where both are
    one sample's gradient and every report reads as before."""
    round_ = result.round
    fedsgd_one = (round_.fedsgd and round_.batch_size == 1) if round_ is not None else result.batch_size == 1
    return not fedsgd_one


def _steps(count: int) -> str:
    return f"{count} local step{'s' if count != 1 else ''}"


def sample_meaning(bound: Identifiability) -> str:
    """What the per-sample verdict means, in one sentence (spec §14)."""
    sample = bound.sample
    steps, one_step = _steps(sample.steps_per_sample), sample.single_sample_bound
    if sample.level == "exposed":
        if one_step >= sample.unknowns:
            why = "one step's gradient can determine one sample (§9 at batch size 1 certifies nothing)"
        else:
            why = (
                f"one step's gradient sees at most {one_step:,} of a sample's {sample.unknowns:,} directions, but "
                f"its {sample.steps_per_sample} steps together can see all of them"
            )
        return (
            f"each sample is read by {steps}; {why}: no count certifies that any part of any one sample stays "
            "hidden, whatever the batch, the round or the aggregation around it"
        )
    deficit = sample.unknowns - sample.rank_bound
    if sample.binding == "update-values":
        cap = f"the update has only {sample.rank_bound:,} values"
    else:
        cap = (
            f"the {steps} that read it carry at most {sample.rank_bound:,} of its directions (R(1) = "
            f"{one_step:,} per step)"
        )
    text = (
        f"at least {deficit:,} of each sample's {sample.unknowns:,} directions leave the update unchanged (to "
        f"first order), whatever the attack and whatever the other samples, because {cap}: at most "
        f"{percent(sample.recoverable_fraction)} of any one sample can be recovered"
    )
    if sample.level == "partial":
        return text + f", above the {percent(bound.max_recoverable)} ceiling: this is not protection"
    return text + f" (ceiling {percent(bound.max_recoverable)})"


def whole_sentence(result: Result) -> str:
    """The batch or round level as what it is (spec §14): a statement about all samples at once."""
    bound = result.identifiability
    round_ = result.round
    if round_ is not None and not round_.fedsgd:
        what, count = "round", round_.clients * round_.samples
    else:
        what, count = "batch", (round_.clients * round_.batch_size if round_ is not None else result.batch_size)
    head = (
        f"The {what} as a whole: rank <= {bound.rank_bound:,} of {bound.unknowns:,} "
        f"({percent(bound.recoverable_fraction)})"
    )
    if bound.certified_deficit > 0:
        return f"{head}: no attack recovers all {count:,} samples at once; this is no guarantee for any one of them."
    return f"{head}: nothing certifies that any part of the {count:,} samples stays hidden."


def _batch_norms(traced: TracedModel) -> list[str]:
    return [
        traced.record(n).name
        for n in traced.order
        if traced.record(n).family == "norm" and "batch" in traced.record(n).op.lower()
    ]


def _model_caveats(
    result: Result, non_injective_ops: list[tuple[str, str | None]], fallback_reason: str | None
) -> list[Caveat]:
    caveats = []
    if non_injective_ops:
        names = [name for name, _ in non_injective_ops]
        shown = ", ".join(names[:3]) + (" ..." if len(names) > 3 else "")
        caveats.append(
            Caveat(
                "RA102",
                names[0],
                "relu",
                f"ReLU-like maps ({shown}) are monotonic but not injective: a zero output removes a "
                "weight constraint, so every count here is an upper bound on what an attacker gets",
                non_injective_ops[0][1],
            )
        )
    if fallback_reason:
        caveats.append(
            Caveat("RA106", result.model_name, "trace", f"traced with torch.export because {fallback_reason}")
        )
    return caveats


def evaluate_policy(
    result: Result, fail_on: str = DEFAULT_FAIL_ON, min_ra: int | None = None, max_recoverable: float | None = None
) -> PolicyOutcome:
    """Exit-code policy: fail on a verdict level `fail_on` names (by default anything short of `protected`), on
    RA-i below `min_ra`, and on the token findings. `max_recoverable` is the ceiling the verdict level was
    computed with (spec §11); it is recorded here, the level already applies it."""
    reasons = []
    bound = result.identifiability
    each = bound is not None and bound.sample is not None and per_sample_view(result)
    carried_by = "structure" if fail_on != "never" else "none"
    if result.verdict in FAILING_VERDICTS[fail_on]:
        carried_by = "none"
        if result.verdict == "partial" and bound is not None:
            fraction = bound.sample.recoverable_fraction if each else bound.recoverable_fraction
            whose = "each sample's" if each else "the input's"
            reasons.append(
                f"verdict is partial{' (each sample)' if each else ''}: up to {percent(fraction)} of "
                f"{whose} directions are recoverable, above the allowed {percent(bound.max_recoverable)} "
                f"(--fail-on {fail_on}; --max-recoverable sets the ceiling, --fail-on exposed keeps the old "
                "gate)"
            )
        elif each:
            reasons.append(
                f"verdict is {result.verdict} (each sample): nothing certifies that any part of one "
                f"sample stays hidden (--fail-on {fail_on})"
            )
        else:
            reasons.append(f"verdict is {result.verdict} (--fail-on {fail_on})")
    if fail_on == "boundary" and ra_verdict(result.ra_i) != "protected":
        # The bound has no boundary case: the strictest level also asks R-GAP's closed form to stop somewhere.
        shown = "undefined (every layer dense)" if result.ra_i is None else str(result.ra_i)
        reasons.append(f"RA-i {shown} <= 0: R-GAP's closed form is not stopped (--fail-on boundary)")
    if min_ra is not None and (result.ra_i is None or result.ra_i < min_ra):
        shown = "undefined (every layer dense)" if result.ra_i is None else str(result.ra_i)
        reasons.append(f"RA-i {shown} is below the required minimum {min_ra} (--min-ra)")
    tokens = result.token_leakage
    if tokens is not None and tokens.exposed and fail_on != "never":
        reasons.append(
            f"the token set is exposed by the gradient of {', '.join(tokens.exposing)} "
            f"(--fail-on {fail_on}; withhold or freeze the embedding to pass)"
        )
    if tokens is not None and tokens.span_exposed and fail_on != "never":
        exposing = [layer for layer in tokens.layers if layer.exposed]
        first = exposing[0]
        reasons.append(
            f"the batch's tokens can be read from the gradient of {', '.join(layer.name for layer in exposing)} by "
            f"a span test (B·n = {first.tokens_per_batch} < d_in = {first.d_in}; DAGER) (--fail-on "
            f"{fail_on}; send at least {tokens.safe_tokens_per_batch} distinct tokens per gradient, e.g. "
            f"batch {tokens.safe_batch_size}, or withhold those layers' gradients to pass)"
        )
    ceiling = bound.max_recoverable if bound is not None else max_recoverable
    return PolicyOutcome(
        fail_on=fail_on,
        min_ra=min_ra,
        passed=not reasons,
        reasons=reasons,
        max_recoverable=ceiling,
        carried_by=carried_by,
    )


def apply_findings(
    result: Result,
    traced: TracedModel,
    *,
    fail_on: str = DEFAULT_FAIL_ON,
    min_ra: int | None = None,
    shared_layers: set[str] | None = None,
    max_recoverable: float | None = None,
) -> Result:
    """Verdict, meaning, model-level caveats, label leakage and the policy outcome, added to `result`.

    The verdict is spec §11's level of the identifiability bound (spec §9) in `result.identifiability`, computed
    here with all gradients shared when the caller did not compute it; RA-i stays R-GAP's index.
    """
    non_injective = [
        (traced.record(n).name, traced.record(n).source)
        for n in traced.order
        if traced.record(n).counting.non_injective
    ]
    if result.identifiability is None:
        result.identifiability = identifiability(traced, result.batch_size, max_recoverable=max_recoverable)
    bound = result.identifiability
    if bound.sample is None:
        from rankaudit.round import Round

        bound.sample = sample_identifiability(
            traced,
            result.round or Round(batch_size=result.batch_size),
            shared_layers=sorted(shared_layers) if shared_layers else None,
            max_recoverable=bound.max_recoverable,
        )
    # Spec §14: the verdict is the sample level; the batch or round level stays as its own sentence.
    result.verdict = bound.sample.level
    if per_sample_view(result):
        result.meaning = sample_meaning(bound)
        norms = _batch_norms(traced)
        if norms:
            result.meaning += (
                f"; {', '.join(norms[:3])}{' ...' if len(norms) > 3 else ''} (BatchNorm) couple the "
                "samples of a batch in training mode: this bound is for the model as simulated, in "
                "eval mode"
            )
        meaning = result.meaning[:1].upper() + result.meaning[1:]
        result.summary = (
            f"Rank bound {bound.sample.rank_bound:,} of {bound.sample.unknowns:,} unknowns per sample: "
            f"{result.verdict} (each sample). {meaning}. {whole_sentence(result)} " + ra_sentence(result)
        )
    else:
        result.meaning = (
            round_meaning(bound)
            if bound.round is not None
            else bound_meaning(bound, result.ra_i, result.critical_layer)
        )
        meaning = result.meaning[:1].upper() + result.meaning[1:]
        result.summary = (
            f"Rank bound {bound.rank_bound:,} of {bound.unknowns:,} unknowns: {result.verdict}. "
            f"{meaning}. " + ra_sentence(result)
        )
    result.bias_readout = bias_readouts(traced, result, shared_layers)
    result.caveats = _model_caveats(result, non_injective, traced.fallback_reason) + result.caveats
    result.label_leakage = label_leakage(traced, result, shared_layers)
    result.policy = evaluate_policy(result, fail_on, min_ra, max_recoverable)
    return result


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


def describe_inputs(result: Result, traced: TracedModel, loaded) -> None:
    """Which inputs forward() got, where their unknowns start, how the model was built and called."""
    infos = []
    for spec in traced.inputs:
        start = traced.input_starts.get(spec.same_as or spec.name)
        record = traced.records.get(start) if start else None
        # An input fed the same ids as another (decoder_input_ids) adds no unknowns of its own.
        unknowns = record.output_numel if record is not None and not spec.same_as else 0
        infos.append(
            InputInfo(
                spec.name,
                tuple(spec.shape),
                str(spec.dtype).removeprefix("torch."),
                spec.role,
                record.name if record is not None else None,
                unknowns,
            )
        )
    result.inputs = infos
    result.build = loaded.build
    result.call_notes = list(traced.call_notes)


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


# --- differential privacy (spec §13): a section beside the structural verdict, and its policy rule -------------

DP_UNITS = {"sample": "DP-SGD", "client": "DP-FedAvg (client level)"}


def dp_sentence(dp: DPBound) -> str:
    """The DP section in one sentence: ε at δ and the bound on any reconstruction at the user's prior."""
    epsilon = "no finite ε" if dp.epsilon is None else f"ε {dp.epsilon:.3g}"
    nothing = " (the noise bounds nothing here)" if dp.reconstruction_bound >= 1.0 else ""
    if dp.noise_by == "server":
        return (
            f"{DP_UNITS[dp.level]} with noise the server adds: {epsilon} at δ {dp.delta:g}; a reconstruction "
            f"from the released model succeeds with probability at most {dp.reconstruction_bound:.3g} when its "
            f"prior baseline is {dp.prior:g}; this bounds what the released model reveals, not what the server "
            "sees" + nothing
        )
    return (
        f"{DP_UNITS[dp.level]}: {epsilon} at δ {dp.delta:g}; any reconstruction succeeds with probability at most "
        f"{dp.reconstruction_bound:.3g} when its prior baseline is {dp.prior:g}{nothing}"
    )


def apply_dp(result: Result, settings) -> Result:
    """The DP bound for `settings` (a round.DPSettings) into result.dp; --max-reconstruction fails the policy when
    B(κ) exceeds it. The structural verdict is left as it is: noise bounds reconstruction, it does not remove the
    structural exposure."""
    from rankaudit.dp import dp_bound

    result.dp = dp_bound(settings)
    result.dp.noise_by = getattr(settings, "noise_by", "client")
    policy = result.policy
    if result.dp.within_limit is False and policy is not None:
        policy.reasons.append(
            f"DP bound: a reconstruction may succeed with probability up to {result.dp.reconstruction_bound:.3g} at "
            f"prior {result.dp.prior:g}, above the allowed {result.dp.max_reconstruction:g} (--max-reconstruction; "
            f"`rankaudit suggest` with the same DP options names the least noise that meets it)"
        )
        policy.passed = False
    elif (
        result.dp.within_limit
        and policy is not None
        and policy.carried_by == "none"
        and result.verdict in FAILING_VERDICTS[policy.fail_on]
    ):
        # Spec §14 + §13: the structure leaves the sample open; the noise may still bound every reconstruction.
        verdict_reason = next((r for r in policy.reasons if r.startswith(f"verdict is {result.verdict}")), None)
        if result.dp.noise_by == "client" and verdict_reason is not None:
            policy.reasons.remove(verdict_reason)
            policy.carried_by = "noise"
            policy.passed = not policy.reasons
        elif verdict_reason is not None:
            policy.reasons[policy.reasons.index(verdict_reason)] = (
                verdict_reason + "; the DP noise is added by the server (--noise-by server): it bounds what the "
                "released model reveals, not what the server sees, so it cannot carry the verdict"
            )
    return result


def carried_by_sentence(result: Result) -> str:
    """Which of the two carries a passing verdict (spec §14: structure or noise), in one sentence; '' otherwise."""
    policy, dp = result.policy, result.dp
    if policy is None or not policy.passed or dp is None:
        return ""
    if policy.carried_by == "structure":
        return (
            f"carried by the structure: each sample is {result.verdict} by the architecture alone, whatever the noise"
        )
    if policy.carried_by != "noise":
        return ""
    return (
        f"carried by the noise, not the structure: the architecture leaves each sample {result.verdict}, and the "
        f"noise the client adds bounds any reconstruction of it to probability {dp.reconstruction_bound:.3g} at "
        f"prior {dp.prior:g}, within --max-reconstruction {dp.max_reconstruction:g}"
    )


# --- the bias readout (spec §14; Qian, Nassar & Hansen, Proposition 1) ------------------------------------------

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
    """Spec §14's static readout finding for every layer of readout_layers: unit k's update row over its bias
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
