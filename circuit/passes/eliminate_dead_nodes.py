"""eliminate_dead_nodes: drop every node none of whose outputs reaches a circuit output, except a
node whose op writes a state (the registry's `writes_state`, from `mutates`): its effect is the
write itself, so it is live, and so is everything it reads, whether or not the circuit returns
the state it wrote."""
from __future__ import annotations

from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.passes.rewrite import rewrite
from draft_circuit.ops.registry import get_op


def eliminate_dead_nodes(c: Circuit) -> Circuit:
    live_values = set(c.outputs)
    live_nodes: set[str] = set()
    for node in reversed(c.topo_order()):  # users before producers
        if get_op(node.op).writes_state or any(o in live_values for o in node.outputs):
            live_nodes.add(node.name)
            live_values.update(node.inputs)
    return rewrite(c, {n.name: None for n in c.nodes if n.name not in live_nodes})
