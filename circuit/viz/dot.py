"""`to_dot(report)`: the circuit DAG as Graphviz DOT. One DOT node per circuit node (every ID
quoted: names hold dots and '+'), a cluster per draft step, a dashed cluster around each fused
node listing its original parts and kernels, and one edge per value labelled with its spec."""
from __future__ import annotations

from pathlib import Path

from draft_circuit.circuit.report import NodeInfo, PlanReport
from draft_circuit.circuit.viz.graph import GROUPS, Edge, bands, edges, kernels, op_group, tint


def quote(text: str) -> str:
    """A DOT double-quoted ID; newlines become DOT's centred-line escape."""
    body = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + body.replace("\n", "\\n") + '"'


def attr_list(attrs: dict[str, str]) -> str:
    return "[" + ", ".join(f"{k}={quote(v)}" for k, v in attrs.items()) + "]"


def kernel_text(node: str, by_width: dict[int, dict[str, str]]) -> str:
    """"kernel: k" when every width picks the same one, else the pick per width."""
    picks = {w: ks[node] for w, ks in by_width.items() if node in ks}
    if len(set(picks.values())) <= 1:
        return f"kernel: {next(iter(picks.values()), '?')}"
    return "kernels: " + ", ".join(f"w{w} {k}" for w, k in sorted(picks.items()))


def node_stmt(n: NodeInfo, by_width: dict[int, dict[str, str]]) -> str:
    colour = GROUPS[op_group(n.op)][1]
    lines = [n.name, n.op] if not n.fused else [n.op, *(f"· {p}" for p in n.fused)]
    lines.append(kernel_text(n.name, by_width))
    attrs = {"label": "\n".join(lines), "fillcolor": tint(colour, 0.78), "color": colour,
             "tooltip": n.name}
    return f"{quote(n.name)} {attr_list(attrs)};"


def edge_stmt(e: Edge) -> str:
    attrs = {"label": e.spec, "tooltip": e.value}
    if e.state:
        attrs["style"] = "dashed"
    return f"{quote(e.src)} -> {quote(e.dst)} {attr_list(attrs)};"


def to_dot(report: PlanReport) -> str:
    by_width = kernels(report)
    title = (f"{report.circuit}: {report.num_nodes_after} nodes after "
             f"{len(report.pipeline)} passes ({report.num_nodes_before} before)")
    out = [f"digraph {quote(report.circuit)} {{",
           f"  graph {attr_list({'label': title, 'labelloc': 't', 'fontname': 'Helvetica', 'rankdir': 'TB'})};",
           '  node [shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10"];',
           '  edge [fontname="Helvetica", fontsize="8", color="#6b7280"];']
    num_fused = 0
    for band in bands(report):
        indent = "  "
        if band.step is not None:
            out.append(f"  subgraph {quote(f'cluster_{band.key}')} {{")
            out.append(f"    label={quote(band.key)}; style=\"rounded\"; color=\"#9ca3af\";")
            indent = "    "
        for n in band.nodes:
            if n.fused:  # one cluster per fused launch: the group the pass made
                out.append(f"{indent}subgraph {quote(f'cluster_fused_{num_fused}')} {{")
                out.append(f"{indent}  label={quote('fused ' + n.op)}; style=\"dashed,rounded\"; "
                           f"color={quote(GROUPS[op_group(n.op)][1])};")
                out.append(f"{indent}  {node_stmt(n, by_width)}")
                out.append(f"{indent}}}")
                num_fused += 1
            else:
                out.append(f"{indent}{node_stmt(n, by_width)}")
        if band.step is not None:
            out.append("  }")
    out += [f"  {edge_stmt(e)}" for e in edges(report)]
    out.append("}")
    return "\n".join(out) + "\n"


def write_dot(report: PlanReport, path: Path) -> Path:
    path = Path(path)
    path.write_text(to_dot(report))
    return path
