"""The fusion driver: `fuse(circuit, row)` applies one `Fusion` row (a producer -> consumer
pattern, a guard, a rewrite) of the table in circuit/passes/fusions.py.

It walks the row's producers in circuit order and, for each, the consumers its edge
allows. A match is taken only if the guard accepts it (a guard may absorb further nodes, as the
q rope of `fuse_rope_kv_write`) and if fusing it cannot close a cycle: no path may leave the
group and come back into it (groups taken earlier in the pass count as one node). The row's
rewrite gives the fused node's parts, inputs, outputs and attrs; the node takes the place of the
producer or of the consumer in circuit order.

`fuse_siblings(circuit, row)` applies a `Siblings` row: `count` nodes of one op reading the same
first input (q/k/v's linears of one normed row), grouped in circuit order; the fused node takes
the first sibling's place, so the row's guard admits only siblings whose other inputs are params
(available everywhere), and the cycle check still runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Literal

import networkx as nx

from draft_circuit.circuit.ir import Circuit, Node
from draft_circuit.circuit.passes.rewrite import fused_node, rewrite, sole_user


@dataclass(frozen=True)
class Match:
    producer: Node
    consumer: Node
    more: tuple[Node, ...] = ()  # further nodes the guard absorbed into the fusion

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.producer, self.consumer, *self.more)


# (circuit, candidate, nodes already fused by this pass) -> the match to take, or None
Guard = Callable[[Circuit, Match, "Taken"], "Match | None"]
# the fused node's parts (in the order its name lists them), inputs, outputs and attrs
Parts = tuple[tuple[Node, ...], tuple[str, ...], tuple[str, ...], dict[str, Any]]
Rewrite = Callable[[Match], Parts]


@dataclass(frozen=True)
class Fusion:
    """One row. `edge`: the consumer's input the producer's output `output` (its first unless
    said) feeds (and no other of its inputs); `sole_reader`: that output has no other reader and
    is no circuit output;
    `at`: which matched node's place in circuit order the fused node takes ("last": the latest
    of the match's nodes, guard-absorbed ones included, where every input they read exists)."""

    name: str        # the pass name, as pipelines and plan reports spell it
    doc: str         # the row's contract, one line
    producer: str    # op names (registered ops: tests/circuit/test_fusions.py checks)
    consumer: str
    edge: int
    sole_reader: bool
    fused_op: str
    rewrite: Rewrite
    at: Literal["producer", "consumer", "last"] = "consumer"
    guard: Guard | None = None
    output: int = 0

    def candidates(self, c: Circuit, producer: Node) -> Iterable[Node]:
        out = producer.outputs[self.output]
        if self.sole_reader and sole_user(c, out) is None:
            return ()
        return (u for u in c.users(out) if u.op == self.consumer and u.inputs[self.edge] == out
                and u.inputs.count(out) == 1)

    def as_pass(self) -> Callable[[Circuit], Circuit]:
        """The row as a pass: a pure Circuit -> Circuit function named like the row."""
        def run(c: Circuit) -> Circuit:
            return fuse(c, self)
        run.__name__ = run.__qualname__ = self.name
        run.__doc__ = f"{self.name}: {self.doc}"
        return run


class Taken:
    """The groups a pass has fused so far. Paths run through a taken group as through one node,
    so a later group is checked against the circuit those fusions will make.

    The search is local: with `idx` any topological order of the circuit, every path that leaves
    a group and comes back stays inside the group's index window widened by each taken group
    that straddles an end of it (leaving the window needs a real edge, which only climbs, and
    coming back needs a jump inside one taken group, which would straddle the window's end).
    """

    def __init__(self, c: Circuit) -> None:
        self._graph = c.graph  # data edges and state anti-edges: every order the circuit needs
        self._index = {name: i for i, name in enumerate(nx.topological_sort(self._graph))}
        self._group: dict[str, frozenset[str]] = {}
        self._spans: list[tuple[int, int]] = []  # each taken group's (lowest, highest) index

    def __contains__(self, name: str) -> bool:
        return name in self._group

    def _window(self, group: set[str]) -> tuple[int, int]:
        lo = min(self._index[n] for n in group)
        hi = max(self._index[n] for n in group)
        widened = True
        while widened:
            widened = False
            for a, b in self._spans:
                if a <= hi < b or a < lo <= b:
                    lo, hi, widened = min(lo, a), max(hi, b), True
        return lo, hi

    def closes_cycle(self, names: Iterable[str]) -> bool:
        """Fusing `names` into one node would make a cycle: a path leaves the group and comes
        back into it."""
        group = set(names)
        lo, hi = self._window(group)
        todo = [x for n in group for x in self._graph.successors(n) if x not in group]
        seen: set[str] = set()
        while todo:
            name = todo.pop()
            if name in group:
                return True
            if name in seen or not lo <= self._index[name] <= hi:
                continue
            members = self._group.get(name, frozenset((name,)))
            seen.update(members)
            todo.extend(x for m in members for x in self._graph.successors(m))
        return False

    def take(self, names: Iterable[str]) -> None:
        group = frozenset(names)
        for name in group:
            self._group[name] = group
        self._spans.append((min(self._index[n] for n in group), max(self._index[n] for n in group)))


def fuse(c: Circuit, row: Fusion) -> Circuit:
    """Every match of `row` in `c`, fused (the driver of the table)."""
    taken = Taken(c)
    order = {n.name: i for i, n in enumerate(c.nodes)}
    replacements: dict[str, Node | None] = {}
    for producer in c.nodes:
        if producer.op != row.producer or producer.name in taken:
            continue
        for consumer in row.candidates(c, producer):
            if consumer.name in taken:
                continue
            candidate = Match(producer, consumer)
            match = row.guard(c, candidate, taken) if row.guard is not None else candidate
            if match is None or _blocked(taken, match):
                continue
            taken.take(n.name for n in match.nodes)
            anchor = (match.producer if row.at == "producer" else match.consumer if row.at == "consumer"
                      else max(match.nodes, key=lambda n: order[n.name]))
            for n in match.nodes:
                replacements[n.name] = None
            parts, inputs, outputs, attrs = row.rewrite(match)
            replacements[anchor.name] = fused_node(
                "+".join(p.name for p in parts), row.fused_op, inputs, outputs, dict(attrs), parts)
            break
    return rewrite(c, replacements)


# (circuit, node) -> whether the node may be one of a Siblings row's group
SiblingGuard = Callable[[Circuit, Node], bool]
SiblingRewrite = Callable[[tuple[Node, ...]], Parts]


@dataclass(frozen=True)
class Siblings:
    """One row of sibling nodes: `count` nodes of `op` that read the same value as input 0."""

    name: str
    doc: str
    op: str
    count: int
    fused_op: str
    rewrite: SiblingRewrite
    guard: SiblingGuard

    def as_pass(self) -> Callable[[Circuit], Circuit]:
        def run(c: Circuit) -> Circuit:
            return fuse_siblings(c, self)
        run.__name__ = run.__qualname__ = self.name
        run.__doc__ = f"{self.name}: {self.doc}"
        return run


def fuse_siblings(c: Circuit, row: Siblings) -> Circuit:
    """Every group of `row.count` siblings in `c` (in circuit order; a remainder stays), fused."""
    taken = Taken(c)
    by_input: dict[str, list[Node]] = {}
    for n in c.nodes:
        if n.op == row.op and n.inputs and row.guard(c, n):
            by_input.setdefault(n.inputs[0], []).append(n)
    replacements: dict[str, Node | None] = {}
    for nodes in by_input.values():
        for i in range(0, len(nodes) - row.count + 1, row.count):
            group = tuple(nodes[i:i + row.count])
            names = [n.name for n in group]
            if any(n in taken for n in names) or taken.closes_cycle(names):
                continue
            taken.take(names)
            parts, inputs, outputs, attrs = row.rewrite(group)
            for n in group:
                replacements[n.name] = None
            replacements[group[0].name] = fused_node(
                "+".join(p.name for p in parts), row.fused_op, inputs, outputs, dict(attrs), parts)
    return rewrite(c, replacements)


def _blocked(taken: Taken, match: Match) -> bool:
    """A node of the match is in another fusion already, or fusing it would close a cycle."""
    names = [n.name for n in match.nodes]
    return any(n in taken for n in names) or taken.closes_cycle(names)
