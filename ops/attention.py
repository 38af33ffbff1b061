"""Rope and paged-KV ops: rope, kv_write, rope_kv_write, decode_attention, with their kernel
bindings (Triton, and a capturable torch kv_write). The token ops live in ops/tokens.py.

KV pools are states of shape [num_blocks, block_size, num_kv_heads, head_dim]; a sequence's row r
lives at block_tables[i, r // block_size], offset r % block_size. Step offsets are attrs, so a
k-step chain needs no integer arithmetic ops: step j writes row live_rows + j at position + j.
"""
from __future__ import annotations

import math
from functools import lru_cache
from typing import Any, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import ROW, Dim, TensorSpec
from draft_circuit.ops.bindings import (CUDA, TRITON, Applies, Condition, KernelBinding, Scratch, Tensors, kernel,
                                        traced_launches)
from draft_circuit.ops.registry import (ATTENTION, FUSED, Cost, CostContext, Env, OpDef, Specs, check, dim_eq,
                                        elt, index_dtype, rank, register, same_dtype)
from draft_circuit.ops.row_invariant import row_invariant_attention, tiled
from draft_circuit.ops.tokens import TokenError, embedding_ref  # noqa: F401  (their old home)


class RopeAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    head_dim: int
    theta: float = 10000.0
    pos_offset: int = 0
    rotary_dim: int | None = None  # rotate only each head's first rotary_dim dims; None: all

    def model_post_init(self, _: object) -> None:  # else the reference fails at run time
        if self.head_dim <= 0 or not self.theta > 0:
            raise ValueError(f"head_dim and theta must be > 0, got {self.head_dim}, {self.theta}")
        _check_rotary_dim(self.head_dim, self.rotary_dim)


class KvWriteAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    row_offset: int = 0


class RopeKvWriteAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    head_dim: int
    theta: float = 10000.0
    pos_offset: int = 0
    row_offset: int = 0
    rotary_dim: int | None = None  # as RopeAttrs'

    def model_post_init(self, _: object) -> None:  # else the reference fails at run time
        if self.head_dim <= 0 or not self.theta > 0:
            raise ValueError(f"head_dim and theta must be > 0, got {self.head_dim}, {self.theta}")
        _check_rotary_dim(self.head_dim, self.rotary_dim)


def _check_rotary_dim(head_dim: int, rotary_dim: int | None) -> None:
    if rotary_dim is not None and not (0 < rotary_dim <= head_dim and rotary_dim % 2 == 0):
        raise ValueError(f"rotary_dim must be even and in (0, head_dim = {head_dim}], got {rotary_dim}")


class AttentionAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    scale: float | None = None  # default 1/sqrt(head_dim)
    row_offset: int = 0


# ---- rope ----
# inv_freq by (rotary dims, theta, device) and the rotation's sign by device, made once: the same
# values every call computes (issue 20: at the CPU references' tiny shapes every torch op costs
# microseconds whatever its size). Never written to by a caller.
@lru_cache(maxsize=16)
def _inv_freq(r: int, theta: float, device: torch.device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, r, 2, device=device).float() / r))


@lru_cache(maxsize=16)
def _sign(device: torch.device) -> torch.Tensor:
    return torch.tensor([[-1.0], [1.0]], device=device)


def _rope_angles(positions: torch.Tensor, theta: float, pos_offset: int, r: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, 1, 1, R/2] of each row's angles (q and k of a row share them)."""
    pos = positions.float()
    if pos_offset or pos.dtype != positions.dtype:  # + 0 is the identity on integer positions
        pos = pos + pos_offset
    angle = pos.unsqueeze(-1) * _inv_freq(r, theta, positions.device)  # [n, R/2]
    shape = (angle.shape[0], 1, 1, r // 2)
    return angle.cos().view(shape), angle.sin().view(shape)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, r: int) -> torch.Tensor:
    """Rotate-half of x [n, heads * head_dim] in fp32 -> [n, heads, head_dim] in x's dtype:
    with halves [x1, x2] of each head's first R dims, [x1 cos, x2 cos] + [x2 sin, x1 sin] * [-1, 1]
    = [x1 cos - x2 sin, x2 cos + x1 sin] in every bit (a - b is a + (-b), and a product by +-1
    is exact, fused into the add or not)."""
    n = x.shape[0]
    sign = _sign(x.device)
    xf = x.float().view(n, -1, head_dim)
    halves = (xf if r == head_dim else xf[..., :r]).view(n, -1, 2, r // 2)  # [n, heads, 2, R/2]
    rot = torch.addcmul(halves * cos, (halves * sin).flip(2), sign).view(n, -1, r)
    if r < head_dim:
        rot = torch.cat([rot, xf[..., r:]], dim=-1)
    return rot.to(x.dtype)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, head_dim: int, theta: float,
             pos_offset: int, rotary_dim: int | None = None) -> torch.Tensor:
    """HF rotate-half RoPE over x [n, heads * head_dim], computed in fp32, cast once. With
    rotary_dim R (HF's partial rotary, GLM-4.5), rotate-half runs inside each head's first R dims
    with frequencies over R and the rest pass through."""
    r = head_dim if rotary_dim is None else rotary_dim
    cos, sin = _rope_angles(positions, theta, pos_offset, r)
    return _rotate(x, cos, sin, head_dim, r).view(x.shape[0], -1)


def _infer_rope(ins: list[TensorSpec], a: RopeAttrs) -> list[TensorSpec]:
    x, pos = ins
    rank(x, 2, "rope input [n, heads * head_dim]")
    rank(pos, 1, "positions")
    index_dtype(pos, "positions")
    dim_eq(pos.shape[0], x.shape[0], "rope rows")
    check(a.head_dim % 2 == 0 and isinstance(x.shape[1], int) and x.shape[1] % a.head_dim == 0,
          lambda: f"rope head_dim {a.head_dim} must be even and divide {x}")
    return [x]


register(OpDef(
    name="rope", inputs=("x", "positions"), outputs=("out",), attrs=RopeAttrs, infer=_infer_rope,
    reference=lambda t, a: (rope_ref(t[0], t[1], a.head_dim, a.theta, a.pos_offset, a.rotary_dim),),
    tags=frozenset({ATTENTION}),
))


# ---- paged KV ----
def _check_paged(cache: TensorSpec, tables: TensorSpec, live: TensorSpec, rows: Dim) -> None:
    rank(cache, 4, "KV cache [num_blocks, block_size, kv_heads, head_dim]")
    rank(tables, 2, "block tables [n, max_blocks]")
    rank(live, 1, "live rows [n]")
    check(tables.dtype == "int32" and live.dtype == "int32",
          lambda: f"block tables and live rows must be int32, got {tables}, {live}")
    dim_eq(tables.shape[0], rows, "block table rows")
    dim_eq(live.shape[0], rows, "live row count rows")


def _infer_kv_write(ins: list[TensorSpec], a: KvWriteAttrs) -> list[TensorSpec]:
    kc, vc, k, v, tables, live = ins[:6]
    same_dtype(kc, vc, k, v)
    check(kc.shape == vc.shape, lambda: f"K and V caches differ: {kc} vs {vc}")
    _check_paged(kc, tables, live, k.shape[0])
    rank(k, 2, "k [n, kv_heads * head_dim]")
    check(k.shape == v.shape, lambda: f"k and v differ: {k} vs {v}")
    dim_eq(k.shape[1], int(kc.shape[2]) * int(kc.shape[3]), f"k width vs cache heads*head_dim ({k}, {kc})")
    if len(ins) > 6:
        check(ins[6].dtype == "int32" and ins[6].shape == (k.shape[0],),
              lambda: f"active must be int32[{k.shape[0]}], got {ins[6]}")
    return [kc, vc]


def kv_write_ref(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 tables: torch.Tensor, live: torch.Tensor, active: torch.Tensor | None,
                 row_offset: int) -> None:
    block_size, heads, dim = kc.shape[1:]
    _write_rows(kc, vc, k.view(-1, heads, dim), v.view(-1, heads, dim), tables, live, active,
                row_offset)


def _write_rows(kc: torch.Tensor, vc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                tables: torch.Tensor, live: torch.Tensor, active: torch.Tensor | None,
                row_offset: int) -> None:
    """k, v [n, kv_heads, head_dim] into each active row's slot. Every row's block is gathered
    (a row past its table raises, active or not); the active rows are selected once, and not at
    all when every row is active."""
    block_size = kc.shape[1]
    rows = live.long()
    if row_offset:
        rows = rows + row_offset
    blocks = tables.gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    offs = rows % block_size
    if active is not None:
        keep = active.nonzero().view(-1)
        if keep.numel() < active.numel():
            blocks, offs, k, v = blocks[keep], offs[keep], k[keep], v[keep]
    kc.index_put_((blocks, offs), k)
    vc.index_put_((blocks, offs), v)


def _kv_write(t: list[torch.Tensor], a: KvWriteAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc, k, v, tables, live = t[:6]
    kv_write_ref(kc, vc, k, v, tables, live, t[6] if len(t) > 6 else None, a.row_offset)
    return kc, vc


def _kv_write_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    k, v = ins[2], ins[3]
    return Cost(k.nbytes(env) + v.nbytes(env), k.nbytes(env) + v.nbytes(env), 0)


def _kv_write_capturable(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    """Paged write where inactive rows write back what the slot held (no boolean mask, so no
    data-dependent shapes and no host sync)."""
    kc, vc, k, v, tables, live, *active = ins
    block_size, heads, dim = kc.shape[1:]
    rows = live.long() + a.row_offset
    blocks = tables.long().gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    offs = rows % block_size
    for cache, new in ((kc, k), (vc, v)):
        new = new.view(-1, heads, dim)
        if active:
            new = torch.where(active[0].bool().view(-1, 1, 1), new, cache[blocks, offs])
        cache[blocks, offs] = new


register(OpDef(
    name="kv_write", inputs=("k_cache", "v_cache", "k", "v", "block_tables", "live_rows", "active"),
    outputs=("k_cache", "v_cache"), num_required=6, attrs=KvWriteAttrs, infer=_infer_kv_write,
    reference=_kv_write, cost=_kv_write_cost, mutates={0: 0, 1: 1}, tags=frozenset({ATTENTION}),
    kernels=(KernelBinding("torch_kv_write", _kv_write_capturable, Applies(CUDA),
                           launches=traced_launches(_kv_write_capturable, _infer_kv_write)),),
))


def _infer_rope_kv_write(ins: list[TensorSpec], a: RopeKvWriteAttrs) -> list[TensorSpec]:
    q, k, v, pos, kc, vc, tables, live = ins[:8]
    (q_out,) = _infer_rope([q, pos], RopeAttrs(head_dim=a.head_dim))
    _infer_rope([k, pos], RopeAttrs(head_dim=a.head_dim))
    caches = _infer_kv_write([kc, vc, k, v, tables, live, *ins[8:]], KvWriteAttrs())
    return [q_out, *caches]


def _rope_kv_write(t: list[torch.Tensor], a: RopeKvWriteAttrs) -> tuple[torch.Tensor, ...]:
    """rope(q), rope(k) and the KV write; q and k of one dtype are roped together (one angle
    table, one rotation: elementwise, so each value is the one rope_ref gives it)."""
    q, k, v, pos, kc, vc, tables, live = t[:8]
    active = t[8] if len(t) > 8 else None
    r = a.head_dim if a.rotary_dim is None else a.rotary_dim
    cos, sin = _rope_angles(pos, a.theta, a.pos_offset, r)
    heads, dim = kc.shape[2:]
    if q.dtype != k.dtype:
        q_rot = _rotate(q, cos, sin, a.head_dim, r).view(q.shape)
        k_rot = _rotate(k, cos, sin, a.head_dim, r)
    else:
        qk = _rotate(torch.cat([q, k], dim=1), cos, sin, a.head_dim, r)  # [n, q + kv heads, d]
        q_heads = q.shape[1] // a.head_dim
        q_rot, k_rot = qk[:, :q_heads].reshape(q.shape), qk[:, q_heads:]  # k_rot [n, kv heads, d]
    if k_rot.shape[1:] != kc.shape[2:]:  # the cache's heads need not be rope's
        k_rot = k_rot.reshape(-1, heads, dim)
    _write_rows(kc, vc, k_rot, v.view(-1, heads, dim), tables, live, active, a.row_offset)
    return q_rot, kc, vc


_k_rope_kv = kernel("rope_kv_write", "rope_kv_write")


def _launch_rope_kv_write(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    q, k, v, pos, kc, vc, tables, live, *active = ins
    d = a.head_dim
    _k_rope_kv()(q, k, v, pos, live, tables, kc, vc, outs[0], num_heads=q.shape[1] // d,
               num_kv_heads=kc.shape[2], head_dim=d, theta=a.theta, pos_offset=a.pos_offset,
               row_offset=a.row_offset, active=active[0] if active else None, rotary_dim=a.rotary_dim)


register(OpDef(
    name="rope_kv_write",
    inputs=("q", "k", "v", "positions", "k_cache", "v_cache", "block_tables", "live_rows", "active"),
    outputs=("q_out", "k_cache", "v_cache"), num_required=8, attrs=RopeKvWriteAttrs,
    infer=_infer_rope_kv_write, reference=_rope_kv_write, mutates={1: 4, 2: 5},
    cost=lambda ins, outs, a, ctx, env: Cost(
        sum(s.nbytes(env) for s in ins[:4]), outs[0].nbytes(env) + 2 * ins[1].nbytes(env), 0),
    tags=frozenset({ATTENTION, FUSED}),
    # the kernel takes any block size (a runtime argument); shapes and dtypes the rule checks
    kernels=(KernelBinding("triton_rope_kv_write", _launch_rope_kv_write, Applies(TRITON)),),
))


# ---- attention ----
def _infer_attention(ins: list[TensorSpec], a: AttentionAttrs) -> list[TensorSpec]:
    q, kc, vc, tables, live = ins
    same_dtype(q, kc, vc)
    check(kc.shape == vc.shape, lambda: f"K and V caches differ: {kc} vs {vc}")
    _check_paged(kc, tables, live, q.shape[0])
    rank(q, 2, "q [n, heads * head_dim]")
    kv_heads, dim = kc.shape[2], kc.shape[3]
    check(isinstance(q.shape[1], int) and q.shape[1] % (int(kv_heads) * int(dim)) == 0,
          lambda: f"q width must be a multiple of kv_heads*head_dim ({q} vs cache {kc})")
    return [q]


def decode_attention_ref(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                         tables: torch.Tensor, live: torch.Tensor, scale: float | None,
                         row_offset: int) -> torch.Tensor:
    """Attention of each row's query over its own live KV rows only (0..live + row_offset),
    gathered through its table, in fp32; a row's bits never depend on the rows beside it (which
    is what makes a k+1-row verify agree with one-row decoding exactly). On CPU in fp32 / fp16 /
    bf16 the rows are batched in fixed-shape tiles (ops/row_invariant.py, measured bitwise in
    tests/ops/test_attention_row_invariant.py; issue 20: one row at a time was half a CPU
    verify); elsewhere, where nothing was measured, one row at a time."""
    dim = kc.shape[3]
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    lengths = live.long() + row_offset + 1
    bad = (lengths < 0).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"decode_attention row {i}: live_rows {int(live[i])} + row_offset "
                         f"{row_offset} + 1 < 0 rows to attend to")
    if tiled(q):
        return row_invariant_attention(q, kc, vc, tables, lengths, scale)
    return _attention_row_by_row(q, kc, vc, tables, lengths.tolist(), scale)


def _attention_row_by_row(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor,
                          lengths: list[int], scale: float) -> torch.Tensor:
    """One row at a time. Consecutive rows with the same table (one sequence's rows of a verify
    or a prefill) share one gather, up to the longest of them: a row reads the first `length`
    rows of it, the same values in the same layout as its own gather."""
    block_size, kv_heads, dim = kc.shape[1:]
    n, heads = q.shape[0], q.shape[1] // dim
    out = torch.empty_like(q)
    same: list[bool] = (tables[1:] == tables[:-1]).all(1).tolist() if n > 1 else []
    start = 0
    while start < n:
        end = start + 1
        while end < n and same[end - 1]:
            end += 1
        rows = torch.arange(max(lengths[start:end]), device=q.device)
        blocks = tables[start, rows // block_size].long()
        keys = kc[blocks, rows % block_size].float().repeat_interleave(heads // kv_heads, dim=1)
        vals = vc[blocks, rows % block_size].float().repeat_interleave(heads // kv_heads, dim=1)
        for i in range(start, end):
            length = lengths[i]
            qi = q[i].float().view(heads, dim)
            scores = torch.einsum("hd,lhd->hl", qi, keys[:length]) * scale    # [heads, L]
            out[i] = torch.einsum("hl,lhd->hd", scores.softmax(-1), vals[:length]).reshape(-1).to(q.dtype)
        start = end
    return out


def _attention_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    q, kc = ins[0], ins[1]
    n = env[ROW] if q.shape[0] == ROW else int(q.shape[0])
    kv_row_bytes = 2 * int(kc.shape[2]) * int(kc.shape[3]) * elt(kc.dtype)
    live_rows = n * (ctx.kv_rows + a.row_offset + 1)
    small = sum(s.nbytes(env) for s in (ins[0], ins[3], ins[4]))
    heads = int(q.shape[1]) // int(kc.shape[3])
    return Cost(small + live_rows * kv_row_bytes, outs[0].nbytes(env),
                4 * live_rows * heads * int(kc.shape[3]))


_k_attn = kernel("decode_attention", "decode_attention")
_k_attn_ws = kernel("decode_attention", "decode_attention_workspace_shape")


def _launch_attention(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    q, kc, vc, tables, live = ins
    d = kc.shape[3]
    _k_attn()(q, kc, vc, tables, live, outs[0], num_heads=q.shape[1] // d, num_kv_heads=kc.shape[2],
            head_dim=d, scale=a.scale if a.scale is not None else 1.0 / math.sqrt(d),
            row_offset=a.row_offset, workspace=ws[0])


def _attention_ws(ins: Sequence[TensorSpec], env: Env, a: Any) -> Scratch:
    q, kc, tables = ins[0], ins[1], ins[3]
    n, d = q.concrete(env)[0], int(kc.shape[3])
    rows = int(tables.shape[1]) * int(kc.shape[1])
    return [("float32", _k_attn_ws()(n, int(q.shape[1]) // d, d, rows))]


def _pow2_block(ins: Sequence[TensorSpec], a: Any) -> bool:
    bs = ins[1].shape[1]
    return isinstance(bs, int) and bs >= 8 and bs & (bs - 1) == 0


register(OpDef(
    name="decode_attention", inputs=("q", "k_cache", "v_cache", "block_tables", "live_rows"),
    outputs=("out",), attrs=AttentionAttrs, infer=_infer_attention, cost=_attention_cost,
    reference=lambda t, a: (decode_attention_ref(t[0], t[1], t[2], t[3], t[4], a.scale, a.row_offset),),
    tags=frozenset({ATTENTION}),
    # what kernels.decode_attention refuses at launch, refused here at plan time (issue 19.9)
    kernels=(KernelBinding("triton_decode_attention", _launch_attention, Applies(TRITON, conditions=(
        Condition("block_size a power of two >= 8", _pow2_block),
        Condition("row_offset >= 0", lambda ins, a: a.row_offset >= 0),
        Condition("block tables of >= 1 column", lambda ins, a: ins[3].shape[1] != 0))),
        workspace=_attention_ws, launches=2),),  # the KV splits, then their merge
))
