"""Spec §9: flow network over the traced graph, max flow / min cut -> an upper bound on rank(∂g/∂x)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rankaudit import ops
from rankaudit.levels import DEFAULT_MAX_RECOVERABLE, verdict_level
from rankaudit.ops import Role
from rankaudit.result import Identifiability
from rankaudit.trace import NodeRecord, TracedModel

SOURCE, SINK = "source", "sink"
# Sums and concatenations pass δ through unchanged: a parameter they add receives δ(out) only, and their
# operands' δ do not depend on each other.
_ADDITIVE_FAMILIES = ("add", "cat", "stack")


@dataclass(frozen=True)
class GradientSource:
    """One shared gradient the server receives: a layer's weights, or a parameter another op uses directly."""

    name: str          # the layer (conv1) or the qualified parameter name (cls_token, norm.weight)
    numel: int
    owner: str         # the record name of the op that reads it
    owner_is_layer: bool


def gradient_sources(record: NodeRecord) -> list[GradientSource]:
    """The shared-gradient candidates this traced op reads: a layer's counted weights (one vertex per module,
    however often it is called: the gradient is summed over the calls), or the parameters a non-layer op uses
    directly (class token, position embedding, norm scale)."""
    counting = record.counting
    if counting.role is Role.LAYER:
        name = record.name.split("#")[0]
        return [GradientSource(name, counting.weights, name, True)] if counting.weights else []
    return [GradientSource(name, numel, record.name, False) for name, numel in record.direct_params if numel]


def shared_predicate(shared_layers: list[str] | None, withheld_layers: list[str] | None) -> Callable[[GradientSource], bool]:
    """Which gradients are sent: all by default; with --shared-layers only those layers'; with
    --withheld-layers everything else, directly used parameters (class token, norms) included."""
    if shared_layers:
        names = set(shared_layers)
        return lambda source: source.owner in names or source.name in names
    if withheld_layers:
        names = set(withheld_layers)
        return lambda source: source.owner not in names and source.name not in names
    return lambda source: True


class FlowNetwork:
    """The §9 network of one traced model at batch size B; vertex capacities by splitting (v_in -> v_out)."""

    def __init__(self, traced: TracedModel, batch_size: int, is_shared: Callable[[GradientSource], bool]):
        self.traced = traced
        self.batch_size = batch_size
        self.edges: dict[tuple[str, str], int | None] = {}  # (tail, head) -> capacity; None: unbounded
        self.labels: dict[tuple[str, str], str] = {}   # split edge -> what the report calls it
        self.owners: dict[tuple[str, str], str] = {}   # split edge -> the traced node it belongs to
        self.gradients: set[str] = set()               # gradient vertices created so far
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
            self._split(f"t:{node_id}", size, record.name, node_id)
            self._split(f"d:{node_id}", size, f"δ{record.name}", node_id)
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
                self._edge(f"t:{operand}", f"t:{node_id}")      # forward data
                self._edge(f"d:{node_id}", f"d:{operand}")      # backward: δ(out) -> δ(in)
            family = ops.FAMILIES.get(record.family, ops.UNMODELLED)
            if family.input_dependent_jacobian:
                for operand in inputs:
                    self._edge(f"t:{operand}", f"d:{operand}")
            additive = record.family in _ADDITIVE_FAMILIES
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
                    for operand in inputs[:1] if source.owner_is_layer else inputs:
                        self._edge(f"t:{operand}", vertex)
        for output_id in traced.output_ids:
            self._edge(f"t:{output_id}", f"d:{output_id}")  # the loss: δ(logits) depends on the logits

    def _gradient(self, source: GradientSource, node_id: str) -> str:
        """The vertex of one shared gradient, created on first use (a tied parameter is one gradient)."""
        vertex = f"g:{source.name}"
        if vertex not in self.gradients:
            self.gradients.add(vertex)
            self._split(vertex, source.numel, f"∇{source.name}", node_id)
            self.edges[(vertex + ":out", SINK)] = None
        return vertex

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
        while (node_id not in self.traced.input_ids and record.counting.role not in (Role.LAYER, Role.ADD, Role.CAT)
               and record.inputs):
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
        adjacency[v].append(len(heads))     # its residual twin: edge e ^ 1
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
            u = heads[e]                   # e ^ 1 runs u -> v
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
        path: list[int] = []           # edges from s to the vertex on top
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
                level[vertex] = -1     # a dead end: never enter it again in this phase
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


def identifiability(traced: TracedModel, batch_size: int = 1, *, shared_layers: list[str] | None = None,
                    withheld_layers: list[str] | None = None, max_recoverable: float | None = None) -> Identifiability:
    """rank(∂g/∂x) <= max flow; the verdict is spec §11's level at the recoverable-fraction ceiling
    `max_recoverable` (default 0.5): `protected` only when at most that share of the input's directions can be
    seen, `partial` with a smaller certified deficit, `exposed` without one."""
    ceiling = DEFAULT_MAX_RECOVERABLE if max_recoverable is None else max_recoverable
    unknowns = batch_size * sum(traced.record(input_id).output_numel for input_id in traced.input_ids)
    network = FlowNetwork(traced, batch_size, shared_predicate(shared_layers, withheld_layers))
    rank_bound, bottleneck, cut_nodes = network.min_cut()
    rank_bound = min(rank_bound, unknowns)
    deficit = unknowns - rank_bound
    return Identifiability(unknowns=unknowns, rank_bound=rank_bound, certified_deficit=deficit,
                           recoverable_fraction=rank_bound / unknowns if unknowns else 1.0,
                           bottleneck=bottleneck, verdict=verdict_level(rank_bound, unknowns, ceiling),
                           cut_nodes=cut_nodes, max_recoverable=ceiling)
