"""`write_html(report, path)`: plan.html, one self-contained page (inline CSS, JS and SVG; the
report embedded as JSON; nothing fetched) showing the DAG by draft step, a width's arena plan
over schedule time, the per-width table and, on hover or click, a node's attrs, shapes, cost and
the layer line that built it."""
from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

from draft_circuit.circuit.report import PlanReport, WidthReport
from draft_circuit.circuit.viz.graph import GROUPS, op_group, tint
from draft_circuit.circuit.viz.layout import kernel_line
from draft_circuit.circuit.viz.svg import EDGE_COLOURS, dag_svg

STATIC = Path(__file__).with_name("static")
NONE = "—"  # a value the report does not have (capture time before a GPU run)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 2**10:.1f} KiB"


def json_script(element_id: str, data: Any) -> str:
    # "<" never appears raw, so neither "</script>" nor "<!--" can end the element early
    text = json.dumps(data, sort_keys=True, separators=(",", ":")).replace("<", "\\u003c")
    return f'<script type="application/json" id="{element_id}">{text}</script>'


def width_row(w: WidthReport) -> str:
    cells = [
        (str(w.width), ""), (str(w.launches), ""), (f"{w.launches_per_step:g}", ""),
        (str(w.gpu_launches), f"{w.gpu_launches_per_step:g} a step; {w.reference_launches} "
                              "reference launches (torch ops) not counted"),
        (_kib(w.arena_bytes), f"{w.arena_bytes} B, {w.strategy}"),
        (_kib(w.lower_bound_bytes), f"{w.lower_bound_bytes} B"),
        (_kib(w.naive_bytes), f"{w.naive_bytes} B: every temp its own buffer"),
        (f"{w.arena_bytes / max(w.lower_bound_bytes, 1):.3f}", ""),
        (_kib(w.bytes_moved), f"{w.bytes_moved} B"), (f"{w.floor_us:.2f}", ""),
        (NONE if w.capture_ms is None else f"{w.capture_ms:.2f}", ""),
        (NONE if w.graph_pool_bytes is None else _kib(w.graph_pool_bytes),
         "" if w.graph_pool_bytes is None else f"{w.graph_pool_bytes} B reserved by the graph pool"),
    ]
    tds = "".join(f'<td title="{escape(t, quote=True)}">{escape(c)}</td>' if t else
                  f"<td>{escape(c)}</td>" for c, t in cells)
    return f'<tr data-width="{w.width}" tabindex="0">{tds}</tr>'


def choices_table(report: PlanReport) -> str:
    """The measured kernel choices of every width (empty without a tuning pass)."""
    rows = "".join(
        f"<tr><td>{w.width}</td><td>{escape(c.node)}</td><td>{escape(c.kernel)}</td>"
        f"<td>{escape(', '.join(f'{k} {us:.1f}' for k, us in sorted(c.us.items())) or NONE)}</td>"
        f"<td>{escape(c.why)}</td></tr>"
        for w in report.widths for c in w.kernel_choices)
    if not rows:
        return ('<p class="note" id="kernel-choices">Kernel choice: the first applicable binding '
                "(no tuning pass; CompileOptions(tuning=\"measure\") times the candidates on the GPU).</p>")
    head = "".join(f"<th>{h}</th>" for h in ("width", "node", "kernel", "measured µs", "why"))
    return f'<table id="kernel-choices"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>'


def width_table(report: PlanReport) -> str:
    head = ["width", "launches", "launches / step", "GPU kernels", "arena", "lower bound", "naive",
            "arena / lower", "bytes moved", "floor µs", "capture ms", "graph pool"]
    ths = "".join(f"<th>{escape(h)}</th>" for h in head)
    rows = "".join(width_row(w) for w in report.widths)
    return f'<table id="width-table"><thead><tr>{ths}</tr></thead><tbody>{rows}</tbody></table>'


def swatch(label: str, colour: str, white: float = 0.8) -> str:
    return (f'<span class="key"><span class="swatch" style="background:{tint(colour, white)};'
            f'border-color:{colour}"></span>{escape(label)}</span>')


def legend(report: PlanReport) -> str:
    present = dict.fromkeys(op_group(n.op) for n in report.nodes)
    keys = [swatch(GROUPS[g][0], GROUPS[g][1]) for g in GROUPS if g in present]
    keys.append('<span class="key"><span class="swatch fused-key"></span>fused launch '
                '(parts listed, kernel at the chosen width)</span>')
    edge_keys = [("step", "inside a step", ""), ("cross", "across steps", ""),
                 ("band", "to / from outside the steps", ""), ("step", "state (KV cache)", "4 3")]
    for kind, label, dash in edge_keys:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        keys.append(f'<span class="key"><svg width="26" height="10" aria-hidden="true"><line x1="1" '
                    f'y1="5" x2="25" y2="5" stroke="{EDGE_COLOURS[kind]}" stroke-width="2"'
                    f'{dash_attr}/></svg>{escape(label)}</span>')
    return f'<div class="legend">{"".join(keys)}</div>'


def memory_legend(report: PlanReport) -> str:
    present = dict.fromkeys(op_group(n.op) for n in report.nodes)
    keys = [swatch(f"written by {GROUPS[g][0]}", GROUPS[g][1], 0.2) for g in GROUPS if g in present]
    lines = [("this width's arena", "#1f2430", ""), ("lower bound", "#d62728", "6 4")]
    for label, colour, dash in lines:
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        keys.append(f'<span class="key"><svg width="26" height="10" aria-hidden="true"><line x1="1" '
                    f'y1="5" x2="25" y2="5" stroke="{colour}" stroke-width="2"{dash_attr}/></svg>'
                    f"{escape(label)}</span>")
    return f'<div class="legend">{"".join(keys)}</div>'


def header(report: PlanReport) -> str:
    bw = report.options.get("bandwidth_gbps")
    chips = [f"{report.num_nodes_after} nodes ({report.num_nodes_before} before the passes)",
             f"device {report.device}", f"shared arena {_kib(report.arena_bytes)}",
             f"floor at {bw:g} GB/s" if isinstance(bw, (int, float)) else "",
             f"fingerprint {report.fingerprint[:12]}"]
    passes = " → ".join(report.pipeline) or "no passes"
    options = "".join(f'<option value="{w.width}">{w.width}</option>' for w in report.widths)
    return (f'<header><div class="title"><h1>{escape(report.circuit)}</h1>'
            f'<div class="chips">{"".join(f"<span>{escape(c)}</span>" for c in chips if c)}</div>'
            f'<div class="passes">passes: {escape(passes)}</div></div>'
            f'<label class="pick">width <select id="width-select">{options}</select></label>'
            f"</header>")


def view_data(report: PlanReport) -> dict[str, Any]:
    """What the script needs beyond the report: each box's kernel line per width, the op groups,
    the palette and the width the page opens on."""
    infos = {n.name: n for n in report.nodes}
    lines = {str(w.width): {x.node: kernel_line(infos[x.node], x.kernel)
                            for x in w.schedule if x.node in infos} for w in report.widths}
    return {"default_width": max((w.width for w in report.widths), default=0),
            "kernel_lines": lines,
            "groups": {x.op: op_group(x.op) for w in report.widths for x in w.schedule},
            "colours": {g: [c, tint(c, 0.8)] for g, (_, c) in GROUPS.items()},
            "bandwidth_gbps": report.options.get("bandwidth_gbps")}


def render_html(report: PlanReport) -> str:
    css = (STATIC / "page.css").read_text()
    js = (STATIC / "page.js").read_text()
    body = f"""{header(report)}
<main>
<section class="card" id="widths"><h2>Per-width plan</h2>{width_table(report)}
<p class="note">Arena: this width's plan (the shared arena is the largest). Lower bound: the peak of
aligned bytes live at once. Floor: bytes moved over the bandwidth. Capture: filled in by a GPU run.</p>
{choices_table(report)}
</section>
<div class="grid"><div class="column">
<section class="card" id="dag-section"><h2>Circuit by draft step</h2>{legend(report)}
<div class="scroll">{dag_svg(report)}</div></section>
<section class="card" id="memory-section"><h2>Arena plan at width <span id="memory-width"></span>
</h2><p class="note">Each rectangle is an arena buffer: live from its first to its last launch
(x) at its offset (y), coloured by the op that writes it; shaded bands are the draft steps.</p>
{memory_legend(report)}<div id="memory"></div></section>
</div>
<aside class="card" id="details"><h2>Details</h2><div id="detail-body"></div></aside>
</div></main>"""
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(report.circuit)}: plan</title>
<style>{css}</style></head>
<body>
{body}
{json_script("plan-report", report.model_dump(mode="json"))}
{json_script("viz-view", view_data(report))}
<script>{js}</script>
</body></html>
"""


def write_html(report: PlanReport, path: Path) -> Path:
    path = Path(path)
    path.write_text(render_html(report), encoding="utf-8")
    return path
