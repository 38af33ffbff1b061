"""The one well-formedness check. `verify(circuit)` returns None or raises a `CircuitError` that
names the node, the op, the shapes and the layer line that built the node: acyclic, node names
unique, values defined once, ops registered, arity and attrs valid, recorded shapes equal to each
op's shape rule, params free of the row symbol, symbols declared, input neutrals that fit their
dtype, outputs produced (as outputs or state versions), state versions written in a line and
never read after a later version was written."""
from __future__ import annotations

import math
from typing import Any

import networkx as nx

from draft_circuit.circuit.ir import (DTYPES, FUSED_SEP, SCRATCH_BLOCK, Circuit, CircuitError, Node,
                                      Value)
from draft_circuit.ops.registry import ShapeError, get_op

_FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")


def verify(circuit: Circuit) -> None:
    _check_values(circuit)
    _check_names(circuit)
    produced = _check_definitions(circuit)
    for node in circuit.nodes:
        _check_node(circuit, node)
    _check_states(circuit)
    _check_acyclic(circuit)
    _check_outputs(circuit, produced)


def where(node: Node) -> dict[str, Any]:
    """The CircuitError keywords that locate a node: its name, op and origin."""
    return {"node": node.name, "op": node.op, "origin": node.where}


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
        if v.kind == "param" and any(isinstance(d, str) for d in v.shape):
            raise CircuitError(f"param {v.name!r} ({v.spec}) uses a symbol; params are bound "
                               "once at compile time, so every dim must be an int")
        if v.kind == "state" and v.storage is None:
            raise CircuitError(f"state value {v.name!r} names no storage")
        _check_neutral(v)


def _check_neutral(v: Value) -> None:
    """An inert row's value must be one the input's dtype can hold."""
    x = v.neutral
    if x is None:
        return
    if v.kind != "input":
        raise CircuitError(f"{v.kind} {v.name!r} declares a neutral value; only inputs have one")
    floating = v.dtype in _FLOAT_DTYPES
    if x == SCRATCH_BLOCK:
        bad = "the scratch block is a block id" if floating else None
    elif isinstance(x, bool) or not isinstance(x, (int, float)):
        bad = f"{x!r} is not a number"
    elif not floating and not (isinstance(x, int) or (math.isfinite(x) and x == int(x))):
        bad = f"{x!r} is not an integer"
    else:
        bad = None
    if bad:
        raise CircuitError(f"input {v.name!r} ({v.spec}) declares neutral {x!r}: {bad}")


def _check_names(c: Circuit) -> None:
    """Node names are keys (the graph, the program, the report): two alike would drop one."""
    seen: dict[str, Node] = {}
    for n in c.nodes:
        if n.name in seen:
            first = seen[n.name].where
            raise CircuitError("node name used twice" + (f" (first built at {first})" if first
                                                          else ""), **where(n))
        seen[n.name] = n
        if FUSED_SEP in n.name and not n.fused:
            raise CircuitError(f"only fused nodes may have {FUSED_SEP!r} in their name (fusion "
                               "passes name theirs part+part)", **where(n))


def _check_definitions(c: Circuit) -> set[str]:
    """Every value written by at most one node, and never a circuit input, param or root state."""
    produced: dict[str, str] = {}
    for n in c.nodes:
        for out in n.outputs:
            if out in produced:
                raise CircuitError(f"value {out!r} is defined twice (also by node "
                                   f"{produced[out]!r})", **where(n))
            if not c.has_value(out):
                raise CircuitError(f"output {out!r} names no declared value", **where(n))
            v = c.value(out)
            if v.kind in ("input", "param") or (v.kind == "state" and v.version == 0):
                raise CircuitError(f"writes {v.kind} {out!r}; only temps, outputs and new state "
                                   "versions may be written (an in-place write of an input would "
                                   "clobber the caller's buffer)", **where(n))
            produced[out] = n.name
    for n in c.nodes:
        for x in n.inputs:
            read = c.value(x) if c.has_value(x) else None
            if read is not None and x not in produced and (
                    read.kind in ("temp", "output") or (read.kind == "state" and read.version > 0)):
                raise CircuitError(f"input {x!r} ({read.kind}) is never produced: no node "
                                   "defines it", **where(n))
    return set(produced)


def _shapes(c: Circuit, names: tuple[str, ...]) -> str:
    return ", ".join(f"{x}: {c.value(x).spec}" if c.has_value(x) else f"{x}: ?" for x in names)


def _check_node(c: Circuit, node: Node) -> None:
    try:
        op = get_op(node.op)
    except CircuitError as e:
        raise CircuitError(e.detail, **where(node)) from None
    for name in node.inputs:
        if not c.has_value(name):
            raise CircuitError(f"input {name!r} names no value", **where(node))
    shapes = _shapes(c, node.inputs)
    bad = op.check_arity(len(node.inputs), len(node.outputs))
    if bad:
        raise CircuitError(bad, shapes=shapes, **where(node))
    try:
        attrs = op.parse_attrs(node.attrs)
    except CircuitError as e:
        raise CircuitError(e.detail, **where(node)) from None
    ins = [c.value(x).spec for x in node.inputs]
    try:
        expected = op.infer(ins, attrs)
    except ShapeError as e:
        raise CircuitError(str(e), shapes=shapes, **where(node)) from None
    except Exception as e:  # a shape rule that trips on an input it does not expect
        raise CircuitError(f"shape rule failed: {type(e).__name__}: {e}", shapes=shapes,
                           **where(node)) from None
    for name, want in zip(node.outputs, expected):
        got = c.value(name).spec
        if got != want:
            raise CircuitError(f"output {name!r} is recorded as {got} but {node.op}'s rule gives "
                               f"{want}", shapes=shapes, **where(node))
    for out_i, in_i in op.mutates.items():
        src, dst = c.value(node.inputs[in_i]), c.value(node.outputs[out_i])
        if src.kind != "state" or dst.kind != "state" or src.storage != dst.storage \
                or dst.version != src.version + 1:
            raise CircuitError(f"must write state {src.name!r} as its next version, got "
                               f"{dst.name!r} (kind {dst.kind}, version {dst.version})",
                               **where(node))


def _check_states(c: Circuit) -> None:
    """Each state version is consumed by at most one writer: the versions form one line."""
    writers: dict[str, str] = {}
    for writer, version in c.state_writes():
        if version in writers:
            raise CircuitError(f"state version {version!r} is written by two nodes "
                               f"({writers[version]!r} and {writer!r}); the versions must form "
                               "one line", **where(c.node(writer)))
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
                           f"version (cycle {path})", **where(c.node(reader)))
    raise CircuitError(f"the circuit has a cycle: {path}", **where(c.node(cycle[0][0])))


def _check_outputs(c: Circuit, produced: set[str]) -> None:
    """Outputs are produced values of kind output, or state versions. A temp listed as an output
    would be returned by the eager runner and dropped by the program runners (it lives in the
    arena, not in a static output buffer), so it is refused here, before any runner sees it."""
    for out in c.outputs:
        if not c.has_value(out):
            raise CircuitError(f"circuit output {out!r} names no value")
        if out not in produced:
            raise CircuitError(f"circuit output {out!r} is not produced by any node")
        kind = c.value(out).kind
        if kind not in ("output", "state"):
            node = c.producer(out)
            raise CircuitError(f"circuit output {out!r} is recorded as a {kind}; an output value "
                               "must have kind 'output' (CircuitBuilder.output marks it)",
                               **(where(node) if node else {}))
