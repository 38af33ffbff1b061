"""`place_dag(report)`: the DAG drawing's boxes and frames: a column per draft step, nodes in rows
by their longest path inside it; full-width bands for nodes outside the steps. `routes.py` then
draws the edges in the row gaps and the lanes each column keeps at its right."""
from __future__ import annotations

from dataclasses import dataclass

from draft_circuit.circuit.report import NodeInfo, PlanReport
from draft_circuit.circuit.viz.graph import Band, Edge, bands, edges, kernels, short_name

CHAR_W = 6.6  # px per character at the 11px name font: DejaVu Sans' average, rounded up
SMALL_W = 6.0  # the same at 10px
BOX_PAD = 8
BOX_MIN_W = 56
LINE_H = 12.5  # the lines under a box's title
TITLE_Y = 14.0  # the title's baseline
PART_H = 15  # one original node in a fused box
H_GAP = 8
V_GAP = 28  # rows apart: room for two or three routed edges
LANE_W = 5.5
BAND_PAD = 12
BAND_HEAD = 38  # the label, and above row 0 the gap that routed edges arrive in
LANE_PAD = 6
OUTER = "outer"  # the lanes right of every column: edges from above the steps to below row 0
BAND_GAP = 34
MARGIN = 8.0


@dataclass
class Box:
    node: NodeInfo
    band: str
    row: int
    w: float
    h: float
    title: str  # the short name (or, fused, the op)
    lines: tuple[str, ...]  # fixed lines under the title: the op (none when fused)
    kernel: str  # the kernel line, the longest of any width (the page swaps it per width)
    parts: tuple[str, ...]  # a fused box's original nodes
    x: float = 0.0
    y: float = 0.0

    @property
    def bottom(self) -> float:
        return self.y + self.h

    @property
    def kernel_y(self) -> float:
        return TITLE_Y + LINE_H * (len(self.lines) + 1)

    @property
    def parts_y(self) -> float:
        return self.kernel_y + 6


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
    lane: str | None  # whose lanes it runs in (its column's, or OUTER); None: a straight curve
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
    lanes: dict[str, list[Route]]  # lane owner -> the routes through its lanes, innermost first


def size_box(n: NodeInfo, band: str, row: int, picks: list[str]) -> Box:
    """A box big enough for its longest kernel line at any width (JS swaps the text per width)."""
    title = n.op if n.fused else short_name(n.name, n.step)
    lines = () if n.fused else (n.op,)
    parts = tuple(short_name(p, n.step) for p in n.fused)
    kernel = max([kernel_line(n, k) for k in picks] or [""], key=len)
    text_w = max(CHAR_W * len(title), *(SMALL_W * len(t) for t in (*lines, kernel)),
                 *(SMALL_W * len(p) + 12 for p in parts))
    box = Box(n, band, row, max(BOX_MIN_W, text_w + 2 * BOX_PAD), 0.0, title, lines, kernel, parts)
    box.h = box.parts_y + PART_H * len(parts) + 2 if parts else box.kernel_y + 8
    return box


def kernel_line(n: NodeInfo, kernel: str) -> str:
    """A box's kernel line, less the op name it repeats (`triton_linear` on a linear: `triton`);
    the details panel and the DOT give it whole."""
    short = kernel
    if kernel != n.op:
        short = kernel.removeprefix(f"{n.op}_").removesuffix(f"_{n.op}") or kernel
    return f"kernel: {short}" if n.fused else short


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
    last_row: dict[str, int] = {}
    for b in boxes.values():
        last_row[b.band] = max(last_row.get(b.band, 0), b.row)
    routes = []
    for (src, dst), es in pairs.items():
        s, t = boxes[src], boxes[dst]
        in_step = s.node.step is not None
        if s.band == t.band:
            kind, lane = ("step", s.band) if in_step else ("band", None)
            lane = lane if t.row != s.row + 1 else None
        elif in_step and t.node.step is not None:
            kind, lane = "cross", s.band
        elif in_step:  # down to the band after the steps: straight from the column's last row
            kind, lane = "band", None if s.row == last_row[s.band] else s.band
        else:  # from the band before the steps: straight only to a step's first row
            kind, lane = "band", None if t.node.step is not None and t.row == 0 else OUTER
        routes.append(Route(tuple(es), kind, lane))
    return routes


def label_width(g: Band) -> float:
    """A step frame's title ("s0", bold 13px) and subtitle ("draft step 0", 11px) with padding."""
    return 2 * BAND_PAD + 8.5 * len(g.key) + 8 + CHAR_W * len(f"draft step {g.step}")


def lane_width(routes: list[Route]) -> float:
    return LANE_PAD + LANE_W * len(routes) if routes else 0.0


def place_dag(report: PlanReport) -> DagLayout:
    groups = bands(report)
    boxes = make_boxes(report, groups)
    routes = classify(report, boxes)
    lanes: dict[str, list[Route]] = {}
    for r in routes:
        if r.lane is not None:
            lanes.setdefault(r.lane, []).append(r)
    for rs in lanes.values():  # short spans inside, crossings outermost: fewer lane crossings
        rs.sort(key=lambda r: (r.kind != "step", boxes[r.dst].row - boxes[r.src].row, r.src))

    steps = [g for g in groups if g.step is not None]
    others = {g.key: g for g in groups if g.step is None}
    members = {g.key: [boxes[n.name] for n in g.nodes] for g in groups}
    col_w = {g.key: max(2 * BAND_PAD + inner_width(members[g.key]) + lane_width(lanes.get(g.key, [])),
                        label_width(g)) for g in steps}
    total_w = max(sum(col_w.values()) + H_GAP * max(len(steps) - 1, 0)
                  + lane_width(lanes.get(OUTER, [])),
                  *(2 * BAND_PAD + inner_width(members[k]) for k in others))
    frames: list[Frame] = []
    y = MARGIN
    if "before" in others:
        y = place_band(others["before"], members["before"], total_w, y, frames) + BAND_GAP
    if steps:
        y = place_columns(steps, members, col_w, lanes, y, frames) + BAND_GAP
    if "after" in others:
        y = place_band(others["after"], members["after"], total_w, y, frames) + BAND_GAP
    return DagLayout(total_w + 2 * MARGIN, y - BAND_GAP + MARGIN, boxes, frames, routes, lanes)


def place_columns(steps: list[Band], members: dict[str, list[Box]], col_w: dict[str, float],
                  lanes: dict[str, list[Route]], y: float, frames: list[Frame]) -> float:
    """The draft steps side by side, as tall as the tallest; returns their bottom."""
    x, heights, first = MARGIN, [], len(frames)
    for g in steps:
        inner = col_w[g.key] - 2 * BAND_PAD - lane_width(lanes.get(g.key, []))
        heights.append(place_rows(members[g.key], x + BAND_PAD, y + BAND_HEAD, inner))
        frames.append(Frame(g.key, g.label, g.step, x, y, col_w[g.key], 0.0))
        x += col_w[g.key] + H_GAP
    for f in frames[first:]:
        f.h = BAND_HEAD + max(heights) + BAND_PAD
    return y + BAND_HEAD + max(heights) + BAND_PAD


def place_band(g: Band, members: list[Box], total_w: float, y: float, frames: list[Frame]) -> float:
    """A full-width band outside the steps; returns its bottom."""
    h = BAND_HEAD + place_rows(members, MARGIN + BAND_PAD, y + BAND_HEAD,
                               total_w - 2 * BAND_PAD) + BAND_PAD
    frames.append(Frame(g.key, g.label, None, MARGIN, y, total_w, h))
    return y + h
