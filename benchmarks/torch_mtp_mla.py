"""A plain-PyTorch DeepSeek-V3 MTP draft step (MLA attention, MoE MLP): the benchmark's peer for
the `deepseek_v3` config, as torch_mtp.py is for the GQA heads. No project registry, ops or
kernels: torch only, written from transformers' modeling_deepseek_v3 (same math as the project's
eager oracle, which the tests hold it to). CUDA-graph capturable, like torch_mtp: no host syncs,
no `.item()`, no data-dependent shapes.

One step over n rows: embed -> enorm / hnorm -> eh_proj over their concat -> the MTP decoder
layer (input_layernorm, MLA, residual, post_attention_layernorm, MoE, residual) ->
shared_head.norm -> lm-head -> argmax (and its log-probability).

Weights (`peer_weights`): the checkpoint's tensors under their stored names
(circuit/layers/deepseek.mtp_checkpoint_shapes: q_a_proj / q_a_layernorm / q_b_proj or q_proj,
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj, experts one by one). FP8 block-scaled
weights (e4m3 beside their 128x128 `weight_scale_inv`) are dequantised ONCE at setup to the model
dtype (bf16 on the GPU): torch has no block-scaled fp8 GEMM a plain-torch engine can rely on, so
such an engine runs the dequantised weights (transformers' fp8 `dequantize` path does the same).
The peer therefore streams 2 bytes a projection / expert weight where the circuit streams 1 and
holds the experts in bf16 (256 x 44 MiB = 22 GiB at DeepSeek-V3's shapes) beside the circuit's
fp8 ones; the floor it is timed against is the circuit's (fp8) floor. Tensors stored in the
model dtype (embedding, lm-head, eh_proj, norms, router) are used as they are, so they are the
very tensors the circuit's params hold (the head's bind keeps a tensor already in its dtype).
kv_b_proj is split at setup into W_UK [H, Dn, R] and W_UV [H, R, Dv] (absorbed decode, below);
the routed experts are stacked [E, 2I, H] / [E, H, I] and the shared ones fused [2S, H] / [H, S]
for torch_mtp.moe_experts.

KV cache: absorbed decode over the latent cache, as vLLM and SGLang decode MLA. One pool
`kv_cache` [num_blocks, block_size, R + P], a row per token: the kv_a_layernorm'ed latent
(kv_lora_rank R) then the roped key part (qk_rope_head_dim P), vLLM's `kv_c_and_k_pe_cache`
layout. Why absorbed: a decode step then reads R + P = 576 elements a cached token for all 128
heads, where the unabsorbed form (transformers') expands every cached latent through kv_b_proj
into 128 x (128 + 128) keys and values each step (~57x the bytes and the flops of the step's
attention at live ~100); W_UK goes into the query (q_nope @ W_UK, per head), W_UV onto the latent
output. Scores are [q_lat, q_pe] . [c, k_pe] over the same rows; the values are those rows' first
R columns. `latent_pool` builds the pool from the circuit's two pools (pe_cache, latent_cache):
the same contents, so both read the same prefix. Attention gathers `shape.attn_blocks` blocks a
sequence through the block table (valid ids >= 0), masks rows past each sequence's length.

RoPE: DeepSeek's interleaved pairs (rope_interleave) rotated at run time as transformers'
apply_rotary_pos_emb_interleave does, whose output order [x0', x2', .., x1', x3', ..] is the
order the circuit's pe_cache holds; YaRN's inv_freq as transformers' _compute_yarn_parameters,
cos / sin times its attention factor, the softmax scale qk_head_dim^-0.5 x mscale(factor,
mscale_all_dim)^2 (yarn_apply_mscale). Arithmetic as torch_mtp: norms and RoPE in fp32 rounded
once, matmuls in the model dtype, softmax in fp32, fp32 router logits, fp32 log-softmax.
"""
from __future__ import annotations

import math
from typing import Mapping

import torch
import torch.nn.functional as F

from benchmarks import torch_mtp as tm
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import (BIAS, EXPERTS_DOWN, EXPERTS_GATE_UP, GATE, SHARED_DOWN,
                                              SHARED_GATE_UP)
from draft_circuit.circuit.layers.rope import RopeScaling

SCALE, BLOCK = "_scale_inv", 128  # DeepSeek-V3's block scales: "<weight>_scale_inv", 128 x 128
LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepseekV3RMSNorm(rank) keeps its default eps
W_UK, W_UV = "self_attn.w_uk", "self_attn.w_uv"  # [H, Dn, R], [H, R, Dv], from kv_b_proj
_A = "self_attn."
_OWN = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "input_layernorm.weight",
        "post_attention_layernorm.weight", "shared_head.norm.weight", "shared_head.head.weight")
PEER_NOTE = ("torch peer (benchmarks/torch_mtp_mla.py): fp8 block-scaled projections and experts "
             "dequantised once at setup to the model dtype (bf16 on the GPU: it streams 2 bytes a weight, "
             "the circuit 1); absorbed MLA decode over one latent pool [blocks, block, kv_lora_rank + rope] "
             "(vLLM's layout); MoE as torch_mtp")


# ---- setup: weights, tables, the pool ----
def dequantize(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A stored weight as `dtype` numbers: fp8 x its 128x128 block scale in fp32, rounded once."""
    if scale is None:
        return w if w.dtype == dtype else w.to(dtype)
    rows, cols = w.shape
    s = scale.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (w.float() * s).to(dtype)


def peer_weights(c: MlaConfig, ckpt: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint-name MTP-layer tensors (fp8 ones beside `_scale_inv`) -> the step's weights, on
    the checkpoint's device: fp8 dequantised to `dtype`, the others shared as stored (the routing
    bias stays fp32), kv_b_proj split into W_UK / W_UV, experts stacked one at a time (no second
    full copy at setup)."""
    def real(name: str) -> torch.Tensor:
        return dequantize(ckpt[name], ckpt.get(name + SCALE), dtype)

    h, heads, r = c.hidden_size, c.num_attention_heads, c.kv_lora_rank
    dn, dv, i, e = c.qk_nope_head_dim, c.v_head_dim, c.moe_intermediate_size, c.n_routed_experts
    q = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight") if c.q_lora_rank is not None \
        else ("q_proj.weight",)
    names = (*_OWN, *(_A + k for k in (*q, "kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "o_proj.weight")),
             GATE)
    w = {k: real(k) for k in names}
    w[BIAS] = ckpt[BIAS].float()
    kv_b = real(_A + "kv_b_proj.weight").view(heads, dn + dv, r)
    w[W_UK], w[W_UV] = kv_b[:, :dn].contiguous(), kv_b[:, dn:].transpose(1, 2).contiguous()
    dev = ckpt["embed_tokens.weight"].device
    gu = torch.empty(e, 2 * i, h, dtype=dtype, device=dev)
    down = torch.empty(e, h, i, dtype=dtype, device=dev)
    for x in range(e):
        p = f"mlp.experts.{x}."
        gu[x, :i], gu[x, i:] = real(p + "gate_proj.weight"), real(p + "up_proj.weight")
        down[x] = real(p + "down_proj.weight")
    w[EXPERTS_GATE_UP], w[EXPERTS_DOWN] = gu, down
    if c.n_shared_experts:
        p = "mlp.shared_experts."
        w[SHARED_GATE_UP] = torch.cat([real(p + "gate_proj.weight"), real(p + "up_proj.weight")])
        w[SHARED_DOWN] = real(p + "down_proj.weight")
    return w


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(rope: RopeScaling, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 [dim / 2]: default RoPE, or YaRN as transformers' _compute_yarn_parameters."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    if rope.rope_type == "default":
        plain: torch.Tensor = 1.0 / pos_freqs
        return plain

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) \
            / (2 * math.log(rope.theta))
    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # the share of the unscaled frequency
    yarn: torch.Tensor = 1.0 / (rope.factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    return yarn


def attention_factor(rope: RopeScaling) -> float:
    """What YaRN multiplies cos and sin by (transformers' attention_scaling)."""
    if rope.rope_type == "default":
        return 1.0
    if rope.attention_factor_override is not None:
        return float(rope.attention_factor_override)
    if rope.mscale and rope.mscale_all_dim:
        return float(yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim))
    return yarn_mscale(rope.factor)


def softmax_scale(c: MlaConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim) twice under YaRN (yarn_apply_mscale)."""
    scale: float = (c.qk_nope_head_dim + c.qk_rope_head_dim) ** (-0.5)
    if c.rope.rope_type != "default" and c.rope.mscale_all_dim:
        m = yarn_mscale(c.rope.factor, c.rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def latent_pool(pe_cache: torch.Tensor, latent_cache: torch.Tensor) -> torch.Tensor:
    """The circuit's pools [B, S, 1, P] and [B, S, 1, R] -> one [B, S, R + P] pool, same rows."""
    return torch.cat([latent_cache, pe_cache], dim=-1).squeeze(2).contiguous()


# ---- the step ----
def rope_pe(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE on the last dim of x (P wide) in fp32, rounded once: interleaved pairs (x0, x1), .. as
    apply_rotary_pos_emb_interleave (output [rotated evens, rotated odds]) or rotate-half."""
    xf = x.float()
    half = x.shape[-1] // 2
    x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleave else (xf[..., :half], xf[..., half:])
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def latent_write(kv_cache: torch.Tensor, row: torch.Tensor, block_tables: torch.Tensor,
                 rows: torch.Tensor) -> None:
    """Each sequence's [latent, k_pe] row at cache row `rows[i]` through its block table."""
    block_size = kv_cache.shape[1]
    rows = rows.long()
    blocks = block_tables.long().gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    kv_cache.index_put_((blocks, rows % block_size), row)


def latent_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     lengths: torch.Tensor, scale: float, rank: int, attn_blocks: int) -> torch.Tensor:
    """q [n, H, R + P] ([q_nope W_UK, q_pe]) over each sequence's first lengths[i] pool rows ->
    the latent output [n, H, R]: softmax(scale q . row) @ row[:R] (matmuls in the model dtype,
    softmax in fp32)."""
    n = q.shape[0]
    block_size, width = kv_cache.shape[1:]
    length = attn_blocks * block_size
    rows = kv_cache[block_tables[:, :attn_blocks].long()].view(n, length, width)   # [n, L, R + P]
    scores = torch.matmul(q, rows.transpose(1, 2)) * scale                        # [n, H, L]
    valid = torch.arange(length, device=q.device).unsqueeze(0) < lengths.unsqueeze(1)
    scores = scores.masked_fill(~valid.unsqueeze(1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, rows[..., :rank])


def route(w: Mapping[str, torch.Tensor], c: MlaConfig, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepseekV3TopkRouter: fp32 logits, sigmoid, + e_score_correction_bias for the choice, the
    topk_group groups of the best top-2 sums kept, top-k experts of those; weights are the
    sigmoid scores, normalised (norm_topk_prob) and times routed_scaling_factor."""
    n, e = x.shape[0], c.n_routed_experts
    scores = F.linear(x.float(), w[GATE].float()).sigmoid()
    choice = scores + w[BIAS]
    if c.n_group > 1:
        groups = choice.view(n, c.n_group, -1).topk(2, dim=-1)[0].sum(dim=-1)       # [n, G]
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(c.topk_group, dim=-1, sorted=False)[1], 1.0)
        keep = keep.unsqueeze(-1).expand(n, c.n_group, e // c.n_group).reshape(n, e)
        choice = choice.masked_fill(keep == 0, float("-inf"))
    ids = choice.topk(c.num_experts_per_tok, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if c.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, weights * c.routed_scaling_factor


def mla(w: Mapping[str, torch.Tensor], c: MlaConfig, freqs: torch.Tensor, a: torch.Tensor, positions: torch.Tensor,
        block_tables: torch.Tensor, rows: torch.Tensor, kv_cache: torch.Tensor, attn_blocks: int) -> torch.Tensor:
    """DeepseekV3Attention over the normed a [n, H]: writes each row's latent row at `rows`,
    attends over rows 0..rows, returns o_proj's output [n, hidden]."""
    n, heads, r = a.shape[0], c.num_attention_heads, c.kv_lora_rank
    dn, p = c.qk_nope_head_dim, c.qk_rope_head_dim
    if c.q_lora_rank is None:
        q = F.linear(a, w[_A + "q_proj.weight"])
    else:
        q_a = tm.rmsnorm(F.linear(a, w[_A + "q_a_proj.weight"]), w[_A + "q_a_layernorm.weight"], LATENT_EPS)
        q = F.linear(q_a, w[_A + "q_b_proj.weight"])
    q = q.view(n, heads, dn + p)
    q_nope, q_pe = q[..., :dn], q[..., dn:]
    kv = F.linear(a, w[_A + "kv_a_proj_with_mqa.weight"])
    latent, k_pe = kv[:, :r], kv[:, r:]
    latent = tm.rmsnorm(latent, w[_A + "kv_a_layernorm.weight"], LATENT_EPS)
    angle = positions.float().unsqueeze(-1) * freqs                                # [n, P/2]
    factor = attention_factor(c.rope)
    cos, sin = angle.cos() * factor, angle.sin() * factor
    q_pe = rope_pe(q_pe, cos.unsqueeze(1), sin.unsqueeze(1), c.rope_interleave)   # [n, H, P]
    k_pe = rope_pe(k_pe, cos, sin, c.rope_interleave)                              # [n, P]
    latent_write(kv_cache, torch.cat([latent, k_pe], dim=-1), block_tables, rows)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w[W_UK]).transpose(0, 1)             # [n, H, R]
    o = latent_attention(torch.cat([q_lat, q_pe], dim=-1), kv_cache, block_tables, rows + 1,
                         softmax_scale(c), r, attn_blocks)                         # [n, H, R]
    o = torch.bmm(o.transpose(0, 1), w[W_UV]).transpose(0, 1).reshape(n, heads * c.v_head_dim)
    return F.linear(o, w[_A + "o_proj.weight"])


def mla_step(w: Mapping[str, torch.Tensor], shape: tm.StepShape, freqs: torch.Tensor, tokens: torch.Tensor,
             hidden: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
             kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft step (torch_mtp.mtp_step's contract; `freqs` rope_inv_freq's table, one latent
    pool): returns (token i32 [n], logprob f32 [n], hidden [n, H]); kv_cache is written in place."""
    c = shape.config
    assert isinstance(c, MlaConfig)
    eps = c.rms_norm_eps
    emb = torch.index_select(w["embed_tokens.weight"], 0, tokens.clamp(min=0))
    x = torch.cat([tm.rmsnorm(emb, w["enorm.weight"], eps), tm.rmsnorm(hidden, w["hnorm.weight"], eps)], -1)
    x = F.linear(x, w["eh_proj.weight"])
    a = tm.rmsnorm(x, w["input_layernorm.weight"], eps)
    x = x + mla(w, c, freqs, a, positions, block_tables, rows, kv_cache, shape.attn_blocks)
    m = tm.rmsnorm(x, w["post_attention_layernorm.weight"], eps)
    ids, weights = route(w, c, m)
    x = x + tm.moe_experts(w, c, m, ids, weights)
    logits = F.linear(tm.rmsnorm(x, w["shared_head.norm.weight"], eps), w["shared_head.head.weight"]).float()
    best = logits.argmax(dim=-1)
    logprob = logits.gather(1, best.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return best.to(torch.int32), logprob, x


def mla_step_advance(w: Mapping[str, torch.Tensor], shape: tm.StepShape, freqs: torch.Tensor, tokens: torch.Tensor,
                     hidden: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, rows: torch.Tensor,
                     kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """mla_step handing the next step its position and row: (token, logprob, hidden,
    positions + 1, rows + 1), as torch_mtp.mtp_step_advance."""
    token, logprob, x = mla_step(w, shape, freqs, tokens, hidden, positions, block_tables, rows, kv_cache)
    return token, logprob, x, positions + 1, rows + 1


def mla_chain(w: Mapping[str, torch.Tensor], shape: tm.StepShape, freqs: torch.Tensor, num_drafts: int,
              tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
              live_rows: torch.Tensor, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k greedy steps, torch_mtp.mtp_chain's contract: step j writes row live + j at position +
    j. Returns (drafts i32 [n, k], confidences f32 [n, k], hidden_out [n, H])."""
    toks, lps = [], []
    for j in range(num_drafts):
        tokens, lp, hidden = mla_step(w, shape, freqs, tokens, hidden, positions + j, block_tables,
                                      live_rows + j, kv_cache)
        toks.append(tokens)
        lps.append(lp)
    return torch.stack(toks, 1), torch.stack(lps, 1), hidden
