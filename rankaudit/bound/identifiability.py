"""method.md: the bound: flow network over the traced graph, max flow / min cut -> an upper bound on rank(∂g/∂x)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from rankaudit.bound.statistics import batch_statistics, running_statistics
from rankaudit.count import ops
from rankaudit.count.op_counting import Role
from rankaudit.result import Identifiability, RoundBound, SampleBound, StepBound
from rankaudit.settings.levels import ceiling as level_ceiling
from rankaudit.settings.levels import verdict_level
from rankaudit.settings.round import Round
from rankaudit.trace.records import NodeRecord, TracedModel

SOURCE, SINK = "source", "sink"
# Sums and concatenations pass δ through unchanged: a parameter they add receives δ(out) only, and their
# operands' δ do not depend on each other.
_ADDITIVE_FAMILIES = ("add", "cat", "stack")


@dataclass(frozen=True)
class GradientSource:
    """One shared gradient the server receives: a layer's weights, or a parameter another op uses directly."""

    name: str  # the layer (conv1) or the qualified parameter name (cls_token, norm.weight)
    numel: int
    owner: str  # the record name of the op that reads it
    owner_is_layer: bool
    # The qualified names of the parameters it is the gradient of: one vertex per distinct set, so a parameter
    # read by several calls (tied weights, a module called twice) is one gradient. Empty: the name is the key.
    parameters: tuple[str, ...] = ()
    statistic: bool = False  # a running statistic sent with the update (bn1.running_mean), not a gradient

    @property
    def vertex(self) -> str:
        return "g:" + ("+".join(self.parameters) if self.parameters else self.name)


def gradient_sources(record: NodeRecord) -> list[GradientSource]:
    """The shared gradients of the trainable parameters that reach this traced op, each with its full size, whether
    the op reads them bare or through untraced ops on parameters alone (self.w * mask, self.w.t(), A @ B), and
    whatever the op is (a registered layer, a norm, a module the registry does not know).

    A layer whose parameters are all its own (conv1.weight, conv1.bias) is one vertex named after it (one per
    module, however often it is called: the gradient is summed over the calls); every other parameter is a vertex
    of its own named after it (class token, norm scale, a hand-written weight, a tied embedding table)."""
    trainable = sorted((name, numel) for name, numel in record.direct_params if numel)
    if not trainable:
        return []
    layer = record.name.split("#")[0]
    if record.counting.role is Role.LAYER and all(name.startswith(layer + ".") for name, _ in trainable):
        names = tuple(name for name, _ in trainable)
        return [GradientSource(layer, sum(numel for _, numel in trainable), layer, True, names)]
    return [GradientSource(name, numel, record.name, False, (name,)) for name, numel in trainable]


def shared_predicate(
    shared_layers: list[str] | None, withheld_layers: list[str] | None
) -> Callable[[GradientSource], bool]:
    """Which gradients are sent: all by default; with --shared-layers only those layers'; with
    --withheld-layers everything else, directly used parameters (class token, norms) included.

    A name is a layer, a module above parameters (`bn1`, `head`) or one parameter (`fc1.bias`): it covers every
    parameter under it. One gradient vertex is withheld only when every parameter it sums is covered, and sent
    under --shared-layers when any is: a layer whose weight stays local but whose bias is sent still shows its
    gradient, so the bound never counts less than the server reads."""
    if shared_layers:
        names = set(shared_layers)
        return lambda source: source.name in names or any(covers(p, names) for p in _parameters_of(source))
    if withheld_layers:
        names = set(withheld_layers)
        return lambda source: source.name not in names and not all(covers(p, names) for p in _parameters_of(source))
    return lambda source: True


def _parameters_of(source: GradientSource) -> tuple[str, ...]:
    return source.parameters or (source.name,)


def covers(parameter: str, names: set[str] | list[str]) -> bool:
    """Whether a name stands for this parameter: the parameter itself or a module it sits under."""
    return parameter in names or any(parameter.startswith(name + ".") for name in names)


class FlowNetwork:
    """The flow network (method.md: the bound) of one traced model at batch size B; vertex capacities by splitting (v_in -> v_out)."""

    def __init__(
        self,
        traced: TracedModel,
        batch_size: int,
        is_shared: Callable[[GradientSource], bool],
        bn_mode: str = "train",
    ):
        self.traced = traced
        self.batch_size = batch_size
        self.bn_mode = bn_mode  # in training mode a BatchNorm's running statistics move with each batch
        self.edges: dict[tuple[str, str], int | None] = {}  # (tail, head) -> capacity; None: unbounded
        self.labels: dict[tuple[str, str], str] = {}  # split edge -> what the report calls it
        self.owners: dict[tuple[str, str], str] = {}  # split edge -> the traced node it belongs to
        self.gradients: set[str] = set()  # gradient vertices created so far
        self._build(is_shared)

    # Vertex names: "t:<id>" forward tensor, "d:<id>" its backward twin δ, "g:<param>" a shared gradient.
    def _split(self, vertex: str, capacity: int, label: str, owner: str):
        self.edges[(vertex + ":in", vertex + ":out")] = capacity
        self.labels[(vertex + ":in", vertex + ":out")] = label
        self.owners[(vertex + ":in", vertex + ":out")] = owner

    def _edge(self, tail: str, head: str):
        self.edges.setdefault((tail + ":out", head + ":in"), None)

    def _build(self, is_shared):
        traced, B = self.traced, self.batch_size
        for node_id in traced.order:
            record = traced.record(node_id)
            size = B * record.output_numel
            shown = record.name if node_id in traced.input_ids else record.shown_name
            self._split(f"t:{node_id}", size, shown, node_id)
            self._split(f"d:{node_id}", size, f"δ{shown}", node_id)
        sources = set(traced.input_ids)
        for input_id in traced.input_ids:
            self.edges[(SOURCE, f"t:{input_id}:in")] = None
        for embedding in traced.token_embeddings:
            # A shared embedding table's gradient is δ of its output, scattered into the rows of the tokens used.
            table = GradientSource(embedding.weight, embedding.vocab_size * embedding.dim, embedding.name, False)
            if embedding.trainable and is_shared(table):
                self._gradient(table, embedding.record)
                self._edge(f"d:{embedding.record}", f"g:{table.name}")
        for node_id in traced.order:
            if node_id in sources:
                continue
            record = traced.record(node_id)
            inputs = list(dict.fromkeys(record.inputs))
            for operand in inputs:
                self._edge(f"t:{operand}", f"t:{node_id}")  # forward data
                self._edge(f"d:{node_id}", f"d:{operand}")  # backward: δ(out) -> δ(in)
            family = ops.FAMILIES.get(record.family, ops.UNMODELLED)
            additive = record.family in _ADDITIVE_FAMILIES
            # A tensor read twice by a product (s * s) is a square: δ(s) is scaled by s itself.
            repeated = [] if additive else [operand for operand in inputs if record.inputs.count(operand) > 1]
            for operand in inputs if family.input_dependent_jacobian else repeated:
                self._edge(f"t:{operand}", f"d:{operand}")
            if len(inputs) >= 2 and not additive:
                # A product of data tensors: δ of each operand is scaled by the others.
                for operand in inputs:
                    for other in inputs:
                        if other != operand:
                            self._edge(f"t:{other}", f"d:{operand}")
            for source in gradient_sources(record):
                if not is_shared(source):
                    continue
                vertex = self._gradient(source, node_id)
                self._edge(f"d:{node_id}", vertex)
                if not additive:
                    # A parameter that multiplies data (a weight, a scale) meets every data operand of the op.
                    for operand in inputs:
                        self._edge(f"t:{operand}", vertex)
        for output_id in traced.output_ids:
            self._edge(f"t:{output_id}", f"d:{output_id}")  # the loss: δ(logits) depends on the logits
        self.running_statistics: list[str] = []  # the buffer keys sent beside the gradients
        for node_id, key, channels in running_statistics(traced, self.bn_mode):
            # A running statistic the client sends (a state_dict, not only parameters()) is C values of the batch's
            # mean or variance of the norm's input: read by the server as a gradient is, whatever the batch size.
            statistic = GradientSource(key, channels, traced.record(node_id).name, False, (key,), statistic=True)
            if not is_shared(statistic):
                continue
            vertex = self._gradient(statistic, node_id)
            self.running_statistics += [key] if key not in self.running_statistics else []
            for operand in dict.fromkeys(traced.record(node_id).inputs):
                self._edge(f"t:{operand}", vertex)

    def add_rest_of_batch(self, is_shared: Callable[[GradientSource], bool], rest: int, statistics: list[str]):
        """method.md: the round: the other `rest` = B-1 samples of sample i's batch, coupled to it by batch statistics.

        Built on a network at batch size 1 (sample i): a second copy of every tensor and its δ at capacity
        rest·numel ("r|" vertices) stands for the rest of the batch, held fixed (the source does not reach it), and
        shares the gradient vertices (the batch gradient sums over the samples). Every op in `statistics`
        normalises with the batch's mean and variance: a vertex of 2·C values that sample i's and the rest's inputs
        reach, and that reaches both copies' outputs and δ of the inputs (the normalisation's Jacobian reads the
        statistics) and its affine parameters' gradients (they read the normalised input). Its backward reads the
        batch's mean of δ(out) and of δ(out)·x̂ (2·C more values), which carries sample i's δ into the rest's. Every
        other op works on each sample alone, so these are the only paths between the copies: a cut of this
        network bounds rank(∂g/∂x_i) with the rest of the batch fixed.
        """
        others = FlowNetwork(self.traced, rest, is_shared, self.bn_mode)

        def renamed(vertex: str) -> str:
            return vertex if vertex in (SOURCE, SINK) or vertex.startswith("g:") else "r|" + vertex

        for (tail, head), capacity in others.edges.items():
            if tail == SOURCE:
                continue  # the rest of the batch is not sample i: x_i reaches it only through the statistics
            edge = (renamed(tail), renamed(head))
            self.edges.setdefault(edge, capacity)
            if (tail, head) in others.labels and edge not in self.labels:
                self.labels[edge] = f"{others.labels[(tail, head)]} (rest of the batch)"
                self.owners[edge] = others.owners[(tail, head)]
        self.gradients |= others.gradients
        for node_id in statistics:
            record = self.traced.record(node_id)
            shape = record.output_shape
            # Traced at batch size 1: (1, C, ...). Another library's normalisation may keep a statistic per value
            # (a mean over the batch alone), and a shape not known says nothing: every value counts.
            known = record.family == "norm" and shape and len(shape) >= 2
            channels = shape[1] if known else record.output_numel
            forward, backward = f"s:{node_id}", f"sδ:{node_id}"
            self._split(forward, 2 * channels, f"batch statistics of {record.name}", node_id)
            self._split(backward, 2 * channels, f"batch statistics of δ{record.name}", node_id)
            self._edge(forward, backward)
            for copy in ("", "r|"):
                for operand in dict.fromkeys(record.inputs):
                    self._edge(f"{copy}t:{operand}", forward)
                    self._edge(f"{copy}t:{operand}", backward)
                    self._edge(forward, f"{copy}d:{operand}")
                    self._edge(backward, f"{copy}d:{operand}")
                self._edge(forward, f"{copy}t:{node_id}")
                self._edge(f"{copy}d:{node_id}", backward)
            for source in gradient_sources(record):
                if f"g:{source.name}" in self.gradients and is_shared(source):
                    self._edge(forward, f"g:{source.name}")

    def _gradient(self, source: GradientSource, node_id: str) -> str:
        """The vertex of one shared gradient, created on first use (a tied parameter is one gradient)."""
        vertex = source.vertex
        if vertex not in self.gradients:
            self.gradients.add(vertex)
            self._split(vertex, source.numel, source.name if source.statistic else f"∇{source.name}", node_id)
            self.edges[(vertex + ":out", SINK)] = None
        return vertex

    def gradient_values(self) -> int:
        """|θ_s|: the entries of every shared gradient (each tied parameter once)."""
        return sum(self.edges[(vertex + ":in", vertex + ":out")] for vertex in self.gradients)

    def to_networkx(self):
        """The same network as a networkx DiGraph (an edge without `capacity` is unbounded there)."""
        import networkx as nx

        graph = nx.DiGraph()
        for (tail, head), capacity in self.edges.items():
            graph.add_edge(tail, head, **({} if capacity is None else {"capacity": capacity}))
        return graph

    def min_cut(self) -> tuple[int, list[str], list[str]]:
        """Max flow from the input to the gradients; the tensors and gradients on one minimum cut, and the traced
        nodes they belong to (a reshape's output is reported at the layer or merge that produced it)."""
        if not self.gradients:
            return 0, [], []
        value, reachable = max_flow(self.edges, SOURCE, SINK)
        cut = [edge for edge in self.labels if edge[0] in reachable and edge[1] not in reachable]
        nodes = dict.fromkeys(self._visible(self.owners[edge]) for edge in cut)
        return value, [self.labels[edge] for edge in cut], list(nodes)

    def _visible(self, node_id: str) -> str:
        """The nearest node at or above node_id that a report draws: the input, a layer or a merge."""
        record = self.traced.record(node_id)
        while (
            node_id not in self.traced.input_ids
            and record.counting.role not in (Role.LAYER, Role.ADD, Role.CAT)
            and record.inputs
        ):
            node_id = record.inputs[0]
            record = self.traced.record(node_id)
        return node_id


def max_flow(edges: dict[tuple[str, str], int | None], source: str, sink: str) -> tuple[int, set[str]]:
    """Dinic's algorithm: the max flow value and the source side of the minimum cut nearest the sink (every vertex
    that cannot reach `sink` in the final residual graph): where the gradients themselves are the bottleneck,
    that cut names them. `edges` maps (tail, head) to a capacity, None for unbounded.

    networkx's maximum_flow gives the same values (the tests compare them on every example and on random nets);
    this one runs without importing networkx, whose import alone is a tenth of a whole analysis of ResNet-50.
    """
    index: dict[str, int] = {}
    for tail, head in edges:
        index.setdefault(tail, len(index))
        index.setdefault(head, len(index))
    if source not in index or sink not in index:
        return 0, {source}
    unbounded = sum(c for c in edges.values() if c is not None) + 1
    heads: list[int] = []
    capacity: list[int] = []
    adjacency: list[list[int]] = [[] for _ in index]
    for (tail, head), cap in edges.items():
        u, v = index[tail], index[head]
        adjacency[u].append(len(heads))
        heads.append(v)
        capacity.append(unbounded if cap is None else cap)
        adjacency[v].append(len(heads))  # its residual twin: edge e ^ 1
        heads.append(u)
        capacity.append(0)
    s, t = index[source], index[sink]
    total = 0
    while True:
        level = _levels(adjacency, heads, capacity, s)
        if level[t] < 0:
            break
        total += _blocking_flow(adjacency, heads, capacity, level, s, t)
    reaches_sink = {t}
    frontier = [t]
    while frontier:
        v = frontier.pop()
        for e in adjacency[v]:
            u = heads[e]  # e ^ 1 runs u -> v
            if capacity[e ^ 1] > 0 and u not in reaches_sink:
                reaches_sink.add(u)
                frontier.append(u)
    return total, {name for name, v in index.items() if v not in reaches_sink}


def _levels(adjacency, heads, capacity, s) -> list[int]:
    """Breadth-first distances from s over edges with residual capacity; -1 where unreachable."""
    level = [-1] * len(adjacency)
    level[s] = 0
    frontier = [s]
    while frontier:
        following = []
        for u in frontier:
            for e in adjacency[u]:
                v = heads[e]
                if capacity[e] > 0 and level[v] < 0:
                    level[v] = level[u] + 1
                    following.append(v)
        frontier = following
    return level


def _blocking_flow(adjacency, heads, capacity, level, s, t) -> int:
    """Augment along shortest paths of the level graph until none is left (iterative: graphs are deep)."""
    pointer = [0] * len(adjacency)
    pushed = 0
    while True:
        path: list[int] = []  # edges from s to the vertex on top
        vertex = s
        while vertex != t:
            edges = adjacency[vertex]
            while pointer[vertex] < len(edges):
                e = edges[pointer[vertex]]
                if capacity[e] > 0 and level[heads[e]] == level[vertex] + 1:
                    break
                pointer[vertex] += 1
            else:
                if not path:
                    return pushed
                level[vertex] = -1  # a dead end: never enter it again in this phase
                dead_end = path.pop()
                vertex = heads[dead_end ^ 1]
                pointer[vertex] += 1
                continue
            e = edges[pointer[vertex]]
            path.append(e)
            vertex = heads[e]
        amount = min(capacity[e] for e in path)
        for e in path:
            capacity[e] -= amount
            capacity[e ^ 1] += amount
        pushed += amount


def identifiability(
    traced: TracedModel,
    batch_size: int = 1,
    *,
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
    max_recoverable: float | None = None,
    bn_mode: str = "train",
) -> Identifiability:
    """rank(∂g/∂x) <= max flow; the verdict is the level (method.md: verdicts) at the recoverable-fraction ceiling
    `max_recoverable` (default 0.5): `protected` only when at most that share of the input's directions can be
    seen, `partial` with a smaller certified deficit, `exposed` without one. In training mode (`bn_mode`, the
    worst case by default) the running statistics a BatchNorm sends are read as well."""
    ceiling = level_ceiling(max_recoverable)
    unknowns = batch_size * sample_unknowns(traced)
    network = FlowNetwork(traced, batch_size, shared_predicate(shared_layers, withheld_layers), bn_mode)
    rank_bound, bottleneck, cut_nodes = network.min_cut()
    rank_bound = min(rank_bound, unknowns)
    deficit = unknowns - rank_bound
    return Identifiability(
        unknowns=unknowns,
        rank_bound=rank_bound,
        certified_deficit=deficit,
        recoverable_fraction=rank_bound / unknowns if unknowns else 1.0,
        bottleneck=bottleneck,
        verdict=verdict_level(rank_bound, unknowns, ceiling),
        cut_nodes=cut_nodes,
        max_recoverable=ceiling,
    )


# ---- the federated round (method.md: the round) --------------------------------------------------------------------------------


def round_identifiability(
    traced: TracedModel,
    round_: Round,
    *,
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
    max_recoverable: float | None = None,
    cache: dict | None = None,
) -> Identifiability:
    """rank(∂u/∂X) <= min(n, |θ_s|, Σ_c Σ_k R(B_k)) for the update u of a round (method.md: the round).

    Every influence of a step's samples on u leaves that step through its gradient, so rank(∂u/∂X) is at most the
    sum over the steps of rank(∂g_k/∂x_k) <= R(B_k), the bound at that step's batch size (a sample read in every
    epoch counts once per step that reads it). Before the last step every trainable gradient carries influence
    on, withheld ones too: they move weights that later steps read; the last step's withheld gradients go
    nowhere the server sees. All of it ends in the |θ_s| values of the update, and with secure aggregation the
    C clients' rounds add up: n = C·N·|x|. FedSGD (one step, one client) is the bound itself.

    Hand-checkable (one-sample input 3x32x32, |x| = 3,072): N = B = 1, C = 2 doubles n to 6,144 and the steps'
    term to 2·R(1); N = 3, B = 2, E = 2 runs steps at batch sizes 2, 1, 2, 1, so Σ R = 2·R(2) + 2·R(1).

    `cache` (a dict the caller keeps) holds the bound's per-step bounds and |θ_s| between calls on the same traced model
    and shared set, so that a design review can try many rounds for the price of a few max flows.
    """
    cache = {} if cache is None else cache
    sample = sample_identifiability(
        traced,
        round_,
        shared_layers=shared_layers,
        withheld_layers=withheld_layers,
        max_recoverable=max_recoverable,
        cache=cache,
    )
    if round_.fedsgd:
        if round_.batch_size == 1:
            batch = cache[(1, False)]
            if batch.max_recoverable != level_ceiling(max_recoverable):
                batch = identifiability(
                    traced,
                    1,
                    shared_layers=shared_layers,
                    withheld_layers=withheld_layers,
                    max_recoverable=max_recoverable,
                    bn_mode=round_.bn_mode,
                )
        else:
            batch = identifiability(
                traced,
                round_.batch_size,
                shared_layers=shared_layers,
                withheld_layers=withheld_layers,
                max_recoverable=max_recoverable,
                bn_mode=round_.bn_mode,
            )
        return replace(batch, sample=sample)
    per_sample = sample_unknowns(traced)
    unknowns = round_.clients * round_.samples * per_sample
    shared = shared_predicate(shared_layers, withheld_layers)
    if "update_values" not in cache:
        cache["update_values"] = FlowNetwork(traced, 1, shared, round_.bn_mode).gradient_values()
    update_values = cache["update_values"]
    kinds = _step_kinds(round_, partial=bool(shared_layers or withheld_layers))
    last = round_.samples % round_.batch_size or round_.batch_size
    terms, bounds = [], cache
    for (size, every), count in kinds.items():  # the bound's network once per distinct kind of step
        if (size, every) not in bounds:
            bounds[(size, every)] = (
                identifiability(traced, size, bn_mode=round_.bn_mode)
                if every
                else identifiability(
                    traced,
                    size,
                    shared_layers=shared_layers,
                    withheld_layers=withheld_layers,
                    bn_mode=round_.bn_mode,
                )
            )
        step = bounds[(size, every)]
        terms.append(StepBound(size, count, step.rank_bound, every, step.bottleneck))
    steps_bound = round_.clients * sum(term.rank_bound * term.steps for term in terms)
    rank_bound = min(unknowns, update_values, steps_bound)
    binding, explanation, bottleneck = _binding(round_, unknowns, update_values, steps_bound, terms)
    ceiling = level_ceiling(max_recoverable)
    cut_nodes = [] if binding == "update-values" else bounds[(last, False)].cut_nodes
    return Identifiability(
        unknowns=unknowns,
        rank_bound=rank_bound,
        certified_deficit=unknowns - rank_bound,
        recoverable_fraction=rank_bound / unknowns if unknowns else 1.0,
        bottleneck=bottleneck,
        verdict=verdict_level(rank_bound, unknowns, ceiling),
        cut_nodes=cut_nodes,
        max_recoverable=ceiling,
        round=RoundBound(unknowns, update_values, steps_bound, terms, binding, explanation),
        sample=sample,
    )


def sample_unknowns(traced: TracedModel) -> int:
    """|x|: the unknowns of one sample, over all of the model's inputs."""
    return sum(traced.record(input_id).output_numel for input_id in traced.input_ids)


def _sample_step(
    traced: TracedModel,
    cache: dict,
    batch_size: int,
    statistics: list[str],
    every: bool,
    shared_layers: list[str] | None,
    withheld_layers: list[str] | None,
    max_recoverable: float | None,
    bn_mode: str = "train",
) -> int:
    """One local step's bound on rank(∂g_k/∂x_i): the bound's flow at batch size 1 where the samples of a batch do not
    meet (eval mode, no batch statistics, B = 1); else the flow over sample i and the other B-1 samples of its
    batch, joined by the statistics (method.md: the round). `every`: all trainable gradients carry on (a step before the
    last); else only the shared ones."""
    if batch_size == 1 or not statistics:
        key = (1, every)
        if key not in cache:
            cache[key] = (
                identifiability(traced, 1, bn_mode=bn_mode)
                if every
                else identifiability(
                    traced,
                    1,
                    shared_layers=shared_layers,
                    withheld_layers=withheld_layers,
                    max_recoverable=max_recoverable,
                    bn_mode=bn_mode,
                )
            )
        return cache[key].rank_bound
    key = ("batch-statistics", batch_size, every)
    if key not in cache:
        shared = shared_predicate(None, None) if every else shared_predicate(shared_layers, withheld_layers)
        network = FlowNetwork(traced, 1, shared, bn_mode)
        network.add_rest_of_batch(shared, batch_size - 1, statistics)
        cache[key] = network.min_cut()[0]
    return cache[key]


def sample_identifiability(
    traced: TracedModel,
    round_: Round,
    *,
    shared_layers: list[str] | None = None,
    withheld_layers: list[str] | None = None,
    max_recoverable: float | None = None,
    cache: dict | None = None,
) -> SampleBound:
    """rank(∂u/∂x_i) <= R_s = min(|x|, Σ_t min(|θ_s|, E_i·R(1))) for every sample i (method.md: each sample, the round).

    J_i = ∂u/∂x_i moves one sample with every other one fixed. Within a step the batch gradient is a sum of
    per-sample gradients, so ∂g_k/∂x_i is the single-sample Jacobian, bounded by the bound's flow at batch size 1; the
    sample reaches u only through the E_i steps that read it (E for a round of E epochs, 1 for FedSGD at any batch
    size), and all of it ends in the |θ_s| update values. The batch size, N and the clients do not enter, except
    through batch statistics: in training mode a BatchNorm carries sample i into every other sample's activations,
    and R(1) is the flow over sample i and the rest of its batch (at the round's batch size B, the largest batch a
    sample is in: the flow only grows with the rest's capacity).

    Every server round the client takes part in reads the sample again at new weights, through the same paths:
    the bound sums one round's term over the rounds counted (Round.rounds_counted: the stated server rounds, else
    one, and the report says what each further round adds).

    With part of the gradients withheld the round's rule holds per step: a step before the last carries every
    trainable gradient on (later steps read the weights it moved), the last step only the shared ones. A sample in
    the last batch of the last epoch is read once by that last step; the bound holds for every sample, so it takes
    the worst one: E·R_all(1) when some sample is never in the last step's batch (N > B), (E-1)·R_all(1) +
    R_shared(1) when every sample is (N <= B). Without withheld gradients R_all(1) = R_shared(1).

    `cache` is round_identifiability's: the step bounds and |θ_s| are computed once.
    """
    cache = {} if cache is None else cache
    shared = shared_predicate(shared_layers, withheld_layers)
    partial = bool(shared_layers or withheld_layers)
    per_sample = sample_unknowns(traced)
    rounds = round_.rounds_counted
    if "update_values" not in cache and (round_.steps > 1 or rounds > 1):
        cache["update_values"] = FlowNetwork(traced, 1, shared, round_.bn_mode).gradient_values()
    # One step: its flow already passes the |θ_s| gradient vertices, so R(1) <= |θ_s| and the cap never binds.
    update_values = cache.get("update_values")
    statistics = batch_statistics(traced, round_.bn_mode)
    batch = round_.batch_size

    def step(every: bool) -> int:
        return _sample_step(
            traced, cache, batch, statistics, every, shared_layers, withheld_layers, max_recoverable, round_.bn_mode
        )

    last_step = step(False)  # R_shared(1): the last step, only shared gradients leave
    earlier_step = step(True) if partial and round_.steps > 1 else last_step  # R_all(1)
    epochs = 1 if round_.fedsgd else round_.local_epochs
    if epochs == 1 and round_.steps == 1:
        steps_bound = last_step
    elif round_.steps_per_epoch == 1:  # every sample is in the last step's batch
        steps_bound = (epochs - 1) * earlier_step + last_step
    else:
        steps_bound = epochs * earlier_step
    round_bound = steps_bound if update_values is None else min(update_values, steps_bound)
    rank_bound = min(per_sample, rounds * round_bound)
    if update_values is not None and update_values < steps_bound and rounds * update_values < per_sample:
        binding = "update-values"
    elif rounds * round_bound < per_sample:
        binding = "steps"
    else:
        binding = "unknowns"
    return SampleBound(
        rank_bound=rank_bound,
        unknowns=per_sample,
        recoverable_fraction=rank_bound / per_sample if per_sample else 1.0,
        level=verdict_level(rank_bound, per_sample, level_ceiling(max_recoverable)),
        steps_per_sample=epochs,
        single_sample_bound=earlier_step if round_.steps > 1 else last_step,
        binding=binding,
        rounds=rounds,
        round_bound=round_bound,
        rounds_known=round_.server_rounds_known,
        batch_statistics=[traced.record(node_id).name for node_id in statistics] if batch > 1 else [],
        running_statistics=[
            key
            for _, key, _ in running_statistics(traced, round_.bn_mode)
            if shared(GradientSource(key, 0, key, False, (key,), statistic=True))
        ],
    )


def _step_kinds(round_: Round, *, partial: bool) -> dict[tuple[int, bool], int]:
    """(batch size, every gradient carries on) -> steps per client of that kind, counted without listing the steps:
    each epoch runs ⌊N/B⌋ full batches and one short batch of N mod B. With part of the gradients withheld, the
    last step (whose withheld gradients reach nothing the server sees) is a kind of its own."""
    full, rest = divmod(round_.samples, round_.batch_size)
    kinds: dict[tuple[int, bool], int] = {}
    for size, count in ((round_.batch_size, full), (rest, 1 if rest else 0)):
        if count:
            kinds[(size, partial)] = count * round_.local_epochs
    if partial:
        last = (rest or round_.batch_size, True)
        kinds[last] -= 1
        if not kinds[last]:
            del kinds[last]
        kinds[(last[0], False)] = 1
    return kinds


def _binding(
    round_: Round, unknowns: int, update_values: int, steps_bound: int, terms: list[StepBound]
) -> tuple[str, str, list[str]]:
    """Which of the round's three caps is the bound, the sentence that names it, and the cut it stands for."""
    clients = f" x {round_.clients} clients" if round_.clients > 1 else ""
    per_step = " + ".join(f"{term.steps} x R({term.batch_size}) = {term.steps} x {term.rank_bound:,}" for term in terms)
    if update_values < min(unknowns, steps_bound):
        return (
            "update-values",
            f"the update has only {update_values:,} values for {unknowns:,} unknowns",
            [f"the update's {update_values:,} values"],
        )
    if steps_bound < unknowns:
        cut = list(dict.fromkeys(name for term in terms for name in term.bottleneck))
        steps = (
            "the local step's gradient carries"
            if round_.steps == 1
            else f"the {round_.steps:,} local steps' gradients carry"
        )
        return (
            "steps",
            f"{steps} at most {steps_bound:,} independent values ({per_step}{clients}) for {unknowns:,} unknowns",
            cut,
        )
    cut = list(dict.fromkeys(name for term in terms for name in term.bottleneck))
    return (
        "unknowns",
        f"no cap falls below the {unknowns:,} unknowns: the steps' gradients can carry "
        f"{steps_bound:,} values ({per_step}{clients}) and the update has {update_values:,}",
        cut,
    )
