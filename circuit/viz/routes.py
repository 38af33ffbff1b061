"""`route_dag(layout)`: an SVG path for every route of a placed DAG. Edges leave a box's bottom
and enter the next box's top; one that skips rows or crosses steps drops into the gap below its
row, runs in a lane (its column's, or right of all of them) and arrives through the gap above its
target's row."""
from __future__ import annotations

from draft_circuit.circuit.viz.layout import BAND_PAD, LANE_W, MARGIN, OUTER, V_GAP, DagLayout, Route

CORNER = 6.0
GAP_IN = V_GAP / 3  # leaving runs this far below a row, arriving this far above one: no overlap


def _p(x: float, y: float) -> str:
    return f"{x:.1f},{y:.1f}"


def rounded(points: list[tuple[float, float]], r: float = CORNER) -> str:
    """An orthogonal polyline with its corners rounded (quadratic, radius at most half a leg)."""
    d = [f"M{_p(*points[0])}"]
    for prev, at, nxt in zip(points, points[1:], points[2:]):
        legs = [abs(at[0] - prev[0]) + abs(at[1] - prev[1]), abs(nxt[0] - at[0]) + abs(nxt[1] - at[1])]
        k = min(r, legs[0] / 2, legs[1] / 2)
        if k <= 0:
            continue
        a = (at[0] - k * _sign(at[0] - prev[0]), at[1] - k * _sign(at[1] - prev[1]))
        b = (at[0] + k * _sign(nxt[0] - at[0]), at[1] + k * _sign(nxt[1] - at[1]))
        d.append(f"L{_p(*a)} Q{_p(*at)} {_p(*b)}")
    d.append(f"L{_p(*points[-1])}")
    return " ".join(d)


def _sign(v: float) -> float:
    return (v > 0) - (v < 0)


def curve(a: tuple[float, float], b: tuple[float, float]) -> str:
    """A vertical S-curve from a box's bottom to another's top."""
    dy = max(12.0, (b[1] - a[1]) / 2)
    return f"M{_p(*a)} C{_p(a[0], a[1] + dy)} {_p(b[0], b[1] - dy)} {_p(*b)}"


def lane_x(layout: DagLayout, r: Route) -> float:
    assert r.lane is not None
    rs = layout.lanes[r.lane]
    if r.lane == OUTER:
        right = layout.width - MARGIN
    else:
        right = next(f.x + f.w for f in layout.frames if f.key == r.lane) - BAND_PAD
    return right - LANE_W * (len(rs) - rs.index(r) - 0.5)


def attach(layout: DagLayout) -> dict[tuple[str, str, str], float]:
    """(src, dst, "out" | "in") -> x on the box edge: a box's edges spread along it, ordered by
    where their other end lies so that they do not cross at the box."""
    def far_x(r: Route, end: str) -> float:
        if r.lane is not None:
            return lane_x(layout, r)
        other = layout.boxes[r.dst if end == "out" else r.src]
        return other.x + other.w / 2
    ends: dict[tuple[str, str], list[Route]] = {}
    for r in layout.routes:
        ends.setdefault((r.src, "out"), []).append(r)
        ends.setdefault((r.dst, "in"), []).append(r)
    xs: dict[tuple[str, str, str], float] = {}
    for (name, end), rs in ends.items():
        box = layout.boxes[name]
        rs.sort(key=lambda r: far_x(r, end))
        for i, r in enumerate(rs):
            xs[(r.src, r.dst, end)] = box.x + box.w * (i + 1) / (len(rs) + 1)
    return xs


def route_dag(layout: DagLayout) -> None:
    row_bottom: dict[tuple[str, int], float] = {}
    for b in layout.boxes.values():  # a row's boxes share a top, not a bottom
        key = (b.band, b.row)
        row_bottom[key] = max(row_bottom.get(key, 0.0), b.bottom)
    xs = attach(layout)
    for r in layout.routes:
        s, t = layout.boxes[r.src], layout.boxes[r.dst]
        start, end = (xs[(r.src, r.dst, "out")], s.bottom), (xs[(r.src, r.dst, "in")], t.y)
        if r.lane is None:
            r.d = curve(start, end)
            continue
        lane = lane_x(layout, r)
        # a small per-lane offset keeps runs that share a gap from drawing over each other
        jitter = (layout.lanes[r.lane].index(r) % 3 - 1) * 2.5
        y_leave = row_bottom[(s.band, s.row)] + GAP_IN + jitter
        y_arrive = t.y - GAP_IN + jitter
        r.d = rounded([start, (start[0], y_leave), (lane, y_leave), (lane, y_arrive),
                       (end[0], y_arrive), end])
