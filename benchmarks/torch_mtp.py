"""A plain-PyTorch MTP draft step: the peer the benchmark races the circuit against.

One step over n rows with paged drafter KV, op by op, in the HF-Llama semantics the project's
references use (rmsnorm back to the input dtype before the weight, RoPE in fp32 cast once, softmax
in fp32, silu_mul in fp32, argmax and log-softmax of fp32 logits). It is CUDA-graph capturable:
no host syncs, no `.item()`, no data-dependent shapes, no boolean-mask indexing.

Weights are the params `MtpHead.bind` returns (canonical names, `mlp.gate_up_proj.weight` as one
[2I, H] matrix), so one dict serves the circuit and every torch strategy.

Attention gathers a fixed number of blocks per sequence through the block table (`attn_blocks`,
static for a whole run: enough for the longest live + k rows), masks rows past each sequence's
length with -inf and reads nothing else; the block-table entries it gathers must be valid block
ids (>= 0). This is the shape a plain-torch engine without a paged-attention kernel would use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from ops.layers.config import MtpConfig

GATE_UP = "mlp.gate_up_proj.weight"


@dataclass(frozen=True)
class StepShape:
    """What a step needs beyond tensors: the config and the static attention bound."""

    config: MtpConfig
    block_size: int
    attn_blocks: int  # blocks gathered per sequence (attn_blocks * block_size >= live + k)

    @property
    def attn_rows(self) -> int:
        return self.attn_blocks * self.block_size


def attn_blocks_for(max_live: int, num_drafts: int, block_size: int, max_blocks: int) -> int:
    """The fewest blocks that hold a sequence's live rows plus the chain's k new rows."""
    need = math.ceil((max_live + num_drafts) / block_size)
    if need > max_blocks:
        raise ValueError(f"{max_live} live rows + {num_drafts} drafts need {need} blocks; "
                         f"the table has {max_blocks}")
    return need


def inv_freq(head_dim: int, theta: float, device) -> torch.Tensor:
    # the same expression as ops.attention.rope_ref, so CPU fp32 is bitwise the same
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * w


def rope(x: torch.Tensor, positions: torch.Tensor, freqs: torch.Tensor, head_dim: int) -> torch.Tensor:
    """HF rotate-half RoPE over x [n, heads * head_dim] at `positions` (already offset)."""
    n = x.shape[0]
    angle = positions.float().unsqueeze(-1) * freqs          # [n, D/2]
    cos, sin = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)
    xf = x.float().view(n, -1, head_dim)
    x1, x2 = xf[..., : head_dim // 2], xf[..., head_dim // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(n, -1).to(x.dtype)


def kv_write(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             block_tables: torch.Tensor, rows: torch.Tensor) -> None:
    """Write each sequence's k, v at drafter-KV row `rows[i]` through its block table."""
    block_size, heads, dim = k_cache.shape[1:]
    rows = rows.long()
    blocks = block_tables.long().gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    offs = rows % block_size
    k_cache.index_put_((blocks, offs), k.view(-1, heads, dim))
    v_cache.index_put_((blocks, offs), v.view(-1, heads, dim))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, lengths: torch.Tensor, num_heads: int,
                    attn_blocks: int) -> torch.Tensor:
    """q [n, heads * D] over each sequence's first `lengths[i]` KV rows (GQA, HF eager style:
    matmuls in the model dtype, softmax in fp32)."""
    n = q.shape[0]
    block_size, kv_heads, dim = k_cache.shape[1:]
    rows = attn_blocks * block_size
    table = block_tables[:, :attn_blocks].long()
    keys = k_cache[table].view(n, rows, kv_heads, dim).transpose(1, 2)   # [n, Hkv, L, D]
    vals = v_cache[table].view(n, rows, kv_heads, dim).transpose(1, 2)
    qg = q.view(n, kv_heads, num_heads // kv_heads, dim)                # [n, Hkv, G, D]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * (1.0 / math.sqrt(dim))  # [n, Hkv, G, L]
    valid = torch.arange(rows, device=q.device).unsqueeze(0) < lengths.unsqueeze(1)  # [n, L]
    scores = scores.masked_fill(~valid.view(n, 1, 1, rows), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, vals).reshape(n, num_heads * dim)


def mtp_step(w: Mapping[str, torch.Tensor], shape: StepShape, freqs: torch.Tensor,
             tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
             block_tables: torch.Tensor, rows: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft step. `positions` is this step's RoPE position, `rows` the drafter-KV row it
    writes (live + j); attention reads rows 0..rows. Returns (token i32 [n], logprob f32 [n],
    hidden [n, H]); k_cache / v_cache are written in place."""
    c = shape.config
    eps, d = c.rms_norm_eps, c.head_dim
    emb = torch.index_select(w["embed_tokens.weight"], 0, tokens.clamp(min=0))
    x = torch.cat([rmsnorm(emb, w["enorm.weight"], eps), rmsnorm(hidden, w["hnorm.weight"], eps)], -1)
    x = F.linear(x, w["eh_proj.weight"])
    a = rmsnorm(x, w["input_layernorm.weight"], eps)
    q = rope(F.linear(a, w["self_attn.q_proj.weight"]), positions, freqs, d)
    k = rope(F.linear(a, w["self_attn.k_proj.weight"]), positions, freqs, d)
    v = F.linear(a, w["self_attn.v_proj.weight"])
    kv_write(k_cache, v_cache, k, v, block_tables, rows)
    o = paged_attention(q, k_cache, v_cache, block_tables, rows + 1, c.num_attention_heads,
                        shape.attn_blocks)
    x = x + F.linear(o, w["self_attn.o_proj.weight"])
    gate, up = F.linear(rmsnorm(x, w["post_attention_layernorm.weight"], eps), w[GATE_UP]).float().chunk(2, -1)
    x = x + F.linear((F.silu(gate) * up).to(x.dtype), w["mlp.down_proj.weight"])
    logits = F.linear(rmsnorm(x, w["shared_head.norm.weight"], eps), w["shared_head.head.weight"]).float()
    token = logits.argmax(dim=-1)
    logprob = logits.gather(1, token.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)
    return token.to(torch.int32), logprob, x


def mtp_step_advance(w, shape, freqs, tokens, hidden, positions, block_tables, rows, k_cache,
                     v_cache):
    """One step that also hands the next step its position and row (what a per-step graph or a
    compiled step is called k times with). Returns (token, logprob, hidden, positions + 1,
    rows + 1)."""
    token, logprob, x = mtp_step(w, shape, freqs, tokens, hidden, positions, block_tables, rows,
                                 k_cache, v_cache)
    return token, logprob, x, positions + 1, rows + 1


def mtp_chain(w: Mapping[str, torch.Tensor], shape: StepShape, freqs: torch.Tensor,
              num_drafts: int, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
              block_tables: torch.Tensor, live_rows: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k greedy steps: step j reads the previous step's token and hidden, writes row live + j at
    position + j. Returns (drafts i32 [n, k], confidences f32 [n, k], hidden_out [n, H])."""
    toks, lps = [], []
    pos, rows = positions, live_rows
    for j in range(num_drafts):
        if j:
            pos, rows = positions + j, live_rows + j
        tokens, lp, hidden = mtp_step(w, shape, freqs, tokens, hidden, pos, block_tables, rows,
                                      k_cache, v_cache)
        toks.append(tokens)
        lps.append(lp)
    return torch.stack(toks, 1), torch.stack(lps, 1), hidden
