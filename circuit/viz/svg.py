"""`dag_svg(report)`: the circuit DAG as inline SVG markup, laid out by draft step. Every node is
a `<g class="node" data-node=NAME>` titled with its full name, with a kernel line (`data-kernel`)
that the page's script rewrites for the chosen width; fused nodes also list their parts."""
from __future__ import annotations

from html import escape

from draft_circuit.circuit.report import PlanReport
from draft_circuit.circuit.viz.graph import GROUPS, op_group, tint
from draft_circuit.circuit.viz.layout import LINE_H, PART_H, TITLE_Y, Box, DagLayout, Frame, Route, place_dag
from draft_circuit.circuit.viz.routes import route_dag

# edge kind -> stroke colour; the arrowhead marker of the same name matches it
EDGE_COLOURS = {"step": "#7b8494", "cross": "#c77c11", "band": "#5b6b8c"}


def _a(text: object) -> str:
    return escape(str(text), quote=True)


def markers() -> str:
    return "".join(
        f'<marker id="arrow-{kind}" viewBox="0 0 8 8" refX="7" refY="4" markerWidth="7" '
        f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L8,4 L0,8 z" '
        f'fill="{colour}"/></marker>' for kind, colour in EDGE_COLOURS.items())


def frame_svg(f: Frame) -> str:
    sub = "" if f.step is None else f"draft step {f.step}"
    return (f'<g class="band" data-band="{_a(f.key)}"><rect x="{f.x:.1f}" y="{f.y:.1f}" '
            f'width="{f.w:.1f}" height="{f.h:.1f}" rx="10"/>'
            f'<text class="band-title" x="{f.x + 12:.1f}" y="{f.y + 19:.1f}">{_a(f.label)}'
            f'<tspan class="band-sub" dx="8">{_a(sub)}</tspan></text></g>')


def route_svg(r: Route) -> str:
    state = " state" if all(e.state for e in r.edges) else ""
    tip = "\n".join(f"{e.value}: {e.spec}" for e in r.edges)
    return (f'<path class="edge e-{r.kind}{state}" d="{r.d}" data-src="{_a(r.src)}" '
            f'data-dst="{_a(r.dst)}" marker-end="url(#arrow-{r.kind})"><title>{_a(tip)}</title>'
            f'</path>')


def box_svg(b: Box) -> str:
    n = b.node
    group = op_group(n.op)
    colour = GROUPS[group][1]
    cx = b.w / 2
    fused = " fused" if n.fused else ""
    out = [f'<g class="node g-{group}{fused}" data-node="{_a(n.name)}" data-op="{_a(n.op)}" '
           f'tabindex="0" transform="translate({b.x:.1f},{b.y:.1f})"><title>{_a(n.name)}</title>']
    if n.fused:  # the group frame: what the pass merged into one launch
        out.append(f'<rect class="fuse-frame" x="-4" y="-4" width="{b.w + 8:.1f}" '
                   f'height="{b.h + 8:.1f}" rx="9" stroke="{colour}"/>')
    out.append(f'<rect class="box" width="{b.w:.1f}" height="{b.h:.1f}" rx="6" '
               f'fill="{tint(colour, 0.8)}" stroke="{colour}"/>')
    out.append(f'<text class="n-title" x="{cx:.1f}" y="{TITLE_Y}">{_a(b.title)}</text>')
    for i, line in enumerate(b.lines):
        out.append(f'<text class="n-op" x="{cx:.1f}" y="{TITLE_Y + LINE_H * (i + 1):.1f}">'
                   f"{_a(line)}</text>")
    out.append(f'<text class="n-kernel" data-kernel="" x="{cx:.1f}" y="{b.kernel_y:.1f}">'
               f"{_a(b.kernel)}</text>")
    for i, part in enumerate(b.parts):
        y = b.parts_y + i * PART_H
        out.append(f'<rect class="part" x="6" y="{y:.1f}" width="{b.w - 12:.1f}" '
                   f'height="{PART_H - 2}" rx="3"/><text class="n-part" x="{cx:.1f}" '
                   f'y="{y + 9.5:.1f}">{_a(part)}</text>')
    out.append("</g>")
    return "".join(out)


def layout_svg(layout: DagLayout, label: str) -> str:
    w, h = layout.width, layout.height
    return "".join([
        f'<svg id="dag" viewBox="0 0 {w:.0f} {h:.0f}" '
        f'width="{w:.0f}" height="{h:.0f}" role="img" aria-label="{_a(label)}">',
        f"<defs>{markers()}</defs>",
        '<g class="bands">', *(frame_svg(f) for f in layout.frames), "</g>",
        '<g class="edges">', *(route_svg(r) for r in layout.routes), "</g>",
        '<g class="nodes">', *(box_svg(b) for b in layout.boxes.values()), "</g>",
        "</svg>"])


def dag_svg(report: PlanReport) -> str:
    layout = place_dag(report)
    route_dag(layout)
    return layout_svg(layout, f"{report.circuit}: the circuit DAG by draft step")
