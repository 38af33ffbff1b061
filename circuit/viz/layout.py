"""`place_dag(report)`: where the DAG drawing puts its boxes and frames (`routes.py` then draws
the edges). One column per draft step, nodes in
rows by their longest path inside the step; full-width bands above and below for nodes outside
the steps. Edges that skip rows or cross steps run orthogonally in the gaps and lanes between
boxes, never through one (rows of one step share their gaps, so this holds within a column)."""
from __future__ import annotations

from dataclasses import dataclass

from circuit.report import NodeInfo, PlanReport
from circuit.viz.graph import Band, Edge, bands, edges, kernels, short_name

CHAR_W = 6.6  # px per character at the 11px name font: DejaVu Sans' average, rounded up
SMALL_W = 6.0  # the same at 10px
BOX_PAD = 8
BOX_MIN_W = 64
BOX_H = 36  # name line + op/kernel line
PART_H = 15  # one original node in a fused box
H_GAP = 10
V_GAP = 28  # rows apart: room for two or three routed edges
LANE_W = 7
BAND_PAD = 12
BAND_HEAD = 34  # the label, and above row 0 the gap that routed edges arrive in
LANE_PAD = 6
BAND_GAP = 34
MARGIN = 8


@dataclass
class Box:
    node: NodeInfo
    band: str
    row: int
    w: float
    h: float
    title: str  # the short name (or, fused, the op)
    sub: str  # the op line (or, fused, the kernel line), as sized for its longest kernel
    parts: tuple[str, ...]
    x: float = 0.0
    y: float = 0.0

    @property
    def bottom(self) -> float:
        return self.y + self.h


@dataclass
class Frame:
    key: str
    label: str
    step: int | None
    x: float
    y: float
    w: float
    h: float


@dataclass
class Route:
    edges: tuple[Edge, ...]  # the values one (src, dst) pair carries
    kind: str  # "step" (inside a step), "cross" (between steps), "band" (to or from a band)
    lane: bool  # routed through the source column's lanes, not straight down
    d: str = ""

    @property
    def src(self) -> str:
        return self.edges[0].src

    @property
    def dst(self) -> str:
        return self.edges[0].dst


@dataclass
class DagLayout:
    width: float
    height: float
    boxes: dict[str, Box]
    frames: list[Frame]
    routes: list[Route]
    lanes: dict[str, list[Route]]  # band -> the routes through its lanes, innermost first


def size_box(n: NodeInfo, band: str, row: int, picks: list[str]) -> Box:
    """A box big enough for its longest kernel line at any width (JS swaps the text per width)."""
    if n.fused:
        title, subs = n.op, [f"kernel: {k}" for k in picks]
        parts = tuple(short_name(p, n.step) for p in n.fused)
    else:
        title, subs, parts = short_name(n.name, n.step), [kernel_line(n.op, k) for k in picks], ()
    sub = max(subs or [n.op], key=len)
    text_w = max(CHAR_W * len(title), SMALL_W * len(sub), *(SMALL_W * len(p) + 12 for p in parts))
    h = BOX_H + (PART_H * len(parts) + 4 if parts else 0)
    return Box(n, band, row, max(BOX_MIN_W, text_w + 2 * BOX_PAD), h, title, sub, parts)


def kernel_line(op: str, kernel: str) -> str:
    return op if kernel == "reference" else f"{op} · {kernel}"


def place_rows(boxes: list[Box], x0: float, y0: float, inner_w: float) -> float:
    """Rows top-down, each centred in [x0, x0 + inner_w]; returns the height used."""
    rows: dict[int, list[Box]] = {}
    for b in boxes:
        rows.setdefault(b.row, []).append(b)
    y = y0
    for r in sorted(rows):
        row = rows[r]
        x = x0 + (inner_w - row_width(row)) / 2
        for b in row:
            b.x, b.y = x, y
            x += b.w + H_GAP
        y += max(b.h for b in row) + V_GAP
    return y - y0 - V_GAP if rows else 0.0


def row_width(row: list[Box]) -> float:
    return sum(b.w for b in row) + H_GAP * (len(row) - 1)


def inner_width(boxes: list[Box]) -> float:
    rows: dict[int, list[Box]] = {}
    for b in boxes:
        rows.setdefault(b.row, []).append(b)
    return max((row_width(r) for r in rows.values()), default=0.0)


def make_boxes(report: PlanReport, groups: list[Band]) -> dict[str, Box]:
    picks = kernels(report)
    producer = {v: n.name for n in report.nodes for v in n.outputs}
    boxes: dict[str, Box] = {}
    for band in groups:
        rows: dict[str, int] = {}
        for n in band.nodes:  # longest path from the band's sources; topological order
            preds = [rows[producer[v]] for v in n.inputs if producer.get(v) in rows]
            rows[n.name] = 1 + max(preds) if preds else 0
            node_picks = sorted({ks[n.name] for ks in picks.values() if n.name in ks})
            boxes[n.name] = size_box(n, band.key, rows[n.name], node_picks)
    return boxes


def classify(report: PlanReport, boxes: dict[str, Box]) -> list[Route]:
    pairs: dict[tuple[str, str], list[Edge]] = {}
    for e in edges(report):
        pairs.setdefault((e.src, e.dst), []).append(e)
    last_row = {}
    for b in boxes.values():
        last_row[b.band] = max(last_row.get(b.band, 0), b.row)
    routes = []
    for (src, dst), es in pairs.items():
        s, t = boxes[src], boxes[dst]
        in_step = s.node.step is not None
        if s.band == t.band:
            kind, lane = "step" if in_step else "band", in_step and t.row != s.row + 1
        elif in_step and t.node.step is not None:
            kind, lane = "cross", True
        else:  # to or from a band outside the steps: straight unless boxes are in the way
            kind, lane = "band", in_step and s.row != last_row[s.band]
        routes.append(Route(tuple(es), kind, lane))
    return routes


def lane_width(routes: list[Route]) -> float:
    return LANE_PAD + LANE_W * len(routes) if routes else 0.0


def place_dag(report: PlanReport) -> DagLayout:
    groups = bands(report)
    boxes = make_boxes(report, groups)
    routes = classify(report, boxes)
    lanes: dict[str, list[Route]] = {}
    for r in routes:
        if r.lane:
            lanes.setdefault(boxes[r.src].band, []).append(r)
    for rs in lanes.values():  # short spans inside, crossings outermost: fewer lane crossings
        rs.sort(key=lambda r: (r.kind != "step", boxes[r.dst].row - boxes[r.src].row, r.src))

    steps = [g for g in groups if g.step is not None]
    others = {g.key: g for g in groups if g.step is None}
    members = {g.key: [boxes[n.name] for n in g.nodes] for g in groups}
    col_w = {g.key: 2 * BAND_PAD + inner_width(members[g.key]) + lane_width(lanes.get(g.key, []))
             for g in steps}
    total_w = max(sum(col_w.values()) + H_GAP * max(len(steps) - 1, 0),
                  *(2 * BAND_PAD + inner_width(members[k]) for k in others))
    frames: list[Frame] = []
    y = MARGIN
    if "before" in others:
        y = place_band(others["before"], members["before"], total_w, y, frames) + BAND_GAP
    if steps:
        x, heights = MARGIN, []
        for g in steps:
            inner = col_w[g.key] - 2 * BAND_PAD - lane_width(lanes.get(g.key, []))
            heights.append(place_rows(members[g.key], x + BAND_PAD, y + BAND_HEAD, inner))
            frames.append(Frame(g.key, g.label, g.step, x, y, col_w[g.key], 0.0))
            x += col_w[g.key] + H_GAP
        col_h = BAND_HEAD + max(heights) + BAND_PAD
        for f in frames[-len(steps):]:
            f.h = col_h
        y += col_h + BAND_GAP
    if "after" in others:
        y = place_band(others["after"], members["after"], total_w, y, frames) + BAND_GAP
    return DagLayout(total_w + 2 * MARGIN, y - BAND_GAP + MARGIN, boxes, frames, routes, lanes)


def place_band(g: Band, members: list[Box], total_w: float, y: float, frames: list[Frame]) -> float:
    """A full-width band outside the steps; returns its bottom."""
    h = BAND_HEAD + place_rows(members, MARGIN + BAND_PAD, y + BAND_HEAD,
                               total_w - 2 * BAND_PAD) + BAND_PAD
    frames.append(Frame(g.key, g.label, None, MARGIN, y, total_w, h))
    return y + h
