"""Multi-head latent attention (DeepSeek-V2/V3 MLA) ops for absorbed decode over a paged latent cache.

`head_linear` (out[i, h] = w[h] @ x[i, h]: W_UK^T into the query, W_UV out of the latent),
`mla_kv_write` (one latent row per token: the normalised latent c [R] and the roped key k_pe [P]),
`mla_decode_attention` (every query head over the latent rows: scores q_lat . c + q_pe . k_pe,
output sum_t p_t c_t in latent space). A token's row lives in two pools of the GQA pools' layout,
one "head" per row: `pe_cache` [num_blocks, block_size, 1, P] (the roped key, position-dependent)
and `latent_cache` [num_blocks, block_size, 1, R] (the latent: the keys' position-free part and the
values), which the draft chain threads as its k_cache and v_cache. `mla_unabsorbed_ref` is
transformers' formulation (latents expanded through kv_b_proj) the absorbed ops are tested against.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from draft_circuit.circuit.types import ROW, TensorSpec
from draft_circuit.ops.bindings import TRITON, Applies, Condition, KernelBinding, Scratch, Tensors, kernel
from draft_circuit.ops.registry import (ATTENTION, MATMUL, Cost, CostContext, Env, OpDef, Specs, check,
                                        default_cost, dim_eq, elt, rank, register, same_dtype)


# ---- head_linear ----
def head_linear_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [n, H*K], w [H, N, K] -> [n, H*N], fp32 products rounded once; one row at a time (a
    batched product would let the row count pick the kernel, and so the bits)."""
    heads, rows, k = w.shape
    wf = w.float()
    out = x.new_empty(x.shape[0], heads * rows)
    for i in range(x.shape[0]):
        out[i] = torch.bmm(wf, x[i].float().view(heads, k, 1)).view(-1).to(x.dtype)
    return out


def _infer_head_linear(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    x, w = ins
    same_dtype(x, w)
    rank(x, 2, "head_linear x [n, heads * K]")
    rank(w, 3, "head_linear weight [heads, N, K]")
    heads, rows, k = (int(d) for d in w.shape)
    dim_eq(x.shape[1], heads * k, f"head_linear x width vs heads * K ({x}, weight {w})")
    return [TensorSpec(dtype=x.dtype, shape=(x.shape[0], heads * rows))]


_k_head_linear = kernel("head_linear", "head_linear")

register(OpDef(
    name="head_linear", inputs=("x", "weight"), outputs=("out",), infer=_infer_head_linear,
    reference=lambda t, a: (head_linear_ref(t[0], t[1]),), tags=frozenset({MATMUL}),
    cost=lambda ins, outs, a, ctx, env: default_cost(
        ins, outs, env, flops=2 * ins[0].concrete(env)[0] * math.prod(int(d) for d in ins[1].shape)),
    kernels=(KernelBinding("triton_head_linear", lambda i, o, w, a: _k_head_linear()(i[0], i[1], o[0]),
                           Applies(TRITON)),),
))


# ---- the latent cache ----
class MlaKvWriteAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    row_offset: int = 0


def _check_latent_pools(pe: TensorSpec, latent: TensorSpec, tables: TensorSpec, live: TensorSpec,
                        rows: Any) -> tuple[int, int]:
    """(P, R) of the pools pe_cache [num_blocks, block_size, 1, P], latent_cache [.., 1, R]."""
    for spec, what in ((pe, "pe_cache [num_blocks, block_size, 1, qk_rope_head_dim]"),
                       (latent, "latent_cache [num_blocks, block_size, 1, kv_lora_rank]")):
        rank(spec, 4, what)
        check(spec.shape[2] == 1, lambda: f"an MLA pool holds one head per row, got {spec}")
    check(pe.shape[:3] == latent.shape[:3], lambda: f"pe_cache {pe} and latent_cache {latent} differ in blocks")
    rank(tables, 2, "block tables [n, max_blocks]")
    rank(live, 1, "live rows [n]")
    check(tables.dtype == "int32" and live.dtype == "int32",
          lambda: f"block tables and live rows must be int32, got {tables}, {live}")
    dim_eq(tables.shape[0], rows, "block table rows")
    dim_eq(live.shape[0], rows, "live row count rows")
    return int(pe.shape[3]), int(latent.shape[3])


def _infer_mla_kv_write(ins: list[TensorSpec], a: MlaKvWriteAttrs) -> list[TensorSpec]:
    pe_cache, latent_cache, latent, k_pe, tables, live = ins[:6]
    same_dtype(pe_cache, latent_cache, latent, k_pe)
    rank(latent, 2, "latent [n, kv_lora_rank]")
    rank(k_pe, 2, "k_pe [n, qk_rope_head_dim]")
    dim_eq(k_pe.shape[0], latent.shape[0], f"latent and k_pe rows ({latent}, {k_pe})")
    p, r = _check_latent_pools(pe_cache, latent_cache, tables, live, latent.shape[0])
    dim_eq(latent.shape[1], r, f"latent width vs latent_cache ({latent}, {latent_cache})")
    dim_eq(k_pe.shape[1], p, f"k_pe width vs pe_cache ({k_pe}, {pe_cache})")
    if len(ins) > 6:
        check(ins[6].dtype == "int32" and ins[6].shape == (latent.shape[0],),
              lambda: f"active must be int32[{latent.shape[0]}], got {ins[6]}")
    return [pe_cache, latent_cache]


def _slots(cache: torch.Tensor, tables: torch.Tensor, live: torch.Tensor,
           row_offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of each sequence's row live_rows + row_offset."""
    rows = live.long() + row_offset
    block_size = cache.shape[1]
    blocks = tables.long().gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    return blocks, rows % block_size


def mla_kv_write_ref(pe_cache: torch.Tensor, latent_cache: torch.Tensor, latent: torch.Tensor,
                     k_pe: torch.Tensor, tables: torch.Tensor, live: torch.Tensor,
                     active: torch.Tensor | None, row_offset: int) -> None:
    blocks, offs = _slots(pe_cache, tables, live, row_offset)
    keep = torch.ones_like(blocks, dtype=torch.bool) if active is None else active != 0
    pe_cache[blocks[keep], offs[keep], 0] = k_pe[keep]
    latent_cache[blocks[keep], offs[keep], 0] = latent[keep]


def _mla_kv_write(t: list[torch.Tensor], a: MlaKvWriteAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    mla_kv_write_ref(t[0], t[1], t[2], t[3], t[4], t[5], t[6] if len(t) > 6 else None, a.row_offset)
    return t[0], t[1]


_k_kv_write = kernel("mla_kv_write", "mla_kv_write")


def _launch_kv_write(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    pe_cache, latent_cache, latent, k_pe, tables, live, *active = ins
    _k_kv_write()(pe_cache, latent_cache, latent, k_pe, tables, live, row_offset=a.row_offset,
                  active=active[0] if active else None)


register(OpDef(
    name="mla_kv_write",
    inputs=("pe_cache", "latent_cache", "latent", "k_pe", "block_tables", "live_rows", "active"),
    outputs=("pe_cache", "latent_cache"), num_required=6, attrs=MlaKvWriteAttrs, infer=_infer_mla_kv_write,
    reference=_mla_kv_write, mutates={0: 0, 1: 1}, tags=frozenset({ATTENTION}),
    # a row's latent and k_pe read once and written once to its slot
    cost=lambda ins, outs, a, ctx, env: Cost(sum(s.nbytes(env) for s in ins[2:6]),
                                             ins[2].nbytes(env) + ins[3].nbytes(env), 0),
    kernels=(KernelBinding("triton_mla_kv_write", _launch_kv_write, Applies(TRITON)),),
))


# ---- absorbed decode attention ----
class MlaAttentionAttrs(BaseModel):
    """scale: the softmax scale over the full query-key head (qk_nope + qk_rope dims, with
    YaRN's mscale); it is not derivable from the latent shapes, so it is required."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    scale: float = Field(gt=0)
    row_offset: int = 0


def _infer_mla_attention(ins: list[TensorSpec], a: MlaAttentionAttrs) -> list[TensorSpec]:
    q_lat, q_pe, pe_cache, latent_cache, tables, live = ins
    same_dtype(q_lat, q_pe, pe_cache, latent_cache)
    rank(q_lat, 2, "q_lat [n, heads * kv_lora_rank]")
    rank(q_pe, 2, "q_pe [n, heads * qk_rope_head_dim]")
    dim_eq(q_pe.shape[0], q_lat.shape[0], f"q_lat and q_pe rows ({q_lat}, {q_pe})")
    p, r = _check_latent_pools(pe_cache, latent_cache, tables, live, q_lat.shape[0])
    qw, pw = int(q_lat.shape[1]), int(q_pe.shape[1])
    check(qw % r == 0 and pw % p == 0 and qw // r == pw // p,
          lambda: f"q_lat {q_lat} and q_pe {q_pe} must hold the same heads of {r} and {p} "
                  f"(latent_cache {latent_cache}, pe_cache {pe_cache})")
    return [q_lat]


def mla_heads(q_lat: Any, pe_cache: Any, latent_cache: Any) -> tuple[int, int, int]:
    """(heads, R, P) of the attention's operands (tensors or specs)."""
    r, p = int(latent_cache.shape[3]), int(pe_cache.shape[3])
    return int(q_lat.shape[1]) // r, r, p


def mla_decode_attention_ref(q_lat: torch.Tensor, q_pe: torch.Tensor, pe_cache: torch.Tensor,
                             latent_cache: torch.Tensor, tables: torch.Tensor, live: torch.Tensor,
                             scale: float, row_offset: int) -> torch.Tensor:
    """Each row's heads over its own L = live_rows + row_offset + 1 latent rows, in fp32:
    s[h, t] = scale * ([q_lat[h], q_pe[h]] . [c_t, k_pe_t]); out[h] = softmax(s[h]) @ c."""
    heads, r, p = mla_heads(q_lat, pe_cache, latent_cache)
    block_size = pe_cache.shape[1]
    out = torch.empty_like(q_lat)
    for i in range(q_lat.shape[0]):
        length = int(live[i]) + row_offset + 1
        rows = torch.arange(length, device=q_lat.device)
        blocks, offs = tables[i, rows // block_size].long(), rows % block_size
        c = latent_cache[blocks, offs, 0].float()  # [L, R]
        kv = torch.cat([c, pe_cache[blocks, offs, 0].float()], dim=1)  # [L, R + P]
        q = torch.cat([q_lat[i].float().view(heads, r), q_pe[i].float().view(heads, p)], dim=1)
        probs = ((q @ kv.T) * scale).softmax(-1)  # [heads, L]
        out[i] = (probs @ c).reshape(-1).to(q_lat.dtype)
    return out


def mla_unabsorbed_ref(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                       kv_b_proj: torch.Tensor, scale: float) -> torch.Tensor:
    """transformers' MLA for one sequence's query rows over its L cached tokens, causal by row
    position (query row j is token L - Q + j): latent [L, R] through kv_b_proj [H*(Dn+Dv), R]
    into per-head keys [L, H, Dn] (plus the shared k_pe [L, P]) and values [L, H, Dv].
    q_nope [Q, H, Dn], q_pe [Q, H, P] -> [Q, H, Dv], fp32."""
    num_q, heads, dn = q_nope.shape
    length = latent.shape[0]
    kv = (latent.float() @ kv_b_proj.float().T).view(length, heads, -1)
    k_nope, v = kv[..., :dn], kv[..., dn:]
    scores = torch.einsum("qhd,lhd->hql", q_nope.float(), k_nope) + \
        torch.einsum("qhp,lp->hql", q_pe.float(), k_pe.float())
    pos = torch.arange(length - num_q, length)
    scores = scores.masked_fill(torch.arange(length)[None, :] > pos[:, None], float("-inf"))
    return torch.einsum("hql,lhv->qhv", (scores * scale).softmax(-1), v)


def _mla_attention_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    """The floor's term: every live latent row (R + P elements) read once per sequence, for all
    heads; flops of the scores and the latent output."""
    q_lat, q_pe, pe_cache, latent_cache = ins[:4]
    n = env[ROW] if q_lat.shape[0] == ROW else int(q_lat.shape[0])
    heads, r, p = mla_heads(q_lat, pe_cache, latent_cache)
    live_rows = n * (ctx.kv_rows + a.row_offset + 1)
    small = sum(s.nbytes(env) for s in (q_lat, q_pe, ins[4], ins[5]))
    return Cost(small + live_rows * (r + p) * elt(latent_cache.dtype), outs[0].nbytes(env),
                2 * live_rows * heads * (2 * r + p))


_k_attn = kernel("mla_decode", "mla_decode_attention")
_k_attn_ws = kernel("mla_decode", "mla_decode_workspace_shape")


def _launch_attention(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    q_lat, q_pe, pe_cache, latent_cache, tables, live = ins
    _k_attn()(q_lat, q_pe, pe_cache, latent_cache, tables, live, outs[0], scale=a.scale,
              row_offset=a.row_offset, workspace=ws[0])


def _attention_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    q_lat, _, pe_cache, latent_cache, tables = ins[:5]
    heads, r, _ = mla_heads(q_lat, pe_cache, latent_cache)
    capacity = int(tables.shape[1]) * int(pe_cache.shape[1])
    return [("float32", _k_attn_ws()(q_lat.concrete(env)[0], heads, r, capacity))]


register(OpDef(
    name="mla_decode_attention",
    inputs=("q_lat", "q_pe", "pe_cache", "latent_cache", "block_tables", "live_rows"),
    outputs=("out",), attrs=MlaAttentionAttrs, infer=_infer_mla_attention, cost=_mla_attention_cost,
    reference=lambda t, a: (mla_decode_attention_ref(t[0], t[1], t[2], t[3], t[4], t[5], a.scale,
                                                     a.row_offset),),
    tags=frozenset({ATTENTION}),
    # what kernels.mla_decode refuses at launch, refused here at plan time
    kernels=(KernelBinding("triton_mla_decode", _launch_attention, Applies(TRITON, conditions=(
        Condition("row_offset >= 0", lambda ins, a: a.row_offset >= 0),
        Condition("block tables of >= 1 column", lambda ins, a: ins[4].shape[1] != 0))),
        workspace=_attention_ws, launches=2),),  # the KV splits, then their merge
))
