"""Shared machinery for passes: match queries and a rewrite that replaces or drops nodes and
prunes the temps nothing references any more. Passes stay pure: every call returns a new Circuit."""
from __future__ import annotations

from typing import Any

from draft_circuit.circuit.ir import Circuit, Node


def sole_user(c: Circuit, value: str) -> Node | None:
    """The one node reading `value`, if exactly one does and it is not a circuit output."""
    users = c.users(value)
    return users[0] if len(users) == 1 and value not in c.outputs else None


def rewrite(c: Circuit, replacements: dict[str, Node | None]) -> Circuit:
    """Replace each named node by a new node (at the same place in circuit order) or drop it
    (None), then prune values no node or output mentions. Inputs, params and states are kept:
    they are the circuit's interface."""
    nodes = [replacements.get(n.name, n) for n in c.nodes]
    kept = [n for n in nodes if n is not None]
    used = set(c.outputs)
    for n in kept:
        used.update(n.inputs)
        used.update(n.outputs)
    values = [v for v in c.values
              if v.name in used or v.kind in ("input", "param") or (v.kind == "state" and v.version == 0)]
    return c.replace(nodes=kept, values=values)


def fused_node(name: str, op: str, inputs: tuple[str, ...], outputs: tuple[str, ...],
               attrs: dict[str, Any], parts: tuple[Node, ...]) -> Node:
    """A node standing for `parts`, recording their names so programs can show the group."""
    fused = tuple(x for p in parts for x in (p.fused or (p.name,)))
    origin = tuple(o for p in parts for o in p.origin)  # the parts' layer lines, in fused order
    return Node(name=name, op=op, inputs=inputs, outputs=outputs, attrs=attrs, fused=fused,
                origin=origin)
