"""Read-only views of a `PlanReport` that every renderer shares: node-to-node edges, the bands a
DAG is drawn in (draft steps, and what runs before or after them), per-width kernels, live arena
bytes per launch and the op-group palette (by registry tags). Nothing here plans or costs
anything again."""
from __future__ import annotations

from dataclasses import dataclass

from draft_circuit.circuit.report import NodeInfo, PlanReport, WidthReport
from draft_circuit.ops.registry import (ATTENTION, ELEMENTWISE, GATHER, LAYOUT, MATMUL, NORM, REGISTRY,
                                        SAMPLING)

# (registry tag, group): an op is drawn in the group of the first of its tags listed here. A
# presentational table over the registry's declared tags: an op the registry does not know (a
# report from another build) or whose tags match no row is drawn as "other", never refused.
GROUP_RULES: tuple[tuple[str, str], ...] = (
    (ATTENTION, "attention"), (MATMUL, "matmul"), (SAMPLING, "sampling"), (NORM, "norm"),
    (GATHER, "layout"), (LAYOUT, "layout"), (ELEMENTWISE, "elementwise"),
)
# group -> (legend label, colour); Tableau-10 hues, distinguishable in print and for most CVD
GROUPS: dict[str, tuple[str, str]] = {
    "matmul": ("matmul", "#4e79a7"),
    "norm": ("normalisation", "#59a14f"),
    "attention": ("attention / KV", "#e15759"),
    "sampling": ("sampling", "#b07aa1"),
    "layout": ("gather / layout", "#f28e2b"),
    "elementwise": ("elementwise", "#76b7b2"),
    "other": ("other", "#9c9c9c"),
}


def op_group(op: str) -> str:
    """The palette group of `op`, from its registry tags."""
    tags = REGISTRY[op].tags if op in REGISTRY else frozenset()
    return next((group for tag, group in GROUP_RULES if tag in tags), "other")


def tint(colour: str, white: float) -> str:
    """`colour` (#rrggbb) mixed with `white` parts of white, for fills under dark text."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * white):02x}" for c in rgb)


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    value: str
    spec: str  # the value's printed spec, as the consumer's shapes give it
    state: bool  # a state value (KV cache...): threaded through steps, drawn dashed


def value_kinds(report: PlanReport) -> dict[str, str]:
    """Value -> where the first width's program keeps it (arena, input, output, param, state);
    a launch's slots are in its node's input and output order."""
    launches = {x.node: x for x in report.widths[0].schedule} if report.widths else {}
    kinds: dict[str, str] = {}
    for n in report.nodes:
        x = launches.get(n.name)
        if x is not None:
            for v, slot in zip((*n.inputs, *n.outputs), (*x.inputs, *x.outputs)):
                kinds.setdefault(v, slot.where)
    return kinds


def edges(report: PlanReport) -> list[Edge]:
    """One edge per (producer, consumer, value); values no node produces (params, inputs, the
    initial states) are not edges."""
    producer = {v: n.name for n in report.nodes for v in n.outputs}
    kinds = value_kinds(report)
    out: list[Edge] = []
    for n in report.nodes:
        for v in dict.fromkeys(n.inputs):  # a value read twice by one node is one edge
            if v in producer:
                out.append(Edge(producer[v], n.name, v, n.shapes.get(v, "?"),
                                kinds.get(v) == "state"))
    return out


@dataclass(frozen=True)
class Band:
    key: str  # "before", "s0", "s1", ..., "after"
    label: str
    step: int | None
    nodes: tuple[NodeInfo, ...]  # in the report's (topological) order


def bands(report: PlanReport) -> list[Band]:
    """Nodes grouped by draft step; a node outside the steps goes before them unless it reads
    (transitively) from a step, in which case it goes after."""
    producer = {v: n.name for n in report.nodes for v in n.outputs}
    after: set[str] = set()
    for n in report.nodes:  # topological: producers are classified before their users
        preds = [producer[v] for v in n.inputs if v in producer]
        if n.step is not None or any(p in after for p in preds):
            after.add(n.name)
    steps = sorted({n.step for n in report.nodes if n.step is not None})
    out = [Band("before", "before the steps", None,
                tuple(n for n in report.nodes if n.step is None and n.name not in after))]
    out += [Band(f"s{s}", f"s{s}", s, tuple(n for n in report.nodes if n.step == s)) for s in steps]
    out.append(Band("after", "after the steps", None,
                    tuple(n for n in report.nodes if n.step is None and n.name in after)))
    return [b for b in out if b.nodes]


def kernels(report: PlanReport) -> dict[int, dict[str, str]]:
    """Width -> node -> the kernel its launch uses at that width."""
    return {w.width: {x.node: x.kernel for x in w.schedule} for w in report.widths}


def live_bytes(w: WidthReport, alignment: int) -> list[int]:
    """Arena bytes live at each launch of `w`, each buffer rounded up to `alignment` as the
    planner counts it (so the peak is the plan's lower bound)."""
    live = [0] * (max([len(w.schedule), *(b["last"] + 1 for b in w.buffers)]) + 1)
    for b in w.buffers:  # difference array: +size at first, -size after last
        size = -(-b["size_bytes"] // alignment) * alignment
        live[b["first"]] += size
        live[b["last"] + 1] -= size
    for i in range(1, len(live)):
        live[i] += live[i - 1]
    return live[:len(w.schedule)]


def short_name(name: str, step: int | None) -> str:
    """`name` without its `sN.` scope, which the step band already says."""
    prefix = f"s{step}."
    return name[len(prefix):] if step is not None and name.startswith(prefix) else name
