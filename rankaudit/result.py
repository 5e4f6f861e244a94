"""The Result dataclasses: everything reports read; reports never re-run the analysis."""

from __future__ import annotations

from dataclasses import dataclass, field

from rankaudit.settings.round import Round

# Stable caveat codes, like a linter's rule ids: never renumber, only add.
CAVEAT_CODES = {
    "RA101": ("op-not-modelled", "op not modelled by the rank analysis"),
    "RA102": ("non-injective-activation", "ReLU-like map is not injective: counts are an upper bound"),
    "RA103": ("approximate-merge", "approximate merge rule"),
    "RA104": ("module-called-twice", "module called more than once: its gradient is summed over the calls"),
    "RA105": ("frozen-parameters", "frozen parameters share no gradient"),
    "RA106": ("export-fallback", "traced with torch.export because torch.fx failed"),
}


@dataclass
class LayerRow:
    """One layer's counts at batch size B (method.md: counting): ra_i = inputs - weights - outputs - virtual."""

    name: str
    op: str
    inputs: int  # B·|x|: unknowns
    weights: int  # |W|: gradient constraints, folded shortcut projections included
    outputs: int  # B·|z|: weight constraints
    virtual: int  # V: virtual constraints inherited from earlier layers
    ra_i: int
    dense: bool  # no weight sharing and B <= out_features: always recoverable (method.md: counting)
    critical: bool = False
    block: str | None = None  # the residual block this layer's main path belongs to
    folded: list[str] = field(default_factory=list)  # shortcut projections whose |W| is added here
    own_weights: int = 0  # this layer's own trainable parameters
    reported_params: int = 0  # parameters shown but not counted
    frozen_params: int = 0
    node: str = ""  # the traced graph node
    source: str | None = None  # file:line that calls this layer
    side: bool = False  # reaches the loss only through a gate or a statistic: never critical (method.md: counting)


@dataclass
class Caveat:
    code: str
    node: str
    op: str
    message: str
    source: str | None = None  # file:line of the op in the model's code, when known


@dataclass
class ResidualBlock:
    name: str  # qualified name shared by the block's layers, e.g. layer2.0
    merge: str  # the add node
    fork: str  # the tensor both paths read (x1)
    main_layers: list[str]
    shortcut_layers: list[str]
    kind: str  # identity | projection | approximate
    shortcut_input: str = ""  # the add's operand on the shortcut side (== fork for an identity shortcut)


@dataclass
class LayerBridge:
    """Can the labels be recovered from this layer's gradient alone (GDBR, Theorems 1-2, Eq. 16-19)?"""

    name: str
    shared: bool  # is this layer's gradient sent to the server
    bridge: bool  # a gradient bridge reaches the logits (or this is the logits layer)
    direct: bool  # the logits layer itself: the iDLG sign rule needs no bridge
    blocked_by: str | None  # the first layer or op that stops the bridge
    kind: str  # direct | bridge | positions | shared-weights | widens | activation | branch
    reason: str  # why, in one sentence


@dataclass
class LabelLeakage:
    risk: str  # high: some shared layer's gradient suffices; low: none does
    layers: list[LayerBridge]

    @property
    def leaking(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.shared and layer.bridge]


@dataclass
class ArchitectureNode:
    id: str
    name: str
    op: str
    kind: str  # input | layer | projection | add | cat | output
    block: str | None = None


@dataclass
class Architecture:
    """The layer graph with transparent ops contracted: what a report draws."""

    nodes: list[ArchitectureNode]
    edges: list[tuple[str, str]]


@dataclass
class Identifiability:
    """method.md: the bound: an upper bound on rank(∂g/∂x) from a min cut of the traced graph; the verdict follows it."""

    unknowns: int  # n = B·|x|
    rank_bound: int  # R = max flow: rank(∂g/∂x) <= R for every weight value and every attack
    certified_deficit: int  # max(n - R, 0): input directions no gradient can see, to first order
    recoverable_fraction: float  # R / n, capped at 1
    bottleneck: list[str]  # tensors and gradients on the min cut
    verdict: str  # method.md: verdicts: exposed (R >= n) | partial (R/n > max_recoverable) | protected
    cut_nodes: list[str] = field(default_factory=list)  # traced nodes (layers, merges, input) where the cut lies
    max_recoverable: float = 0.5  # ρ_max: the ceiling on R/n that `protected` asks for (--max-recoverable)
    round: RoundBound | None = None  # the round's terms (method.md: the round), an update of more than one gradient
    sample: SampleBound | None = None  # the bound for each one sample, the level the verdict reads (method.md)
    certified_hidden_energy: float | None = None  # the batch/round line's certified hidden share of energy
    spectrum: str | None = None  # the reference distribution the energy figures use (its name, for the report)
    reference_note: str | None = None  # one line where --data could not serve as the reference (one sample)
    certificate_quantile: float = 0.9  # the share of samples the per-sample certificate speaks for
    exposed_below: float = 0.05  # method.md: energy: `exposed` when the certified hidden share is below this
    protected_rank: int | None = None  # the largest R_s at which the certificate reaches `protected` (energy)
    # Where the per-sample certificate is read off the user's samples (--data): how many, and the confidence of the
    # order statistic as a lower bound on the quantile; None where it comes from a model of the distribution.
    certificate_samples: int | None = None
    certificate_confidence: float | None = None

    @property
    def hidden_estimate(self) -> float:
        """method.md: verdicts: the share of a natural image's energy a generic invisible subspace of this size holds,
        about deficit / n. An estimate: a deficit concentrated in some frequencies moves it either way."""
        return self.certified_deficit / self.unknowns if self.unknowns else 0.0


@dataclass
class SampleBound:
    """method.md: each sample: rank(∂u/∂x_i) <= R_s = min(|x|, |θ_s|, E_i·R(1)) for every sample i of the batch or round.

    In one step the batch gradient is a sum of per-sample gradients, so one sample's Jacobian is the bound's flow at
    batch size 1; a sample reaches the update only through the E_i steps that read it. Batch size, N and the
    clients do not enter: mixing samples certifies nothing for any one of them.
    """

    rank_bound: int  # R_s
    unknowns: int  # |x|: one sample's unknowns
    recoverable_fraction: float  # ρ_s = R_s / |x|
    level: str  # the level (method.md: verdicts) at ρ_s: exposed | partial | protected
    steps_per_sample: int  # E_i: the local steps that read one sample (E; 1 for FedSGD)
    single_sample_bound: int  # R(1): the bound for one step at batch size 1 (all trainable gradients
    # carry on before the last step; only the shared ones in the last)
    binding: str  # which of the three is the minimum: unknowns | update-values | steps
    # What the visible directions show (filled by the energy certificate), for the reference distribution named in
    # Identifiability.spectrum and any weights: the share h that at least Identifiability.certificate_quantile of
    # the samples keep hidden of their deviation from the mean (0 where no reference certifies anything), the
    # expected share (the mean over samples, outside the top R_s principal components), and the PSNR that the
    # visible part of that share of samples stays under. None where no certificate was computed.
    certified_hidden_energy: float | None = None
    visible_psnr_ceiling: float | None = None
    rounds: int = 1  # the server rounds whose updates the bound sums over (1: one round, the rest not counted)
    # method.md: the round: one server round's term min(|θ_s|, E_i·R(1)) (each further round can add this much); whether the
    # server rounds were stated (not known: the bound covers one round); the ops whose batch statistics the flow
    # network couples the samples through (BatchNorm in training mode; none in eval mode or without BatchNorm).
    round_bound: int = 0
    rounds_known: bool = False
    batch_statistics: list[str] = field(default_factory=list)
    covers: str = ""  # what this bound covers, in sentences: the server rounds, the BatchNorm mode (report text)
    expected_hidden_energy: float | None = None  # the mean hidden share (see certified_hidden_energy above)
    # The running statistics (state-dict keys) counted as sent: a BatchNorm in training mode moves them by each
    # batch's mean and variance of its input, and a client sending its state_dict sends them.
    running_statistics: list[str] = field(default_factory=list)


@dataclass
class StepBound:
    """One kind of local step in a round: the bound for one step at this batch size, and how many steps of a
    client's round are of this kind."""

    batch_size: int
    steps: int  # steps per client of this kind
    rank_bound: int  # R(B_k), at most B_k·|x|
    every_gradient: bool  # a step before the last: all trainable gradients carry on (later steps read the weights)
    bottleneck: list[str] = field(default_factory=list)  # the step's min cut


@dataclass
class RoundBound:
    """method.md: the round: R_round <= min(n, |θ_s|, Σ_c Σ_k R(B_k)), and which of the three binds."""

    unknowns: int  # n = C·N·|x|
    update_values: int  # |θ_s|: the values of the (aggregated) update the server sees
    steps_bound: int  # Σ_c Σ_k R(B_k)
    terms: list[StepBound]
    binding: str  # unknowns (no deficit) | update-values | steps
    explanation: str  # the cap that binds, in one sentence


@dataclass
class InputInfo:
    """One tensor fed to forward() and where its unknowns start (none for masks and position ids)."""

    name: str
    shape: tuple[int, ...]  # per sample
    dtype: str  # int64, float32
    role: str  # data | tokens | mask | ids
    unknowns_at: str | None = None  # the record where its unknowns start: itself, or its token embedding
    unknowns: int = 0  # per sample, at that record (B·n·d for a token embedding at batch B: ×B)


@dataclass
class EmbeddingExposure:
    """Does this token embedding's shared gradient reveal which tokens the batch holds?"""

    name: str  # module: transformer.wte
    weight: str  # its table: transformer.wte.weight
    vocab_size: int
    dim: int
    shared: bool  # its gradient is sent (not withheld)
    trainable: bool  # requires_grad: frozen tables (LoRA) send nothing
    tied_with: list[str]  # other ops reading the same table (a tied output layer)
    exposed: bool
    reason: str
    source: str | None = None  # file:line of the lookup


@dataclass
class SpanExposure:
    """DAGER's condition on one Linear applied over token positions whose input is a per-token function of the
    token (and its position): ∇W = Σ_t δ_t x_tᵀ has rank at most B·n, and when B·n < d_in (and B·n <= d_out, so
    that the δ_t are independent) its row space is exactly span{x_t}: each candidate token's vector can be tested
    for membership."""

    name: str  # the layer: transformer.h.0.attn.c_attn, ...lora_A.default
    op: str  # Linear, Conv1D
    d_in: int  # the width of the per-token vectors it reads
    d_out: int
    positions: int  # n: token positions per sequence it reads
    tokens_per_batch: int  # B·n: the vectors summed into its gradient
    rank_bound: int  # min(B·n, d_in, d_out)
    shared: bool  # its gradient is sent (not withheld)
    trainable: bool  # its weight has requires_grad (LoRA's base weights do not)
    position_dependent: bool  # a position embedding (or another added tensor) enters before it
    candidates: int  # vectors a span test checks: vocabulary, times positions if position-dependent
    # The fewest distinct vectors at which the span test fails: min(d_in, pooled d_out + 1). Repeated vectors
    # count once (a token repeated anywhere, for position-free vectors; at the same position otherwise).
    safe_from: int
    exposed: bool
    reason: str
    source: str | None = None  # file:line of the call
    reads: str = ""  # the traced tensor it reads (views looked through): q, k and v share one


@dataclass
class TokenLeakage:
    """The embedding table's gradient is non-zero in the rows of the tokens used: the batch's token set.

    `exposed` is the embedding table's finding; `span_exposed` DAGER's span test on the layers in `layers`.
    """

    exposed: bool
    tokens_per_batch: int  # B·n: the most distinct tokens one batch can mark
    embeddings: list[EmbeddingExposure]
    layers: list[SpanExposure] = field(default_factory=list)  # Linears reading per-token vectors
    span_exposed: bool = False  # some shared layer's gradient passes DAGER's span test
    # The smallest B·n at which no shared layer passes the span test (None: no such layer is shared), and the
    # smallest batch size reaching it at this sequence length. Necessary, not sufficient: the test fails only if
    # the batch holds that many distinct vectors, and real text repeats tokens.
    safe_tokens_per_batch: int | None = None
    safe_batch_size: int | None = None

    @property
    def exposing(self) -> list[str]:
        return [embedding.name for embedding in self.embeddings if embedding.exposed]

    @property
    def span_exposing(self) -> list[str]:
        return [layer.name for layer in self.layers if layer.exposed]


@dataclass
class PolicyOutcome:
    fail_on: str
    min_ra: int | None
    passed: bool
    reasons: list[str]
    max_recoverable: float | None = None
    # method.md: each sample / method.md: DP: what carries the per-sample verdict through the gate. structure: the sample level passes
    # on its own; noise: it does not, but the client's DP noise bounds every reconstruction within
    # --max-reconstruction; none: neither (the policy fails on the verdict, or --fail-on never asks nothing).
    carried_by: str = "structure"


@dataclass
class DPBound:
    """method.md: DP: what the DP noise bounds. ε at δ, and B(κ) = inf_ε (e^ε κ + δ(ε)): the most any reconstruction
    attack whose success without the update is κ can succeed with it."""

    level: str  # sample (DP-SGD) | client (user-level DP-FedAvg)
    noise_multiplier: float  # σ: noise standard deviation over the clip norm
    clip: float  # c
    sample_rate: float  # q: Poisson sampling rate of the unit (a sample, or a client)
    steps: int  # T: steps (rounds, at the client level) a unit can take part in
    delta: float
    epsilon: float | None  # ε at δ; None when no finite ε reaches δ
    prior: float  # κ the user asked about
    reconstruction_bound: float  # B(κ) at the user's prior
    bounds: dict[str, float]  # B(κ) at κ = 0.1, 0.01, 0.001, keyed by κ as written
    accountant: str  # the library and its discretisation
    seconds: float = 0.0
    max_reconstruction: float | None = None  # the policy's ceiling on B(κ); None: no rule
    curve: list[tuple[float, float]] = field(default_factory=list)  # (κ, B(κ)) for the HTML card
    # Who adds the noise (round.NOISE_BY): only client noise bounds what the server sees; server noise bounds
    # what the released model reveals.
    noise_by: str = "client"
    sample_rate_source: str = ""  # where q came from: "round: B/N = 32/4000", "--dp-sample-rate"
    steps_source: str = ""  # where T came from
    notes: list[str] = field(default_factory=list)  # a given q or T that disagrees with the round, in one line

    @property
    def within_limit(self) -> bool | None:
        """None without a ceiling; otherwise whether B(κ) <= the ceiling."""
        if self.max_reconstruction is None:
            return None
        return self.reconstruction_bound <= self.max_reconstruction


@dataclass
class DPNoiseSuggestion:
    """`suggest` with DP options: the least noise multiplier whose B(κ) meets --max-reconstruction at q and T."""

    target: float | None  # the ceiling on B(κ); None: only a target ε was asked for
    prior: float
    sample_rate: float
    steps: int
    delta: float
    level: str
    accountant: str
    noise_multiplier: float | None  # the least σ found (bisection on log σ); None: none up to the ceiling
    epsilon: float | None  # ε at δ of that σ (None: infinite, or no σ found)
    bound: float | None  # B(κ) at that σ
    at_floor: bool  # the search floor already meets the target: less noise may too
    search: str  # the interval and tolerance searched, in words
    seconds: float = 0.0
    sample_rate_source: str = ""  # where q came from (the round, or a flag): as DPBound's
    steps_source: str = ""
    notes: list[str] = field(default_factory=list)
    clip: float = 1.0  # the clip norm C the noise multiplies (Opacus's max_grad_norm)
    # --target-epsilon: the least σ whose ε at δ is at most it (None: none up to the search's ceiling), the B(κ)
    # that σ gives, and whether the search's floor already meets it
    target_epsilon: float | None = None
    epsilon_noise: float | None = None
    epsilon_noise_bound: float | None = None
    epsilon_at_floor: bool = False


@dataclass
class DeploymentRead:
    """Where each setting of an audited app came from (rankaudit.deploy.app), for the reports."""

    kind: str  # flower | nvflare
    root: str  # the app's directory
    settings: list[tuple[str, str, str]]  # (setting, value, source), e.g. ("batch-size", "32", "[tool...]")
    notes: list[str] = field(default_factory=list)


@dataclass
class BiasReadoutFinding:
    """method.md: each sample, static: a shared layer whose unit k's update row over its bias update is one sample's input to
    the layer whenever that unit fires for that sample alone (Qian, Nassar & Hansen, Proposition 1)."""

    name: str  # the layer: fc1
    op: str  # Linear | Conv2d ...
    units: int  # its output units, each one chance to read a sample out
    width: int  # the per-sample vector each unit reads (the ratio's length)
    reads_input: bool  # the first layer: the ratio is the sample itself; else its features
    activation: str  # the ReLU-like op after it: relu, ReLU6, LeakyReLU ...
    exact: bool  # the activation's slope vanishes (ReLU family): an exact readout
    batch_size: int  # the samples one step's gradient mixes (the batch it faces)
    samples: int  # the samples the whole update mixes (C·N for a round)
    whole_batch: bool  # units >= batch size: Qian et al.'s condition to read every sample
    message: str
    fix: str
    source: str | None = None  # file:line of the call


@dataclass
class BiasReadoutLayer:
    """--verify bias on one layer: which units' ratio u_W[k] / u_b[k] is a sample's input to it, exactly."""

    name: str
    op: str  # Linear | Conv2d | ...
    units: int
    live_units: int  # units whose bias update is not ~0 (the others are skipped)
    reads_input: bool  # the layer reads the model's input itself: a ratio is the image
    units_read: list[dict]  # {unit, sample, relative_error, step (None for the input), fired_for}
    samples_read: list[int]
    units_firing_for_one_sample: int  # ground truth: units that passed a gradient for exactly one sample


@dataclass
class BiasReadoutSample:
    """One sample of the verifier's batch (or round, numbered client·N + i): read out or not, and how close."""

    index: int
    read_exactly: bool
    layer: str | None  # the layer and unit of the best exact readout
    unit: int | None
    relative_error: float | None
    psnr: float | None  # nearest first-layer ratio against the image, dB; None: identical or unmeasured
    psnr_measured: bool  # a layer reading the input exists (psnr None then means infinite)


@dataclass
class BiasReadout:
    """--verify bias (method.md: each sample): the samples the update hands over exactly through a layer's bias."""

    samples: int
    samples_read: list[int]
    layers: list[BiasReadoutLayer]
    per_sample: list[BiasReadoutSample]
    skipped: list[str]  # readout layers that read several vectors per sample or run twice
    seconds: float
    device: str
    threshold: float  # relative error below which a match is exact
    notes: list[str] = field(default_factory=list)
    setup_seconds: float = 0.0  # torch.func's one-time imports, apart from the readout's `seconds`


@dataclass
class GuardReadout:
    """One readout the client-side guard found in the update it was about to send, at or above its PSNR threshold."""

    layer: str
    units: list[int]  # the unit (weight-row update over bias update) or the two units (i, j) combined
    kind: str  # "ratio" (Qian et al.) | "pair": (row_i − scale·row_j) / (b_i − scale·b_j), an imprint's readout |
    # "row": a layer without a bias, unit i's row update at its best scale and offset | "row-pair": such a layer's
    # row_i − scale·row_j at its best scale and offset
    sample: int  # index into the client's batch
    relative_error: float  # ‖readout − sample's vector‖ / ‖sample's vector‖
    reads_input: bool  # the layer reads the model's input: the readout is the sample itself, else its features
    psnr: float = 0.0  # dB, the readout against the vector the layer reads from the sample (peak: its range)
    sample_psnr: float | None = None  # dB, what the readout shows of the sample itself: psnr for the input; for
    # features, the PSNR of the part of the sample they determine at these weights
    leaks: bool = True  # sample_psnr is at or above the threshold: the sample itself is read
    scale: float | None = None  # a pair's scale
    received_share: float | None = None  # the multiple of the received weights added back to the update before
    # the readout (what weight decay took out, fitted from the update); None: the update as sent
    bias_rate: float | None = None  # the weights' learning rate over the biases' that the update shows, the biases'
    # update scaled by it before the readout; None: the same rate
    undone: str | None = None  # the optimiser's step taken back out of the update before the readout, in words
    scale_open: bool = False  # the bias update is within its float rounding of zero, or not a number: the row is
    # read at the scale that shows the sample best


@dataclass
class GuardDecision:
    """The guard's decision on one update (one round on one client): send it, block it, or send it with the
    offending rows dropped or noised."""

    action: str  # send | block | drop | noise
    exact_samples: list[int]  # indices into the batch that the update, as computed, shows at min_psnr or above
    reasons: list[str]  # why it did not send as is (empty when it sends)
    readouts: list[GuardReadout]
    layers_checked: list[str]  # the layers with a bias whose readouts were compared
    skipped: list[str]  # layers with a bias it could not check, and why
    architecture: str | None  # None when the received weights match the audited model, else what differs
    seconds: float
    samples: int  # the batch's size
    min_psnr: float  # a readout at or above this PSNR (dB) against a sample reads it
    energy: dict | None = None  # the measured visible-energy check: worst sample, its hidden share, threshold
    changed: list[str] = field(default_factory=list)  # parameters the drop or noise action altered
    round: int | None = None  # the server round, where the framework names it
    notes: list[str] = field(default_factory=list)
    feature_samples: list[int] = field(default_factory=list)  # samples whose features are read, the sample not
    psnr: dict[int, float] = field(default_factory=dict)  # each read sample: its best readout's PSNR, dB (the
    # sample's own for exact_samples; for feature_samples, what their features determine of them)


@dataclass
class GuardRun:
    """One `rankaudit guard` run: the decision, and what it was decided on."""

    model: str
    weights: str
    data: str
    round: Round
    loss: str
    decision: GuardDecision
    seconds: float  # the whole command: loading, local training and the guard
    training_seconds: float  # the local training alone


@dataclass
class Result:
    model: str  # as the user named it: path or path:name
    model_name: str  # the class, factory or instance
    input_shape: tuple[int, ...]
    batch_size: int
    tracer: str
    parameters: int
    layers: list[LayerRow]
    blocks: list[ResidualBlock]
    caveats: list[Caveat]
    ra_i: int | None  # None when every layer is dense
    critical_layer: str | None
    verdict: str = ""
    meaning: str = ""
    summary: str = ""  # one sentence: RA-i, critical layer, verdict and meaning
    policy: PolicyOutcome | None = None
    label_leakage: LabelLeakage | None = None
    identifiability: Identifiability | None = None
    architecture: Architecture | None = None
    # Filled by the verifier: {"rgap": {...}, "gdbr": {...}} in the JSON shapes the README documents.
    verification: dict = field(default_factory=dict)
    seconds: float = 0.0
    inputs: list[InputInfo] = field(default_factory=list)  # every input fed to forward(), masks included
    token_leakage: TokenLeakage | None = None  # None: the model reads no token ids
    build: str = ""  # how the model was built: meta-parameters | meta (see model/meta_device.py)
    call_notes: list[str] = field(default_factory=list)  # keyword arguments forward() was called with
    stand_ins: list[str] = field(default_factory=list)  # missing modules the model file imported, stood in for
    # PNG pictures a verifier made for the HTML report ("rank/visible_0" -> bytes); never in the JSON, whose
    # numbers describe them.
    images: dict[str, bytes] = field(default_factory=dict)
    dp: DPBound | None = None  # what DP noise bounds (method.md: DP); None without DP options
    round: Round | None = None  # the federated round judged (method.md: the round); None: FedSGD at batch_size
    bias_readout: list[BiasReadoutFinding] = field(default_factory=list)  # the static readout finding (method.md)
    deployment: DeploymentRead | None = None  # `rankaudit DIR`: what was read from the app, and from where
    # The keyword arguments the model was built with (--model-arg, model-args): the verifiers build it with them too.
    model_args: dict = field(default_factory=dict)
    # The options given on the command line that decide how the model was read (--input-shape, --model-arg, --data,
    # the limits, an app's round flags ...), as (flag, value) pairs, value None for a switch: the next step's
    # command gives them again, so that it runs as pasted.
    reading_flags: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def critical_row(self) -> LayerRow | None:
        return next((row for row in self.layers if row.critical), None)
