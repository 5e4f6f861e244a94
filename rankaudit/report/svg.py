"""SVG drawings for the HTML report: the per-layer RA_i chart, the architecture graph, GDBR label counts, DP bound.

Each function returns one `<svg>` element as a string: XML-valid (every text and attribute escaped, no HTML-only
entities), without xmlns (inline SVG in HTML5 needs none, so the page holds no URL at all), sized by its viewBox
and scaled by the page's CSS. Ids inside a drawing carry the caller's prefix, so several drawings share one page.
They read the Result only.
"""

from __future__ import annotations

import math
from html import escape

import networkx as nx

from rankaudit.result import Architecture, DPBound, LayerRow, Result

# Palette shared with report.css (kept in step by hand; contrast checked against white).
INK = "#0f172a"
MUTED = "#475569"
GRID = "#e2e8f0"
RA_BAR = "#334155"
WARN = "#c2410c"  # the critical layer, everywhere
WARN_LIGHT = "#ffedd5"
DENSE = "#94a3b8"
CUT = "#7c3aed"  # the identifiability bound's min cut
SERIES = (  # (LayerRow field, symbol, meaning, colour of its faint bar)
    ("inputs", "|x|", "unknowns", "#2563eb"),
    ("weights", "|W|", "gradient constraints", "#7c3aed"),
    ("outputs", "|z|", "weight constraints", "#0d9488"),
    ("virtual", "V", "virtual constraints", "#b45309"),
)
MONO = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
SANS = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"
MONO_CHAR = 0.6  # advance of one monospace character, in font sizes


def x(value) -> str:
    """Escape for XML text and attribute values (quotes included); html.escape emits only XML's own entities."""
    return escape(str(value), quote=True)


def fmt_int(value: int | float | None) -> str:
    if value is None:
        return "n/a"
    try:
        return f"{int(value):,}"
    except (TypeError, ValueError, OverflowError):
        return str(value)


def _f(value: float) -> str:
    """A coordinate: short and stable."""
    return f"{value:.1f}".rstrip("0").rstrip(".") if value % 1 else str(int(value))


def symlog(value: float) -> float:
    """sign(v)·log10(1 + |v|): 0 stays 0, ±10^k lands near ±k, so 1 and 100,000 share one axis."""
    return math.copysign(math.log10(1 + abs(value)), value)


def compact(value: float) -> str:
    """A tick label: 0, 10, 100, 1k ... 10M, with a true minus sign."""
    magnitude = abs(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= limit:
            text = f"{magnitude / limit:g}{suffix}"
            break
    else:
        text = f"{magnitude:g}"
    return ("−" if value < 0 else "") + text


def _truncate(text: str, chars: int) -> str:
    return text if len(text) <= chars else text[: max(chars - 1, 1)] + "…"


def _svg_open(
    width: float, height: float, label: str, css_class: str, min_width: float | None = None, grow: float = 1.0
) -> str:
    """The opening tag: scales with its container down to `min_width` px and up to `grow` times its own size."""
    style = f"max-width:{_f(width * grow)}px" + (f";min-width:{_f(min_width)}px" if min_width else "")
    return (
        f'<svg class="{css_class}" viewBox="0 0 {_f(width)} {_f(height)}" width="100%" role="img" '
        f'aria-label="{x(label)}" style="{style}" preserveAspectRatio="xMinYMin meet" '
        f'font-family="{x(SANS)}">'
    )


# ---------------------------------------------------------------------------------------------------------------
# RA_i per layer
# ---------------------------------------------------------------------------------------------------------------


def _row_tooltip(row: LayerRow) -> str:
    text = (
        f"{row.name} ({row.op}): RA_i = {fmt_int(row.ra_i)} = |x| {fmt_int(row.inputs)} − |W| "
        f"{fmt_int(row.weights)} − |z| {fmt_int(row.outputs)} − V {fmt_int(row.virtual)}"
    )
    if row.critical:
        text += "; the critical layer: it sets the network's RA-i"
    if row.dense:
        text += "; dense layer: always recoverable, not counted in RA-i"
    return text


def ra_chart(result: Result, prefix: str = "c") -> str:
    """Horizontal bars, one row per layer: RA_i in front (signed, from the zero line), |x| |W| |z| V faint behind.

    Symmetric-log scale (sign·log10(1+|v|)): the counts span 1 to millions. The critical row is in the warning
    colour, dense rows are hatched grey. Every bar has a <title> tooltip with its numbers.
    """
    rows = result.layers
    if not rows:
        return ""
    font = 13
    name_w = min(max(max(len(r.name) for r in rows) * font * MONO_CHAR + 24, 96), 230)
    value_w = max(max(len(fmt_int(r.ra_i)) for r in rows) * font * 0.62 + 18, 64)
    plot_w = 320
    width = name_w + value_w + plot_w + 12  # layer | RA_i | bars: what matters first survives a narrow screen
    top, row_h, bottom = 40, 30, 44
    height = top + row_h * len(rows) + bottom
    values = [symlog(getattr(r, field)) for r in rows for field, *_ in SERIES] + [symlog(r.ra_i) for r in rows]
    lo, hi = math.floor(min(0.0, *values)), math.ceil(max(0.0, *values))
    if lo == hi:
        hi = lo + 1
    x0, x1 = name_w + value_w, name_w + value_w + plot_w
    value_x = name_w + value_w - 10

    def px(value: float) -> float:
        return x0 + (symlog(value) - lo) / (hi - lo) * plot_w

    zero = px(0)
    out = [
        _svg_open(width, height, f"RA_i per layer of {result.model_name}", "chart", min_width=width * 0.68, grow=1.25)
    ]
    out.append(
        f'<defs><pattern id="{prefix}-hatch" width="6" height="6" patternUnits="userSpaceOnUse" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#e2e8f0"/>'
        f'<line x1="0" y1="0" x2="0" y2="6" stroke="{DENSE}" stroke-width="3"/></pattern></defs>'
    )
    # Column headers.
    out.append(
        f'<text x="{_f(name_w - 10)}" y="16" text-anchor="end" font-size="11" fill="{MUTED}" '
        f'font-weight="600">layer</text>'
    )
    out.append(
        f'<text x="{_f(value_x)}" y="16" text-anchor="end" font-size="11" fill="{MUTED}" font-weight="600">RA_i</text>'
    )
    # Row bands: zebra, critical highlighted.
    for i, row in enumerate(rows):
        y = top + i * row_h
        if row.critical:
            out.append(f'<rect x="0" y="{_f(y)}" width="{_f(width)}" height="{row_h}" fill="{WARN_LIGHT}"/>')
        elif i % 2:
            out.append(f'<rect x="0" y="{_f(y)}" width="{_f(width)}" height="{row_h}" fill="#f8fafc"/>')
    # Grid and ticks at 0 and ±10^k; thinned when they would crowd.
    exponents = [k for k in range(lo, hi + 1)]
    step = 1 if plot_w / max(len(exponents), 1) >= 34 else 2
    for k in exponents:
        value = 0 if k == 0 else math.copysign(10 ** abs(k), k)
        tx = x0 + (k - lo) / (hi - lo) * plot_w
        if k != 0:
            out.append(
                f'<line x1="{_f(tx)}" y1="{top - 4}" x2="{_f(tx)}" y2="{_f(height - bottom + 4)}" '
                f'stroke="{GRID}" stroke-width="1"/>'
            )
        if k % step == 0:
            out.append(
                f'<text x="{_f(tx)}" y="{top - 10}" text-anchor="middle" font-size="11" '
                f'fill="{MUTED}">{x(compact(value))}</text>'
            )
    for i, row in enumerate(rows):
        y = top + i * row_h
        mid = y + row_h / 2
        name_fill = WARN if row.critical else (MUTED if row.dense else INK)
        weight = ' font-weight="700"' if row.critical else ""
        out.append(
            f'<text x="{_f(name_w - 10)}" y="{_f(mid + 4)}" text-anchor="end" font-size="{font}" '
            f'font-family="{x(MONO)}" fill="{name_fill}"{weight}>{x(_truncate(row.name, 34))}'
            f"<title>{x(row.name)} ({x(row.op)})</title></text>"
        )
        # Faint ingredient bars, stacked in the row.
        for k, (field, symbol, meaning, colour) in enumerate(SERIES):
            value = getattr(row, field)
            if value == 0:
                continue
            a, b = sorted((zero, px(value)))
            out.append(
                f'<rect x="{_f(a)}" y="{_f(y + 3 + k * 6)}" width="{_f(max(b - a, 1))}" height="5" '
                f'fill="{colour}" fill-opacity="0.32"><title>{x(row.name)}: {symbol} = '
                f"{fmt_int(value)} ({meaning})</title></rect>"
            )
        # RA_i, in front.
        a, b = sorted((zero, px(row.ra_i)))
        fill = WARN if row.critical else (f"url(#{prefix}-hatch)" if row.dense else RA_BAR)
        out.append(
            f'<rect x="{_f(a)}" y="{_f(mid - 6)}" width="{_f(max(b - a, 1.5))}" height="12" rx="2" '
            f'fill="{fill}" stroke="#ffffff" stroke-width="1"><title>{x(_row_tooltip(row))}</title></rect>'
        )
        value_fill = WARN if row.critical else (MUTED if row.dense else INK)
        style = ' font-style="italic"' if row.dense else ""
        out.append(
            f'<text x="{_f(value_x)}" y="{_f(mid + 4)}" text-anchor="end" font-size="{font}" '
            f'fill="{value_fill}"{weight}{style}>{x(fmt_int(row.ra_i))}'
            f"<title>{x(_row_tooltip(row))}</title></text>"
        )
    # Zero line on top of everything.
    out.append(
        f'<line x1="{_f(zero)}" y1="{top - 4}" x2="{_f(zero)}" y2="{_f(height - bottom + 4)}" '
        f'stroke="{INK}" stroke-width="1.5"/>'
    )
    base = height - bottom
    if zero - x0 > 140:
        out.append(
            f'<text x="{_f(zero - 6)}" y="{_f(base + 18)}" text-anchor="end" font-size="11" '
            f'fill="{MUTED}">← RA_i &lt; 0: over-determined</text>'
        )
    if x1 - zero > 140:
        out.append(
            f'<text x="{_f(zero + 6)}" y="{_f(base + 18)}" font-size="11" fill="{MUTED}">'
            f"RA_i &gt; 0: more unknowns →</text>"
        )
    out.append(
        f'<text x="{_f((x0 + x1) / 2)}" y="{_f(base + 36)}" text-anchor="middle" font-size="11" '
        f'fill="{MUTED}">symmetric log scale: sign · log10(1 + |value|)</text>'
    )
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# Architecture graph
# ---------------------------------------------------------------------------------------------------------------

NODE_W, NODE_H = 184, 36
CIRCLE_R = 12
LANE_PITCH = NODE_W + 28
RANK_PITCH = 60
CHANNEL_PITCH = 13


def _ranks(arch: Architecture) -> tuple[nx.DiGraph, dict[str, int], list[str]]:
    """The DAG, each node's layer (longest path from a source) and the spine (the longest path) for lane 0."""
    graph = nx.DiGraph()
    order = {node.id: i for i, node in enumerate(arch.nodes)}
    graph.add_nodes_from(order)
    graph.add_edges_from((u, v) for u, v in arch.edges if u in order and v in order and u != v)
    if not nx.is_directed_acyclic_graph(graph):  # never from a trace; draw it as a list rather than fail
        return graph, {n: order[n] for n in order}, list(order)
    rank = {}
    for depth, generation in enumerate(nx.topological_generations(graph)):
        for node in generation:
            rank[node] = depth
    spine = nx.dag_longest_path(graph, topo_order=sorted(order, key=lambda n: (rank[n], order[n])))
    return graph, rank, spine


def _lanes(graph: nx.DiGraph, rank: dict[str, int], spine: list[str], order: dict[str, int]) -> dict[str, int]:
    """Lane 0 holds the spine; a branch keeps its parent's lane when it can, else takes the nearest free one."""
    lane = {node: 0 for node in spine}
    taken = {(rank[node], 0) for node in spine}
    for node in sorted(graph, key=lambda n: (rank[n], order[n])):
        if node in lane:
            continue
        wanted = [lane[p] for p in graph.predecessors(node) if lane.get(p, 0) != 0]
        for candidate in wanted + [k for i in range(1, len(graph) + 1) for k in (i, -i)]:
            if (rank[node], candidate) not in taken:
                lane[node] = candidate
                taken.add((rank[node], candidate))
                break
    return lane


def _corner_path(points: list[tuple[float, float]], radius: float = 7) -> str:
    """An orthogonal polyline with rounded corners."""
    d = [f"M{_f(points[0][0])},{_f(points[0][1])}"]
    for i in range(1, len(points) - 1):
        (ax, ay), (bx, by), (cx, cy) = points[i - 1], points[i], points[i + 1]
        r = min(radius, math.hypot(bx - ax, by - ay) / 2, math.hypot(cx - bx, cy - by) / 2)
        ux, uy = _unit(bx - ax, by - ay)
        vx, vy = _unit(cx - bx, cy - by)
        d.append(f"L{_f(bx - ux * r)},{_f(by - uy * r)} Q{_f(bx)},{_f(by)} {_f(bx + vx * r)},{_f(by + vy * r)}")
    d.append(f"L{_f(points[-1][0])},{_f(points[-1][1])}")
    return " ".join(d)


def _unit(dx: float, dy: float) -> tuple[float, float]:
    length = math.hypot(dx, dy) or 1.0
    return dx / length, dy / length


def architecture_graph(result: Result, prefix: str = "g") -> str:
    """The layer graph, top to bottom, laid out in layers (networkx topological generations) and lanes.

    The longest path runs straight down lane 0; branches (shortcut projections, cat inputs) take side lanes; an
    edge that would cross nodes is routed down a channel on the side. Residual blocks are shaded rectangles
    labelled with their name, projections are dashed, the critical layer is in the warning colour.
    """
    arch = result.architecture
    if arch is None or not arch.nodes:
        return ""
    nodes = {node.id: node for node in arch.nodes}
    order = {node.id: i for i, node in enumerate(arch.nodes)}
    graph, rank, spine = _ranks(arch)
    lane = _lanes(graph, rank, spine, order)
    rows = {row.node: row for row in result.layers if row.node}
    by_name = {row.name: row for row in result.layers}
    occupied = {(rank[n], lane[n]) for n in graph}
    lanes = sorted(set(lane.values()))

    def half_height(node_id: str) -> float:
        return CIRCLE_R if nodes[node_id].kind in ("add", "cat") else NODE_H / 2

    # Route the edges first: side channels decide the left margin.
    routes = []  # (u, v, how, channel slot or None)
    channels: dict[str, list[tuple[int, int, int]]] = {"left": [], "right": []}
    for u, v in graph.edges:
        ru, rv, lu, lv = rank[u], rank[v], lane[u], lane[v]
        between = range(ru + 1, rv)
        if lu == lv and all((r, lu) not in occupied for r in between):
            routes.append((u, v, "straight", None))
        elif rv - ru == 1:
            routes.append((u, v, "across-then-down" if (ru, lv) not in occupied else "curve", None))
        elif lu != lv and all((r, lu) not in occupied for r in range(ru + 1, rv + 1)):
            routes.append((u, v, "down-then-across", None))
        elif lu != lv and all((r, lv) not in occupied for r in range(ru, rv)):
            routes.append((u, v, "across-then-down", None))
        else:
            side = "right" if min(lu, lv) > 0 else "left"
            slot = 0  # the first channel whose edges do not overlap this one's ranks (touching counts)
            while any(s == slot and not (rv < a or b < ru) for a, b, s in channels[side]):
                slot += 1
            channels[side].append((ru, rv, slot))
            routes.append((u, v, side, slot))
    left_slots = 1 + max((s for *_, kind, s in routes if kind == "left"), default=-1)
    right_slots = 1 + max((s for *_, kind, s in routes if kind == "right"), default=-1)
    margin = 14
    left_pad = margin + left_slots * CHANNEL_PITCH + (8 if left_slots else 0)
    width = (
        left_pad
        + len(lanes) * LANE_PITCH
        - (LANE_PITCH - NODE_W)
        + right_slots * CHANNEL_PITCH
        + (8 if right_slots else 0)
        + margin
    )
    max_rank = max(rank.values())
    top = 30
    height = top + max_rank * RANK_PITCH + NODE_H + 16
    lane_index = {ln: i for i, ln in enumerate(lanes)}

    def cx(node_id: str) -> float:
        return left_pad + lane_index[lane[node_id]] * LANE_PITCH + NODE_W / 2

    def cy(node_id: str) -> float:
        return top + rank[node_id] * RANK_PITCH + NODE_H / 2

    lanes_left = left_pad
    lanes_right = left_pad + len(lanes) * LANE_PITCH - (LANE_PITCH - NODE_W)

    def channel_x(side: str, slot: int) -> float:
        if side == "left":
            return lanes_left - 10 - slot * CHANNEL_PITCH
        return lanes_right + 10 + slot * CHANNEL_PITCH

    out = [_svg_open(width, height, f"architecture of {result.model_name}", "graph", min_width=width * 0.75)]
    out.append(
        f'<defs><marker id="{prefix}-arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
        f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" fill="{MUTED}"/>'
        f"</marker></defs>"
    )

    # Residual blocks: shaded rectangles behind their layers, projection and merge.
    node_by_name = {node.name: node.id for node in arch.nodes}
    for block in result.blocks:
        members = {n.id for n in arch.nodes if n.block == block.name}
        members |= {node_by_name[name] for name in block.main_layers + block.shortcut_layers if name in node_by_name}
        if block.merge in nodes:
            members.add(block.merge)
        members &= set(rank)
        if not members:
            continue
        left = min(cx(n) - NODE_W / 2 for n in members) - 8
        right = max(cx(n) + NODE_W / 2 for n in members) + 8
        upper = min(cy(n) - half_height(n) for n in members) - 20
        lower = max(cy(n) + half_height(n) for n in members) + 6
        label_x = left + 6
        # A block whose shortcut runs down a side channel encloses it; all such blocks line up on that side.
        sides = {kind for u, v, kind, slot in routes if v == block.merge and kind in ("left", "right")}
        if "left" in sides:
            left = min(left, channel_x("left", left_slots - 1) - 6)
        if "right" in sides:
            right = max(right, channel_x("right", right_slots - 1) + 6)
        dash = ' stroke-dasharray="5 3"' if block.kind == "approximate" else ""
        out.append(
            f'<g class="block"><rect x="{_f(left)}" y="{_f(upper)}" width="{_f(right - left)}" '
            f'height="{_f(lower - upper)}" rx="8" fill="#eef2ff" stroke="#a5b4fc"{dash}/>'
            f'<text x="{_f(label_x)}" y="{_f(upper + 14)}" font-size="11" font-weight="600" fill="#3730a3" '
            f'font-family="{x(MONO)}">{x(block.name)}<title>residual block {x(block.name)}: '
            f"{x(block.kind)} shortcut</title></text></g>"
        )

    # Edges.
    for u, v, kind, slot in routes:
        ux_, uy_, vx_, vy_ = cx(u), cy(u), cx(v), cy(v)
        hu, hv = half_height(u), half_height(v)
        side_v = NODE_W / 2 if nodes[v].kind not in ("add", "cat") else CIRCLE_R
        side_u = NODE_W / 2 if nodes[u].kind not in ("add", "cat") else CIRCLE_R
        if kind == "straight":
            d = f"M{_f(ux_)},{_f(uy_ + hu)} L{_f(vx_)},{_f(vy_ - hv - 1)}"
        elif kind == "curve":
            y_a, y_b = uy_ + hu, vy_ - hv - 1
            mid = (y_a + y_b) / 2
            d = f"M{_f(ux_)},{_f(y_a)} C{_f(ux_)},{_f(mid)} {_f(vx_)},{_f(mid)} {_f(vx_)},{_f(y_b)}"
        elif kind == "down-then-across":
            end_x = vx_ + (side_v + 1 if ux_ > vx_ else -side_v - 1)
            d = _corner_path([(ux_, uy_ + hu), (ux_, vy_), (end_x, vy_)])
        elif kind == "across-then-down":
            start_x = ux_ + (side_u if vx_ > ux_ else -side_u)
            d = _corner_path([(start_x, uy_), (vx_, uy_), (vx_, vy_ - hv - 1)])
        else:
            chan = channel_x(kind, slot)
            sign = -1 if kind == "left" else 1
            d = _corner_path([(ux_ + sign * side_u, uy_), (chan, uy_), (chan, vy_), (vx_ + sign * (side_v + 1), vy_)])
        out.append(f'<path d="{d}" fill="none" stroke="{MUTED}" stroke-width="1.4" marker-end="url(#{prefix}-arrow)"/>')

    # Nodes; those on the bound's min cut get a dashed ring first, so the node draws over its inner half.
    label_chars = int((NODE_W - 14) / (12 * MONO_CHAR))
    bound = result.identifiability
    on_cut = set(bound.cut_nodes) if bound is not None else set()
    for node_id in sorted(graph, key=lambda n: (rank[n], order[n])):
        node = nodes[node_id]
        px_, py_ = cx(node_id), cy(node_id)
        if node_id in on_cut:
            names = ", ".join(label for label in bound.bottleneck)
            half_w = (CIRCLE_R if node.kind in ("add", "cat") else NODE_W / 2) + 5
            half_h = half_height(node_id) + 5
            out.append(
                f'<rect class="cut" x="{_f(px_ - half_w)}" y="{_f(py_ - half_h)}" width="{_f(2 * half_w)}" '
                f'height="{_f(2 * half_h)}" rx="8" fill="none" stroke="{CUT}" stroke-width="2" '
                f'stroke-dasharray="5 3"><title>{x(f"on the min cut of the identifiability bound ({names})")}'
                f"</title></rect>"
            )
        row = rows.get(node_id) or (by_name.get(node.name) if node.kind == "layer" else None)
        if node.kind in ("add", "cat"):
            symbol = "+" if node.kind == "add" else "cat"
            merge_of = f" (merge of block {node.block})" if node.block else ""
            out.append(
                f'<g class="merge"><title>{x(node.name)}: {x(node.kind)}{x(merge_of)}</title>'
                f'<circle cx="{_f(px_)}" cy="{_f(py_)}" r="{CIRCLE_R}" fill="#ffffff" stroke="{MUTED}" '
                f'stroke-width="1.5"/><text x="{_f(px_)}" y="{_f(py_ + (5 if symbol == "+" else 3))}" '
                f'text-anchor="middle" font-size="{15 if symbol == "+" else 9}" font-weight="700" '
                f'fill="{INK}">{symbol}</text></g>'
            )
            continue
        left, upper = px_ - NODE_W / 2, py_ - NODE_H / 2
        critical = bool(row and row.critical)
        if node.kind in ("input", "output"):
            shape = "×".join(str(d) for d in result.input_shape) if node.kind == "input" else ""
            title = f"{node.name} {shape}".strip()
            out.append(
                f'<g class="io"><title>{x(title)}</title><rect x="{_f(left)}" y="{_f(upper)}" '
                f'width="{NODE_W}" height="{NODE_H}" rx="{NODE_H / 2}" fill="#1e293b"/>'
                f'<text x="{_f(px_)}" y="{_f(py_ + 4)}" text-anchor="middle" font-size="12" '
                f'fill="#ffffff">{x(_truncate(title, 26))}</text></g>'
            )
            continue
        if node.kind == "projection":
            fill, stroke, dash, width_ = "#f5f3ff", "#6d28d9", ' stroke-dasharray="5 3"', 1.5
            detail = f"{node.op} · projection, |W| folded"
        elif critical:
            fill, stroke, dash, width_ = WARN_LIGHT, WARN, "", 2.5
            detail = f"{node.op} · RA_i {fmt_int(row.ra_i)} · critical"
        elif row is not None and row.dense:
            fill, stroke, dash, width_ = "#f1f5f9", DENSE, "", 1.2
            detail = f"{node.op} · dense"
        else:
            fill, stroke, dash, width_ = "#ffffff", "#94a3b8", "", 1.2
            detail = f"{node.op} · RA_i {fmt_int(row.ra_i)}" if row is not None else node.op
        tooltip = _row_tooltip(row) if row is not None else f"{node.name} ({node.op}, {node.kind})"
        name_fill = WARN if critical else INK
        out.append(
            f'<g class="node{" critical" if critical else ""}"><title>{x(tooltip)}</title>'
            f'<rect x="{_f(left)}" y="{_f(upper)}" width="{NODE_W}" height="{NODE_H}" rx="5" fill="{fill}" '
            f'stroke="{stroke}" stroke-width="{width_}"{dash}/>'
            f'<text x="{_f(px_)}" y="{_f(upper + 15)}" text-anchor="middle" font-size="12" '
            f'font-family="{x(MONO)}" fill="{name_fill}" font-weight="{700 if critical else 600}">'
            f"{x(_truncate(node.name, label_chars))}</text>"
            f'<text x="{_f(px_)}" y="{_f(upper + 29)}" text-anchor="middle" font-size="10" '
            f'fill="{WARN if critical else MUTED}">{x(_truncate(detail, 34))}</text></g>'
        )
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# GDBR: recovered vs true label counts
# ---------------------------------------------------------------------------------------------------------------


def _class_key(label: str):
    try:
        return (0, int(label), "")
    except ValueError:
        return (1, 0, label)


def label_counts(recovered: dict, true: dict, prefix: str = "l") -> str:
    """Grouped bars per class: the true count (grey) beside GDBR's recovered count (blue); mismatches marked."""
    recovered = {str(k): int(v) for k, v in (recovered or {}).items()}
    true = {str(k): int(v) for k, v in (true or {}).items()}
    classes = sorted(set(recovered) | set(true), key=_class_key)
    if not classes:
        return ""
    top_count = max([1, *recovered.values(), *true.values()])
    group, bar = 40, 14
    left, top, bottom, right = 36, 14, 42, 10
    plot_h = 150
    width = left + group * len(classes) + right
    height = top + plot_h + bottom
    out = [_svg_open(width, height, "GDBR recovered vs true label counts", "bars", min_width=min(width, 320))]
    step = max(1, math.ceil(top_count / 5))
    for tick in range(0, top_count + 1, step):
        ty = top + plot_h - tick / top_count * plot_h
        out.append(
            f'<line x1="{left}" y1="{_f(ty)}" x2="{_f(width - right)}" y2="{_f(ty)}" stroke="{GRID}"/>'
            f'<text x="{left - 6}" y="{_f(ty + 3)}" text-anchor="end" font-size="10" fill="{MUTED}">'
            f"{tick}</text>"
        )
    for i, label in enumerate(classes):
        gx = left + i * group + (group - 2 * bar - 2) / 2
        got, want = recovered.get(label, 0), true.get(label, 0)
        for j, (value, colour, what) in enumerate(((want, "#94a3b8", "true"), (got, "#2563eb", "recovered"))):
            h = value / top_count * plot_h
            out.append(
                f'<rect x="{_f(gx + j * (bar + 2))}" y="{_f(top + plot_h - h)}" width="{bar}" '
                f'height="{_f(max(h, 0))}" fill="{colour}"><title>class {x(label)}: {what} {value} '
                f"(recovered {got}, true {want})</title></rect>"
            )
        mismatch = got != want
        weight = ' font-weight="700"' if mismatch else ""
        out.append(
            f'<text x="{_f(left + i * group + group / 2)}" y="{_f(top + plot_h + 15)}" text-anchor="middle" '
            f'font-size="11" fill="{WARN if mismatch else INK}"{weight}>{x(label)}</text>'
        )
        if mismatch:
            out.append(
                f'<text x="{_f(left + i * group + group / 2)}" y="{_f(top + plot_h + 28)}" '
                f'text-anchor="middle" font-size="10" fill="{WARN}">{got - want:+d}</text>'
            )
    out.append(f'<line x1="{left}" y1="{top + plot_h}" x2="{_f(width - right)}" y2="{top + plot_h}" stroke="{INK}"/>')
    out.append(
        f'<text x="{_f(left + (width - left - right) / 2)}" y="{_f(height - 2)}" text-anchor="middle" '
        f'font-size="10" fill="{MUTED}">class (red: recovered count differs, by the amount shown)</text>'
    )
    out.append("</svg>")
    return "".join(out)


# ---------------------------------------------------------------------------------------------------------------
# Differential privacy: the bound B(κ) over the prior κ
# ---------------------------------------------------------------------------------------------------------------

DP_CURVE = "#2563eb"
DP_BASELINE = "#94a3b8"


def dp_curve(dp: DPBound, attack: dict | None = None) -> str:
    """B(κ) against κ on log-log axes (1e-4 to 1), the guessing baseline B = κ dashed, the user's prior marked,
    --max-reconstruction as a horizontal line, and --verify dp's measured success with its interval at κ = 1/M.
    It defines no ids, so it needs no prefix."""
    points = [(k, b) for k, b in dp.curve if k > 0 and b > 0]
    if not points:
        return ""
    width, height = 560, 300
    left, right, top, bottom = 56, 16, 14, 46
    low_exp, high_exp = -4, 0

    def px(kappa: float) -> float:
        share = (math.log10(kappa) - low_exp) / (high_exp - low_exp)
        return left + min(max(share, 0.0), 1.0) * (width - left - right)

    def py(value: float) -> float:
        share = (math.log10(max(value, 10.0**low_exp)) - low_exp) / (high_exp - low_exp)
        return top + (1 - min(max(share, 0.0), 1.0)) * (height - top - bottom)

    label = f"DP bound B(κ) over the prior κ: {len(points)} points, B({dp.prior:g}) = {dp.reconstruction_bound:.3g}"
    out = [_svg_open(width, height, label, "dpcurve", 300, grow=1.5)]
    for exponent in range(low_exp, high_exp + 1):
        value = 10.0**exponent
        out.append(
            f'<line x1="{_f(px(value))}" y1="{top}" x2="{_f(px(value))}" y2="{height - bottom}" '
            f'stroke="{GRID}"/><line x1="{left}" y1="{_f(py(value))}" x2="{width - right}" '
            f'y2="{_f(py(value))}" stroke="{GRID}"/>'
            f'<text x="{_f(px(value))}" y="{height - bottom + 16}" text-anchor="middle" font-size="11" '
            f'fill="{MUTED}">{x(f"{value:g}")}</text>'
            f'<text x="{left - 6}" y="{_f(py(value) + 4)}" text-anchor="end" font-size="11" '
            f'fill="{MUTED}">{x(f"{value:g}")}</text>'
        )
    out.append(
        f'<text x="{_f(left + (width - left - right) / 2)}" y="{height - 6}" text-anchor="middle" '
        f'font-size="11" fill="{INK}">prior κ: an attack\'s success without the update</text>'
    )
    out.append(
        f'<text x="14" y="{_f(top + (height - top - bottom) / 2)}" text-anchor="middle" font-size="11" '
        f'fill="{INK}" transform="rotate(-90 14 {_f(top + (height - top - bottom) / 2)})">bound B(κ)</text>'
    )
    out.append(
        f'<line x1="{_f(px(1e-4))}" y1="{_f(py(1e-4))}" x2="{_f(px(1))}" y2="{_f(py(1))}" '
        f'stroke="{DP_BASELINE}" stroke-dasharray="5 4"><title>B = κ: guessing, what no noise can go below'
        f"</title></line>"
    )
    if dp.max_reconstruction is not None:
        ceiling = py(dp.max_reconstruction)
        out.append(
            f'<line x1="{left}" y1="{_f(ceiling)}" x2="{width - right}" y2="{_f(ceiling)}" stroke="{WARN}" '
            f'stroke-dasharray="2 3"><title>{x(f"--max-reconstruction {dp.max_reconstruction:g}")}</title>'
            f'</line><text x="{width - right - 4}" y="{_f(ceiling - 5)}" text-anchor="end" font-size="11" '
            f'fill="{WARN}">{x(f"max {dp.max_reconstruction:g}")}</text>'
        )
    path = " ".join(f"{'M' if i == 0 else 'L'}{_f(px(k))} {_f(py(b))}" for i, (k, b) in enumerate(points))
    out.append(f'<path d="{path}" fill="none" stroke="{DP_CURVE}" stroke-width="2.5"/>')
    for kappa, bound in points:
        out.append(
            f'<circle cx="{_f(px(kappa))}" cy="{_f(py(bound))}" r="3" fill="{DP_CURVE}">'
            f"<title>{x(f'B({kappa:g}) = {bound:.3g}')}</title></circle>"
        )
    yours = f"your prior {dp.prior:g}: B = {dp.reconstruction_bound:.3g}"
    out.append(
        f'<circle cx="{_f(px(dp.prior))}" cy="{_f(py(dp.reconstruction_bound))}" r="6" fill="none" '
        f'stroke="{INK}" stroke-width="2"><title>{x(yours)}</title></circle>'
    )
    if attack and attack.get("candidates"):
        kappa = 1.0 / attack["candidates"]
        low, high = attack["interval"]
        cx = px(kappa) + 8
        rate, candidates = attack["success_rate"], attack["candidates"]
        tip = f"measured attack success {rate:.3f}, 95 % interval [{low:.3f}, {high:.3f}], at κ = 1/{candidates}"
        out.append(
            f'<g><title>{x(tip)}</title><line x1="{_f(cx)}" y1="{_f(py(low))}" x2="{_f(cx)}" '
            f'y2="{_f(py(high))}" stroke="{WARN}" stroke-width="2"/><rect x="{_f(cx - 4)}" '
            f'y="{_f(py(rate) - 4)}" width="8" height="8" fill="{WARN}"/></g>'
        )
    out.append("</svg>")
    return "".join(out)
