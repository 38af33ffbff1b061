"""fuse_linear_silu_mul: the gate_up linear whose only reader is silu_mul -> linear_silu_mul, so
the [n, 2I] activations never reach memory."""
from __future__ import annotations

from draft_circuit.circuit.ir import Circuit, Node
from draft_circuit.circuit.passes.rewrite import fused_node, rewrite, sole_user


def fuse_linear_silu_mul(c: Circuit) -> Circuit:
    replacements: dict[str, Node | None] = {}
    for lin in c.nodes:
        if lin.op != "linear":
            continue
        act = sole_user(c, lin.outputs[0])
        if act is None or act.op != "silu_mul":
            continue
        replacements[lin.name] = None
        replacements[act.name] = fused_node(f"{lin.name}+{act.name}", "linear_silu_mul",
                                            lin.inputs, act.outputs, {}, (lin, act))
    return rewrite(c, replacements)
