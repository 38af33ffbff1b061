"""The fusion table: one row per fusion (producer -> consumer pattern, guard, rewrite), each run by
the driver in circuit/passes/fuse.py as the pass of its name. Every row's fused op is the
composition of its parts' references, so a fused circuit computes what the unfused one does.
"""
from __future__ import annotations

from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.ir import Node
from draft_circuit.circuit.passes.fuse import Fusion, Match, Parts, Siblings, Taken
from draft_circuit.circuit.passes.rewrite import sole_user


def _same_out_dtype(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """linear_silu_mul has no out_dtype and no bias: only a linear that keeps its input's dtype
    and has no bias fuses."""
    lin = m.producer
    out_dtype = lin.attrs.get("out_dtype")
    return m if out_dtype in (None, c.value(lin.inputs[0]).dtype) and _unbiased(c, m, taken) else None


def _unbiased(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """The fused op takes x and weight only: a linear with a bias input stays unfused."""
    return m if len(m.producer.inputs) == 2 else None


def _q_rope_of_this_attention(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """The q rope fused with a k rope and its kv_write: the rope whose only reader is the
    decode_attention over the caches this kv_write writes (so never another layer's or another
    step's rope), with the k rope's positions and attrs."""
    k_rope, kv = m.producer, m.consumer
    for attention in c.users(kv.outputs[0]):
        if attention.op != "decode_attention" or kv.outputs[1] not in attention.inputs:
            continue
        q = c.producer(attention.inputs[0])
        if (q is not None and q.op == "rope" and q is not k_rope and q.name not in taken
                and q.inputs[1] == k_rope.inputs[1] and q.attrs == k_rope.attrs
                and sole_user(c, q.outputs[0]) is attention):
            return Match(k_rope, kv, (q,))
    return None


def _plain_linear(c: Circuit, lin: Node) -> bool:
    """An unbiased linear that keeps its input's dtype (what the fused linears compute)."""
    out_dtype = lin.attrs.get("out_dtype")
    return len(lin.inputs) == 2 and out_dtype in (None, c.value(lin.inputs[0]).dtype)


def _qkv_sibling(c: Circuit, lin: Node) -> bool:
    """A plain linear over a param weight: the fused node takes the first sibling's place, where
    a param is available and a computed weight might not be."""
    return _plain_linear(c, lin) and c.value(lin.inputs[1]).kind == "param"


def _concat_of_two_rows(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """concat([x1, x2]) along the features of rank-2 rows, read only by a plain linear."""
    cat, lin = m.producer, m.consumer
    rank2 = len(c.value(cat.outputs[0]).shape) == 2
    return m if (len(cat.inputs) == 2 and rank2 and cat.attrs.get("dim", -1) in (-1, 1)
                 and _plain_linear(c, lin)) else None


def _keep_after_argmax(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """keep_if_active(token, active) with fill -1 and no fallback; the fused node takes the keep's
    place, so every other reader of the argmax's outputs must come after it in circuit order."""
    arg, keep = m.producer, m.consumer
    if len(keep.inputs) != 2 or keep.attrs.get("fill", -1) != -1:
        return None
    order = {n.name: i for i, n in enumerate(c.nodes)}
    readers = [u for out in arg.outputs for u in c.users(out) if u is not keep]
    return m if all(order[u.name] > order[keep.name] for u in readers) else None


def _argmax_keep(m: Match) -> Parts:
    arg, keep = m.producer, m.consumer
    x, w, *tail = arg.inputs  # tail: the bitmask and the id table, each where present
    return (arg, keep), (x, w, keep.inputs[1], *tail), (*arg.outputs, keep.outputs[0]), arg.attrs


def _plain_linear_into_add(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """A plain linear whose product is the add's second operand (the residual stream's add)."""
    return m if _plain_linear(c, m.producer) else None


def _linear_add(m: Match) -> Parts:
    lin, add = m.producer, m.consumer
    return (lin, add), (*lin.inputs, add.inputs[0]), add.outputs, {}


def _norm_prologue(m: Match) -> Parts:
    """rmsnorm(x, w) read (as input 0) by a linear-family op -> the op's prologue variant over
    (x, w, the op's other inputs), with the op's attrs (the lm-head argmax's id table) and the
    norm's eps."""
    norm, lin = m.producer, m.consumer
    return (norm, lin), (*norm.inputs, *lin.inputs[1:]), lin.outputs, {**lin.attrs, **norm.attrs}


def _mtp_input(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """embedding -> rmsnorm read only by a linear_concat as its first half, whose second half is
    another rmsnorm (same eps) read only by it: the MTP eh_proj over [enorm(emb), hnorm(h)]."""
    enorm = m.consumer
    lc = sole_user(c, enorm.outputs[0])
    if lc is None or lc.op != "linear_concat" or lc.inputs[0] != enorm.outputs[0] or lc.name in taken:
        return None
    hnorm = c.producer(lc.inputs[1])
    if (hnorm is None or hnorm.op != "rmsnorm" or hnorm.name in taken or hnorm.attrs != enorm.attrs
            or sole_user(c, hnorm.outputs[0]) is not lc):
        return None
    return Match(m.producer, enorm, (hnorm, lc))


def _embed_concat_linear(m: Match) -> Parts:
    emb, enorm, (hnorm, lc) = m.producer, m.consumer, m.more
    table, ids = emb.inputs
    return ((emb, enorm, hnorm, lc), (table, ids, enorm.inputs[1], *hnorm.inputs, lc.inputs[2]),
            lc.outputs, enorm.attrs)


def _readers_after(c: Circuit, m: Match) -> bool:
    """Every other reader of the producer's outputs comes after the consumer in circuit order (the
    fused node takes the consumer's place, so none of them may run before it)."""
    order = {n.name: i for i, n in enumerate(c.nodes)}
    readers = [u for out in m.producer.outputs for u in c.users(out) if u is not m.consumer]
    return all(order[u.name] > order[m.consumer.name] for u in readers)


def _last_kept_of_this_draft(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """keep_if_active(token, active, fallback) over the lm-head draft's own active rows."""
    arg, keep = m.producer, m.consumer
    same_active = len(keep.inputs) == 3 and keep.inputs[1] == arg.inputs[3]
    return m if same_active and _readers_after(c, m) else None


def _gate_of_this_draft(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """confidence_gate(active, logprob, log_tau) of the lm-head draft's own active rows."""
    arg, gate = m.producer, m.consumer
    return m if gate.inputs[0] == arg.inputs[3] and _readers_after(c, m) else None


def _argmax_last(m: Match) -> Parts:
    arg, keep = m.producer, m.consumer
    x, norm, w, active, *mask = arg.inputs
    return (arg, keep), (x, norm, w, active, keep.inputs[2], *mask), (*arg.outputs, keep.outputs[0]), \
        arg.attrs


def _argmax_gate(m: Match) -> Parts:
    """log_tau goes after the producer's required inputs (and its fallback), before the mask."""
    arg, gate = m.producer, m.consumer
    required = 5 if arg.op.endswith("_last") else 4
    ins = arg.inputs
    return (arg, gate), (*ins[:required], gate.inputs[2], *ins[required:]), \
        (*arg.outputs, gate.outputs[0]), arg.attrs


def _qkv_into_its_rope(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """rope_kv_write reads the normed q, k and v products as its q, k and v and nothing else
    reads them; the rope rotates whole heads (the kernel's only mode)."""
    qkv, rope = m.producer, m.consumer
    ours = all(rope.inputs[i] == qkv.outputs[i] and sole_user(c, qkv.outputs[i]) is rope
               for i in range(3))
    full = rope.attrs.get("rotary_dim") in (None, rope.attrs.get("head_dim"))
    return m if ours and full else None


def _qkv_rope(m: Match) -> Parts:
    qkv, rope = m.producer, m.consumer
    return (qkv, rope), (*qkv.inputs, *rope.inputs[3:]), rope.outputs, {**rope.attrs, **qkv.attrs}


def _qkv(group: tuple[Node, ...]) -> Parts:
    return group, (group[0].inputs[0], *(n.inputs[1] for n in group)), \
        tuple(n.outputs[0] for n in group), {}


def _concat_linear(m: Match) -> Parts:
    cat, lin = m.producer, m.consumer
    return (cat, lin), (*cat.inputs, lin.inputs[1]), lin.outputs, {}


def _add_rmsnorm(m: Match) -> Parts:
    add, norm = m.producer, m.consumer
    return (add, norm), (*add.inputs, norm.inputs[1]), (add.outputs[0], norm.outputs[0]), norm.attrs


def _lm_head_argmax(m: Match) -> Parts:
    """(x, w, [bitmask]); with the map_ids the guard absorbed, its id table last (attr `ids`) and
    the mapped token in the argmax's token's place."""
    lin, arg = m.producer, m.consumer
    if not m.more:
        return (lin, arg), (*lin.inputs, *arg.inputs[1:]), arg.outputs, {}
    (to_ids,) = m.more
    return ((lin, arg, to_ids), (*lin.inputs, *arg.inputs[1:], to_ids.inputs[1]),
            (to_ids.outputs[0], *arg.outputs[1:]), {"ids": True})


def _lm_head_and_its_ids(c: Circuit, m: Match, taken: Taken) -> Match | None:
    """An unbiased lm-head linear; where the argmax's token is read only by a map_ids through a
    table of one target id per vocabulary row (a reduced draft vocabulary's, a param or input:
    there at the fused node's place), that map_ids too, so the merge writes the mapped id and
    the keep / gate rows still find the argmax's token as their input."""
    if _unbiased(c, m, taken) is None:
        return None
    lin, arg = m.producer, m.consumer
    to_ids = sole_user(c, arg.outputs[0])
    if to_ids is None or to_ids.op != "map_ids" or to_ids.inputs[0] != arg.outputs[0] or to_ids.name in taken:
        return m
    table = c.value(to_ids.inputs[1])
    rows = c.value(lin.inputs[1]).shape[0]
    fits = c.producer(to_ids.inputs[1]) is None and table.dtype == "int32" and table.shape == (rows,)
    return Match(lin, arg, (to_ids,)) if fits else m


def _rope_kv_write(m: Match) -> Parts:
    k_rope, kv, (q_rope,) = m.producer, m.consumer, m.more
    kc, vc, _, v, tables, live, *active = kv.inputs
    return ((q_rope, k_rope, kv),
            (q_rope.inputs[0], k_rope.inputs[0], v, k_rope.inputs[1], kc, vc, tables, live, *active),
            (q_rope.outputs[0], *kv.outputs), {**k_rope.attrs, **kv.attrs})


def _k_rope_kv_write(m: Match) -> Parts:
    """rope(k) and the kv_write of it -> rope_k_kv_write(k, v, positions, caches, tables, live,
    [active]) with the rope's attrs and the write's."""
    k_rope, kv = m.producer, m.consumer
    kc, vc, _, v, tables, live, *active = kv.inputs
    return ((k_rope, kv), (k_rope.inputs[0], v, k_rope.inputs[1], kc, vc, tables, live, *active),
            kv.outputs, {**k_rope.attrs, **kv.attrs})


def _kv_sibling(c: Circuit, lin: Node) -> bool:
    """A q/k/v-style linear (plain, param weight) whose only reader is a rope_k_kv_write, as its
    k or its v: the K and V projections of a step with no q (the KV-only catch-up)."""
    user = sole_user(c, lin.outputs[0])
    return (_qkv_sibling(c, lin) and user is not None and user.op == "rope_k_kv_write"
            and lin.outputs[0] in user.inputs[:2])


def _linear_silu_mul(m: Match) -> Parts:
    lin, act = m.producer, m.consumer
    return (lin, act), lin.inputs, act.outputs, {}


FUSIONS: tuple[Fusion | Siblings, ...] = (
    Fusion("fuse_linear_add",
           "a plain linear whose only reader is add(x, linear) -> linear_add, the residual added "
           "in the linear's epilogue (before fuse_add_rmsnorm, so the norm can move into the next "
           "linear's prologue instead)",
           producer="linear", consumer="add", edge=1, sole_reader=True, fused_op="linear_add",
           rewrite=_linear_add, guard=_plain_linear_into_add),
    Fusion("fuse_add_rmsnorm",
           "add(x, r) and the first rmsnorm of its sum -> add_rmsnorm, writing the sum (the "
           "residual stream, which may have other readers) and the normed value in one pass",
           producer="add", consumer="rmsnorm", edge=0, sole_reader=False, fused_op="add_rmsnorm",
           rewrite=_add_rmsnorm, at="producer"),
    Fusion("fuse_lm_head_argmax",
           "the linear to logits whose only reader is argmax_logprob -> linear_argmax_logprob, "
           "which reduces over the vocabulary in fp32 without keeping [n, V] logits; a map_ids "
           "of a reduced draft vocabulary reading its token alone rides in the merge (attr ids)",
           producer="linear", consumer="argmax_logprob", edge=0, sole_reader=True,
           fused_op="linear_argmax_logprob", rewrite=_lm_head_argmax, guard=_lm_head_and_its_ids),
    Fusion("fuse_rope_kv_write",
           "rope(q), rope(k) and the kv_write of k -> rope_kv_write, rotating q and k and writing "
           "k and v to their paged slots in one launch",
           producer="rope", consumer="kv_write", edge=2, sole_reader=True, fused_op="rope_kv_write",
           rewrite=_rope_kv_write, guard=_q_rope_of_this_attention),
    # after fuse_rope_kv_write: a k rope left unfused has no q rope of its attention (the
    # KV-only catch-up drops q; ops/kv_only.py)
    Fusion("fuse_rope_k_kv_write",
           "rope(k) whose only reader is its kv_write, with no q rope to fuse -> rope_k_kv_write, "
           "rotating k and writing k and v to their paged slots in one launch",
           producer="rope", consumer="kv_write", edge=2, sole_reader=True,
           fused_op="rope_k_kv_write", rewrite=_k_rope_kv_write),
    Fusion("fuse_linear_silu_mul",
           "the gate_up linear whose only reader is silu_mul -> linear_silu_mul, so the [n, 2I] "
           "activations never reach memory",
           producer="linear", consumer="silu_mul", edge=0, sole_reader=True,
           fused_op="linear_silu_mul", rewrite=_linear_silu_mul, guard=_same_out_dtype),
    # after fuse_linear_silu_mul, so an MLP's gate_up linear over the same row is never a sibling
    Siblings("fuse_qkv",
             "three plain linears over one input with param weights (q/k/v) -> linear_qkv, one "
             "launch over the three weights as they are bound (no concatenated copy)",
             op="linear", count=3, fused_op="linear_qkv", rewrite=_qkv, guard=_qkv_sibling),
    # after fuse_qkv and fuse_rope_k_kv_write: k and v with no q (the KV-only catch-up)
    Siblings("fuse_kv",
             "two plain linears over one input whose products only a rope_k_kv_write reads (its "
             "k and v) -> linear_kv, one launch (the q/k/v kernel with no q)",
             op="linear", count=2, fused_op="linear_kv", rewrite=_qkv, guard=_kv_sibling),
    Fusion("fuse_concat_linear",
           "concat([x1, x2]) whose only reader is a plain linear -> linear_concat, which reads "
           "each K tile from x1 or x2, so the concatenated row never reaches memory",
           producer="concat", consumer="linear", edge=0, sole_reader=True, fused_op="linear_concat",
           rewrite=_concat_linear, guard=_concat_of_two_rows),
    Fusion("fuse_argmax_keep",
           "keep_if_active(token, active) of the lm-head's fused argmax -> linear_argmax_keep, "
           "which writes the kept draft in its merge epilogue (the token stays an output)",
           producer="linear_argmax_logprob", consumer="keep_if_active", edge=0, sole_reader=False,
           fused_op="linear_argmax_keep", rewrite=_argmax_keep, guard=_keep_after_argmax),
    # the norms into the prologue of the linear after them (kernels.linear_fused): each program
    # re-reads its rows for their sum of squares, which costs less than a launch at decode widths
    Fusion("fuse_rmsnorm_qkv",
           "rmsnorm whose only reader is linear_qkv -> rmsnorm_linear_qkv (input_layernorm in the "
           "q/k/v launch's prologue; the normed row is never stored)",
           producer="rmsnorm", consumer="linear_qkv", edge=0, sole_reader=True,
           fused_op="rmsnorm_linear_qkv", rewrite=_norm_prologue),
    Fusion("fuse_rmsnorm_kv",
           "rmsnorm whose only reader is linear_kv -> rmsnorm_linear_kv (input_layernorm in the "
           "k/v launch's prologue)",
           producer="rmsnorm", consumer="linear_kv", edge=0, sole_reader=True,
           fused_op="rmsnorm_linear_kv", rewrite=_norm_prologue),
    Fusion("fuse_qkv_rope_kv_write",
           "rmsnorm_linear_qkv whose q, k and v only rope_kv_write reads -> "
           "rmsnorm_linear_qkv_rope_kv_write: the products rotated and written to the caches in "
           "the epilogue, so the attention's input is one launch",
           producer="rmsnorm_linear_qkv", consumer="rope_kv_write", edge=0, sole_reader=True,
           fused_op="rmsnorm_linear_qkv_rope_kv_write", rewrite=_qkv_rope, guard=_qkv_into_its_rope),
    Fusion("fuse_rmsnorm_silu_mul",
           "rmsnorm whose only reader is linear_silu_mul -> rmsnorm_linear_silu_mul "
           "(post_attention_layernorm in the gate_up launch's prologue)",
           producer="rmsnorm", consumer="linear_silu_mul", edge=0, sole_reader=True,
           fused_op="rmsnorm_linear_silu_mul", rewrite=_norm_prologue),
    Fusion("fuse_rmsnorm_argmax_keep",
           "rmsnorm whose only reader is linear_argmax_keep -> rmsnorm_linear_argmax_keep (the "
           "final norm in the lm-head's partials prologue)",
           producer="rmsnorm", consumer="linear_argmax_keep", edge=0, sole_reader=True,
           fused_op="rmsnorm_linear_argmax_keep", rewrite=_norm_prologue),
    Fusion("fuse_rmsnorm_argmax",
           "rmsnorm whose only reader is linear_argmax_logprob -> rmsnorm_linear_argmax_logprob",
           producer="rmsnorm", consumer="linear_argmax_logprob", edge=0, sole_reader=True,
           fused_op="rmsnorm_linear_argmax_logprob", rewrite=_norm_prologue),
    # the chain's draft bookkeeping into the lm-head merge's epilogue (the proposer's chain:
    # bitmask, confidence stop and embed target): last_kept first, then the gate
    Fusion("fuse_argmax_last",
           "keep_if_active(token, active, last) of the lm-head draft -> "
           "rmsnorm_linear_argmax_keep_last, the last kept draft written in the merge's epilogue",
           producer="rmsnorm_linear_argmax_keep", consumer="keep_if_active", edge=0,
           sole_reader=False, fused_op="rmsnorm_linear_argmax_keep_last", rewrite=_argmax_last,
           guard=_last_kept_of_this_draft),
    Fusion("fuse_argmax_gate",
           "confidence_gate(active, logprob, log_tau) of the lm-head draft -> "
           "rmsnorm_linear_argmax_keep_gate, the next step's active rows from the merge's epilogue",
           producer="rmsnorm_linear_argmax_keep", consumer="confidence_gate", edge=1, output=1,
           sole_reader=False, fused_op="rmsnorm_linear_argmax_keep_gate", rewrite=_argmax_gate,
           guard=_gate_of_this_draft),
    Fusion("fuse_argmax_last_gate",
           "confidence_gate of a draft whose last_kept is folded -> "
           "rmsnorm_linear_argmax_keep_last_gate",
           producer="rmsnorm_linear_argmax_keep_last", consumer="confidence_gate", edge=1,
           output=1, sole_reader=False, fused_op="rmsnorm_linear_argmax_keep_last_gate",
           rewrite=_argmax_gate, guard=_gate_of_this_draft),
    Fusion("fuse_embed_concat_linear",
           "embedding -> enorm and hnorm -> linear_concat (the MTP input) -> "
           "embed_rmsnorm_linear_concat: eh_proj gathers the embedding rows and normalises both "
           "halves in its prologue, so none of the four is stored",
           producer="embedding", consumer="rmsnorm", edge=0, sole_reader=True,
           fused_op="embed_rmsnorm_linear_concat", rewrite=_embed_concat_linear, guard=_mtp_input,
           at="last"),
)
