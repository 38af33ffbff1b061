"""Grouped MoE decode: out[i] = sum_j w[i, j] * SwiGLU_{ids[i, j]}(x[i]) + shared(x[i]), rows grouped by
expert on the device (capturable: no host sync, fixed worst-case grids, early exit), weights in x's
dtype or fp8 e4m3 with 128x128 block scales. `moe_grouped(...)`, `moe_grouped_workspace(...)`."""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import FLOAT_DTYPES, check, check_operand, describe

# Launches: align (one program groups the n*k slots by expert into BLOCK_M-row blocks), gate_up
# (SwiGLU into an [n*k, I] workspace, rounded to x's dtype as the reference rounds), down (times the
# routing weight, into an [n*k, H] fp32 workspace), the same two for the shared experts over dense
# row blocks, then combine (each row adds its k slots in slot order, then the shared expert).
# Width independence: a row's dot products see only its own operands and pinned tiles wherever its
# slot lands in its expert's block, and the combine order is per row, so its bits never depend on
# the other rows. An id outside [0, E) selects nothing. An expert holding more than BLOCK_M rows
# streams from memory about once: its other blocks run beside the first and hit its tiles in L2.

# Pinned tiles (changing them changes the bits, never makes them depend on n). BLOCK_M = 16 is the
# smallest tl.dot tile; BLOCK_K = 128 is DeepSeek-V3's scale block, so a K tile has one scale.
BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_H = 16, 32, 128, 128
SCALE_BLOCK = 128
ALIGN_CHUNK = 64
NUM_WARPS, NUM_STAGES = 4, 3
FP8 = torch.float8_e4m3fn


def max_blocks(num_slots: int, num_experts: int) -> int:
    """Worst-case BLOCK_M-row blocks: each expert holding slots adds at most one partial block."""
    return triton.cdiv(num_slots, BLOCK_M) + min(num_experts, num_slots)


@triton.jit(do_not_specialize=["num_slots", "num_experts", "num_blocks"])
def moe_align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, expert_start_ptr,
                     num_slots, num_experts, num_blocks,
                     BLOCK_M: tl.constexpr, EXPERTS: tl.constexpr, CHUNK: tl.constexpr):
    # One program: counts per expert, block ranges by a prefix sum, then each slot scattered to
    # its expert's start + its rank among the earlier slots of that expert (slot order kept).
    experts = tl.arange(0, EXPERTS)
    lanes = tl.arange(0, CHUNK)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for s0 in range(0, num_slots, CHUNK):
        e = tl.load(ids_ptr + s0 + lanes, mask=s0 + lanes < num_slots, other=-1)
        hit = (e[None, :] == experts[:, None]) & (experts[:, None] < num_experts)
        counts += tl.sum(hit.to(tl.int32), axis=1)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, axis=0)  # expert e owns blocks [ends[e] - blocks[e], ends[e])
    tl.store(expert_start_ptr + experts, (ends - blocks) * BLOCK_M, mask=experts < num_experts)
    for b0 in range(0, num_blocks, CHUNK):
        b = b0 + lanes
        owner = tl.sum((ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(owner < num_experts, owner, -1), mask=b < num_blocks)
    for p0 in range(0, num_blocks * BLOCK_M, CHUNK):
        p = p0 + lanes
        tl.store(sorted_ptr + p, tl.full((CHUNK,), -1, tl.int32), mask=p < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the starts and the -1 padding are written before any thread scatters
    for s0 in range(0, num_slots, CHUNK):
        s = s0 + lanes
        e = tl.load(ids_ptr + s, mask=s < num_slots, other=-1)
        live = (s < num_slots) & (e >= 0) & (e < num_experts)
        rank = tl.zeros((CHUNK,), dtype=tl.int32)
        for t0 in range(0, s0 + CHUNK, CHUNK):  # only earlier slots rank before s
            t = t0 + lanes
            f = tl.load(ids_ptr + t, mask=t < num_slots, other=-1)
            rank += tl.sum(((f[None, :] == e[:, None]) & (t[None, :] < s[:, None])).to(tl.int32), axis=1)
        start = tl.load(expert_start_ptr + e, mask=live, other=0)
        tl.store(sorted_ptr + start + rank, s, mask=live)


@triton.jit
def _block_rows(sorted_ptr, block_expert_ptr, pid_m, n_rows, GROUPED: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """(expert, slot or row index per lane, lane mask): grouped blocks come from the align
    kernel (expert -1: an unused block); dense blocks (shared experts) are rows in order."""
    lanes = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if GROUPED:
        expert = tl.load(block_expert_ptr + pid_m)
        idx = tl.load(sorted_ptr + lanes)
        live = idx >= 0
        return expert, tl.where(live, idx, 0), live
    else:
        return pid_m * 0, lanes, lanes < n_rows


@triton.jit
def _dot_k(acc, a_ptrs, a_mask, w_ptrs, w_mask, s_ptrs, s_mask, K,
           HAS_SCALE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc[BM, BN] += a[BM, K] @ w[BN, K]^T; fp8 w: converted exactly to a's dtype, each 128-wide
    K tile's product scaled by its block scale (s_ptrs point at the first K block's scales)."""
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        a = tl.load(a_ptrs + k0, mask=a_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=w_mask[:, None] & k_mask[None, :], other=0.0)
        if HAS_SCALE:
            s = tl.load(s_ptrs + k0 // BLOCK_K, mask=s_mask, other=0.0)
            acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision="ieee") * s[None, :]
        else:
            # ieee: fp32 inputs must not drop to tf32; 16-bit inputs ignore it
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit(do_not_specialize=["n_rows", "top_k"])
def expert_gate_up_kernel(x_ptr, w_ptr, scale_ptr, inter_ptr, sorted_ptr, block_expert_ptr,
                          n_rows, top_k, I, H,
                          stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_inter,
                          GROUPED: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # Row blocks vary fastest: an expert's blocks run side by side and share its tiles in L2.
    expert, dst, live = _block_rows(sorted_ptr, block_expert_ptr, tl.program_id(0), n_rows,
                                    GROUPED, BLOCK_M)
    if expert < 0:
        return
    rows = dst
    if GROUPED:
        rows = dst // top_k  # a grouped lane holds slot i*k + j of row i
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + tl.arange(0, BLOCK_K)[None, :]
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    g_ptrs = w_base + offs_n[:, None].to(tl.int64) * stride_wn + tl.arange(0, BLOCK_K)[None, :]
    u_ptrs = g_ptrs + I * stride_wn  # the up rows follow the I gate rows
    s_base = scale_ptr + expert.to(tl.int64) * stride_se
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_g = _dot_k(acc_g, x_ptrs, live, g_ptrs, n_mask, s_base + (offs_n // BLOCK_K) * stride_sn,
                   n_mask, H, HAS_SCALE, BLOCK_K)
    acc_u = _dot_k(acc_u, x_ptrs, live, u_ptrs, n_mask,
                   s_base + ((offs_n + I) // BLOCK_K) * stride_sn, n_mask, H, HAS_SCALE, BLOCK_K)
    act = acc_g * tl.sigmoid(acc_g) * acc_u
    out_ptrs = inter_ptr + dst[:, None].to(tl.int64) * stride_inter + offs_n[None, :]
    tl.store(out_ptrs, act.to(inter_ptr.dtype.element_ty), mask=live[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["n_rows"])
def expert_down_kernel(inter_ptr, w_ptr, scale_ptr, route_w_ptr, out_ptr, sorted_ptr,
                       block_expert_ptr, n_rows, H, I,
                       stride_inter, stride_we, stride_wn, stride_se, stride_sn, stride_out,
                       GROUPED: tl.constexpr, HAS_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    expert, src, live = _block_rows(sorted_ptr, block_expert_ptr, tl.program_id(0), n_rows,
                                    GROUPED, BLOCK_M)
    if expert < 0:
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < H
    a_ptrs = inter_ptr + src[:, None].to(tl.int64) * stride_inter + tl.arange(0, BLOCK_K)[None, :]
    w_ptrs = (w_ptr + expert.to(tl.int64) * stride_we + offs_n[:, None].to(tl.int64) * stride_wn
              + tl.arange(0, BLOCK_K)[None, :])
    s_ptrs = scale_ptr + expert.to(tl.int64) * stride_se + (offs_n // BLOCK_K) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _dot_k(acc, a_ptrs, live, w_ptrs, n_mask, s_ptrs, n_mask, I, HAS_SCALE, BLOCK_K)
    if GROUPED:
        acc = acc * tl.load(route_w_ptr + src, mask=live, other=0.0)[:, None]
    out_ptrs = out_ptr + src[:, None].to(tl.int64) * stride_out + offs_n[None, :]
    tl.store(out_ptrs, acc, mask=live[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["top_k"])
def moe_combine_kernel(contrib_ptr, shared_ptr, ids_ptr, out_ptr, top_k, num_experts, H,
                       stride_c, stride_s, stride_out,
                       HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, top_k):  # slot order, then the shared expert: the reference's order
        slot = row * top_k + j
        e = tl.load(ids_ptr + slot + offs * 0)  # the slot's expert, one copy per lane
        live = (e >= 0) & (e < num_experts)
        c = tl.load(contrib_ptr + slot.to(tl.int64) * stride_c + offs, mask=mask & live, other=0.0)
        acc = tl.where(live, acc + c, acc)
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + row.to(tl.int64) * stride_s + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + offs, acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def moe_grouped_workspace(n: int, top_k: int, num_experts: int, hidden: int, inter: int,
                          shared_inter: int, dtype: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype name, shape) of each scratch buffer `moe_grouped` needs at width n, in order:
    block slots, block experts, expert starts, routed intermediate, routed contributions, and
    with shared experts (shared_inter > 0) their intermediate and output. `dtype`: x's."""
    slots = n * top_k
    blocks = max_blocks(slots, num_experts)
    ws = [("int32", (blocks * BLOCK_M,)), ("int32", (blocks,)), ("int32", (num_experts,)),
          (dtype, (slots, inter)), ("float32", (slots, hidden))]
    if shared_inter:
        ws += [(dtype, (n, shared_inter)), ("float32", (n, hidden))]
    return ws


def _check_weights(name: str, w: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor,
                   scale: torch.Tensor | None) -> None:
    check_operand(name, w, shape, (FP8,) if scale is not None else (x.dtype,), x.device)
    check(w.is_contiguous(), lambda: f"{describe(name, w)}: must be contiguous")
    if scale is not None:
        blocks = (shape[0], triton.cdiv(shape[1], SCALE_BLOCK), triton.cdiv(shape[2], SCALE_BLOCK))
        check_operand(f"{name} scale_inv", scale, blocks, (torch.float32,), x.device)
        check(scale.is_contiguous(), lambda: f"{describe(f'{name} scale_inv', scale)}: must be contiguous")


def _experts(x, w_gate_up, w_down, gu_scale, down_scale, route_w, inter, contrib, sorted_slots,
             block_expert, top_k, grid_m, grouped) -> None:
    """The gate_up and down launches of one expert set (routed: grouped; shared: dense rows)."""
    n, hidden = x.shape
    i_size = w_down.shape[-1]
    has_scale = gu_scale is not None
    gu_s = gu_scale if has_scale else w_gate_up  # never read without HAS_SCALE
    dn_s = down_scale if has_scale else w_down
    common = dict(GROUPED=grouped, HAS_SCALE=has_scale, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  BLOCK_K=BLOCK_K, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    expert_gate_up_kernel[(grid_m, triton.cdiv(i_size, BLOCK_N))](
        x, w_gate_up, gu_s, inter, sorted_slots, block_expert, n, top_k, i_size, hidden,
        x.stride(0), w_gate_up.stride(0) if grouped else 0, w_gate_up.stride(-2),
        gu_s.stride(0) if has_scale else 0, gu_s.stride(-2) if has_scale else 0, inter.stride(0),
        **common)
    expert_down_kernel[(grid_m, triton.cdiv(hidden, BLOCK_N))](
        inter, w_down, dn_s, route_w, contrib, sorted_slots, block_expert, inter.shape[0], hidden,
        i_size, inter.stride(0), w_down.stride(0) if grouped else 0, w_down.stride(-2),
        dn_s.stride(0) if has_scale else 0, dn_s.stride(-2) if has_scale else 0, contrib.stride(0),
        **common)


def moe_grouped(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, out: torch.Tensor,
                workspace: Sequence[torch.Tensor] | None = None, *,
                gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None,
                shared_gate_up: torch.Tensor | None = None,
                shared_down: torch.Tensor | None = None) -> None:
    """out[n, H] (x's dtype) from x[n, H], topk_ids i32[n, k], topk_weights f32[n, k],
    w_gate_up [E, 2I, H] (gate rows, then up rows), w_down [E, H, I]; fp8 weights come with
    gate_up_scale f32[E, ceil(2I/128), ceil(H/128)] and down_scale f32[E, ceil(H/128), ceil(I/128)]
    (real weight = fp8 * its block's scale). Shared experts: shared_gate_up [2Is, H], shared_down
    [H, Is] in x's dtype. `workspace`: the buffers `moe_grouped_workspace` lists (None: allocated)."""
    check(x.dim() == 2 and w_gate_up.dim() == 3 and w_down.dim() == 3,
          lambda: f"{describe('x', x)}, {describe('w_gate_up', w_gate_up)}, "
                  f"{describe('w_down', w_down)}: expected [n, H], [E, 2I, H], [E, H, I]")
    n, hidden = x.shape
    num_experts, two_i, _ = w_gate_up.shape
    i_size, top_k = two_i // 2, topk_ids.shape[-1]
    check((gate_up_scale is None) == (down_scale is None),
          lambda: "gate_up_scale and down_scale come together (fp8 experts) or not at all")
    check((shared_gate_up is None) == (shared_down is None),
          lambda: "shared_gate_up and shared_down come together or not at all")
    check_operand("x", x, (n, hidden), FLOAT_DTYPES, x.device)
    check_operand("topk_ids", topk_ids, (n, top_k), (torch.int32,), x.device)
    check_operand("topk_weights", topk_weights, (n, top_k), (torch.float32,), x.device)
    check(topk_ids.is_contiguous() and topk_weights.is_contiguous(),
          lambda: f"{describe('topk_ids', topk_ids)} and topk_weights must be contiguous")
    _check_weights("w_gate_up", w_gate_up, (num_experts, 2 * i_size, hidden), x, gate_up_scale)
    _check_weights("w_down", w_down, (num_experts, hidden, i_size), x, down_scale)
    check_operand("out", out, (n, hidden), (x.dtype,), x.device)
    shared_i = 0
    if shared_gate_up is not None and shared_down is not None:
        shared_i = shared_gate_up.shape[0] // 2
        _check_weights("shared_gate_up", shared_gate_up.unsqueeze(0), (1, 2 * shared_i, hidden), x, None)
        _check_weights("shared_down", shared_down.unsqueeze(0), (1, hidden, shared_i), x, None)
    dtype = str(x.dtype).removeprefix("torch.")
    spec = moe_grouped_workspace(n, top_k, num_experts, hidden, i_size, shared_i, dtype)
    if workspace is None:
        workspace = [torch.empty(s, dtype=getattr(torch, d), device=x.device) for d, s in spec]
    check(len(workspace) == len(spec) and all(tuple(w.shape) == s and str(w.dtype) == f"torch.{d}"
                                              for w, (d, s) in zip(workspace, spec)),
          lambda: f"workspace must be {spec}, got {[(w.dtype, tuple(w.shape)) for w in workspace]}")
    if n == 0:
        return
    sorted_slots, block_expert, starts, inter, contrib, *shared_ws = workspace
    blocks = block_expert.shape[0]
    moe_align_kernel[(1,)](topk_ids, sorted_slots, block_expert, starts, n * top_k, num_experts,
                           blocks, BLOCK_M=BLOCK_M, EXPERTS=triton.next_power_of_2(num_experts),
                           CHUNK=ALIGN_CHUNK, num_warps=NUM_WARPS)
    _experts(x, w_gate_up, w_down, gate_up_scale, down_scale, topk_weights, inter, contrib,
             sorted_slots, block_expert, top_k, blocks, grouped=True)
    if shared_ws:
        _experts(x, shared_gate_up, shared_down, None, None, topk_weights, shared_ws[0],
                 shared_ws[1], sorted_slots, block_expert, 1, triton.cdiv(n, BLOCK_M), grouped=False)
    shared_out = shared_ws[1] if shared_ws else contrib
    moe_combine_kernel[(n, triton.cdiv(hidden, BLOCK_H))](
        contrib, shared_out, topk_ids, out, top_k, num_experts, hidden, contrib.stride(0),
        shared_out.stride(0), out.stride(0), HAS_SHARED=bool(shared_ws), BLOCK_H=BLOCK_H,
        num_warps=NUM_WARPS)
