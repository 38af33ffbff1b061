"""The one well-formedness check. `verify(circuit)` returns None or raises a `CircuitError` that
names the node, the op and the shapes: acyclic, values defined once, ops registered, arity and
attrs valid, recorded shapes equal to each op's shape rule, symbols declared, outputs produced,
state versions written in a line and never read after a later version was written."""
from __future__ import annotations

import networkx as nx

from draft_circuit.circuit.ir import DTYPES, Circuit, CircuitError, Node
from draft_circuit.ops.registry import ShapeError, get_op


def verify(circuit: Circuit) -> None:
    _check_values(circuit)
    produced = _check_definitions(circuit)
    for node in circuit.nodes:
        _check_node(circuit, node)
    _check_states(circuit)
    _check_acyclic(circuit)
    for out in circuit.outputs:
        if not circuit.has_value(out):
            raise CircuitError(f"circuit output {out!r} names no value")
        if out not in produced:
            raise CircuitError(f"circuit output {out!r} is not produced by any node")


def _check_values(c: Circuit) -> None:
    if "n" not in c.symbols:
        raise CircuitError("the row symbol 'n' is not declared")
    for sym, (lo, hi) in c.symbols.items():
        if not 1 <= lo <= hi:
            raise CircuitError(f"symbol {sym!r} has bounds [{lo}, {hi}]; need 1 <= low <= high")
    seen: set[str] = set()
    for v in c.values:
        if v.name in seen:
            raise CircuitError(f"value {v.name!r} is declared twice")
        seen.add(v.name)
        if v.dtype not in DTYPES:
            raise CircuitError(f"value {v.name!r} has unknown dtype {v.dtype!r}")
        for d in v.shape:
            if isinstance(d, str) and d not in c.symbols:
                raise CircuitError(f"value {v.name!r} ({v.spec}) uses unbound symbol {d!r}; "
                                   f"declared: {sorted(c.symbols)}")
            if isinstance(d, int) and d < 0:
                raise CircuitError(f"value {v.name!r} has a negative dim ({v.spec})")
        if v.kind == "state" and v.storage is None:
            raise CircuitError(f"state value {v.name!r} names no storage")


def _check_definitions(c: Circuit) -> set[str]:
    """Every value written by at most one node, and never a circuit input, param or root state."""
    produced: dict[str, str] = {}
    for n in c.nodes:
        for out in n.outputs:
            if out in produced:
                raise CircuitError(f"value {out!r} is defined twice (also by node "
                                   f"{produced[out]!r})", node=n.name, op=n.op)
            if not c.has_value(out):
                raise CircuitError(f"output {out!r} names no declared value", node=n.name, op=n.op)
            v = c.value(out)
            if v.kind in ("input", "param") or (v.kind == "state" and v.version == 0):
                raise CircuitError(f"writes {v.kind} {out!r}; only temps, outputs and new state "
                                   "versions may be written (an in-place write of an input would "
                                   "clobber the caller's buffer)", node=n.name, op=n.op)
            produced[out] = n.name
    for n in c.nodes:
        for x in n.inputs:
            v = c.value(x) if c.has_value(x) else None
            if v is not None and x not in produced and (
                    v.kind in ("temp", "output") or (v.kind == "state" and v.version > 0)):
                raise CircuitError(f"input {x!r} ({v.kind}) is never produced: no node defines it",
                                   node=n.name, op=n.op)
    return set(produced)


def _shapes(c: Circuit, names: tuple[str, ...]) -> str:
    return ", ".join(f"{x}: {c.value(x).spec}" if c.has_value(x) else f"{x}: ?" for x in names)


def _check_node(c: Circuit, node: Node) -> None:
    try:
        op = get_op(node.op)
    except CircuitError as e:
        raise CircuitError(e.detail, node=node.name, op=node.op) from None
    for name in node.inputs:
        if not c.has_value(name):
            raise CircuitError(f"input {name!r} names no value", node=node.name, op=node.op)
    bad = op.check_arity(len(node.inputs), len(node.outputs))
    if bad:
        raise CircuitError(bad, node=node.name, op=node.op, shapes=_shapes(c, node.inputs))
    try:
        attrs = op.parse_attrs(node.attrs)
    except CircuitError as e:
        raise CircuitError(e.detail, node=node.name, op=node.op) from None
    ins = [c.value(x).spec for x in node.inputs]
    try:
        expected = op.infer(ins, attrs)
    except ShapeError as e:
        raise CircuitError(str(e), node=node.name, op=node.op,
                           shapes=_shapes(c, node.inputs)) from None
    for name, want in zip(node.outputs, expected):
        got = c.value(name).spec
        if got != want:
            raise CircuitError(f"output {name!r} is recorded as {got} but {node.op}'s rule gives "
                               f"{want}", node=node.name, op=node.op, shapes=_shapes(c, node.inputs))
    for out_i, in_i in op.mutates.items():
        src, dst = c.value(node.inputs[in_i]), c.value(node.outputs[out_i])
        if src.kind != "state" or dst.kind != "state" or src.storage != dst.storage \
                or dst.version != src.version + 1:
            raise CircuitError(f"must write state {src.name!r} as its next version, got "
                               f"{dst.name!r} (kind {dst.kind}, version {dst.version})",
                               node=node.name, op=node.op)


def _check_states(c: Circuit) -> None:
    """Each state version is consumed by at most one writer: the versions form one line."""
    writers: dict[str, str] = {}
    for writer, version in c.state_writes():
        if version in writers:
            raise CircuitError(f"state version {version!r} is written by two nodes "
                               f"({writers[version]!r} and {writer!r}); the versions must form "
                               "one line", node=writer)
        writers[version] = writer


def _check_acyclic(c: Circuit) -> None:
    try:
        cycle = nx.find_cycle(c.graph)
    except nx.NetworkXNoCycle:
        return
    anti = [(u, v, c.graph.edges[u, v]["value"]) for u, v in cycle
            if c.graph.edges[u, v]["kind"] == "anti"]
    path = " -> ".join([u for u, _ in cycle] + [cycle[0][0]])
    if anti:
        reader, writer, version = anti[0]
        raise CircuitError(f"reads state version {version!r} after node {writer!r} wrote its next "
                           f"version (cycle {path})", node=reader, op=c.node(reader).op)
    raise CircuitError(f"the circuit has a cycle: {path}", node=cycle[0][0],
                       op=c.node(cycle[0][0]).op)
