"""fuse_lm_head_argmax: linear to logits whose only reader is argmax_logprob -> one
linear_argmax_logprob, whose kernel reduces over the vocabulary without keeping [n, V] logits
(in fp32, whatever the linear's out_dtype was)."""
from __future__ import annotations

from draft_circuit.circuit.ir import Circuit, Node
from draft_circuit.circuit.passes.rewrite import fused_node, rewrite, sole_user


def fuse_lm_head_argmax(c: Circuit) -> Circuit:
    replacements: dict[str, Node | None] = {}
    for lin in c.nodes:
        if lin.op != "linear":
            continue
        arg = sole_user(c, lin.outputs[0])
        if arg is None or arg.op != "argmax_logprob" or arg.inputs[0] != lin.outputs[0]:
            continue
        # the fused kernel keeps fp32 logits: exact for fp32 ones, finer than rounded ones
        replacements[lin.name] = None
        replacements[arg.name] = fused_node(
            f"{lin.name}+{arg.name}", "linear_argmax_logprob", (*lin.inputs, *arg.inputs[1:]),
            arg.outputs, {}, (lin, arg))
    return rewrite(c, replacements)
