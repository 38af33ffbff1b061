"""fuse_rope_kv_write: rope(q), rope(k) and the kv_write of k -> one rope_kv_write, which rotates
q and k and writes k and v to their paged slots in one launch. The q rope must use the same
positions and rope attrs as the k rope, and both rotated values may have no other readers."""
from __future__ import annotations

from draft_circuit.circuit.ir import Circuit, Node
from draft_circuit.circuit.passes.rewrite import fused_node, rewrite, sole_user


def _q_rope(c: Circuit, k_rope: Node, done: dict) -> Node | None:
    for q in c.nodes:
        if (q.op == "rope" and q is not k_rope and q.name not in done
                and q.inputs[1] == k_rope.inputs[1] and q.attrs == k_rope.attrs
                and sole_user(c, q.outputs[0]) is not None):
            return q
    return None


def fuse_rope_kv_write(c: Circuit) -> Circuit:
    replacements: dict[str, Node | None] = {}
    for kv in c.nodes:
        if kv.op != "kv_write":
            continue
        k_rope = c.producer(kv.inputs[2])
        if (k_rope is None or k_rope.op != "rope" or sole_user(c, kv.inputs[2]) is not kv
                or kv.inputs.count(kv.inputs[2]) != 1):  # rotated k read only as k
            continue
        q_rope = _q_rope(c, k_rope, replacements)
        if q_rope is None:
            continue
        kc, vc, _, v, tables, live, *active = kv.inputs
        attrs = {**k_rope.attrs, **kv.attrs}
        replacements[q_rope.name] = replacements[k_rope.name] = None
        replacements[kv.name] = fused_node(
            f"{q_rope.name}+{k_rope.name}+{kv.name}", "rope_kv_write",
            (q_rope.inputs[0], k_rope.inputs[0], v, k_rope.inputs[1], kc, vc, tables, live, *active),
            (q_rope.outputs[0], *kv.outputs), attrs, (q_rope, k_rope, kv))
    return rewrite(c, replacements)
