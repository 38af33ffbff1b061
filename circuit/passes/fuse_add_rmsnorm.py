"""fuse_add_rmsnorm: add(x, r) followed by rmsnorm of the sum -> add_rmsnorm, which writes the
residual sum and the normed value in one pass over the row. The sum may have other readers (it is
the residual stream); only its first rmsnorm is fused."""
from __future__ import annotations

from draft_circuit.circuit.ir import Circuit, Node
from draft_circuit.circuit.passes.rewrite import fused_node, rewrite


def fuse_add_rmsnorm(c: Circuit) -> Circuit:
    replacements: dict[str, Node | None] = {}
    for add in c.nodes:
        if add.op != "add" or add.name in replacements:
            continue
        (total,) = add.outputs
        norm = next((u for u in c.users(total) if u.op == "rmsnorm" and u.inputs[0] == total
                     and u.name not in replacements), None)
        if norm is None:
            continue
        replacements[add.name] = fused_node(
            f"{add.name}+{norm.name}", "add_rmsnorm", (*add.inputs, norm.inputs[1]),
            (total, norm.outputs[0]), dict(norm.attrs), (add, norm))
        replacements[norm.name] = None
    return rewrite(c, replacements)
