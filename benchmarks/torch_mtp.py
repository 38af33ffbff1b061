"""A plain-PyTorch MTP draft step: the peer the benchmark races the circuit against.

One step over n rows with paged drafter KV, op by op, in the HF-Llama semantics the project's
references use (rmsnorm back to the input dtype before the weight, RoPE in fp32 cast once, softmax
in fp32, silu_mul in fp32, argmax and log-softmax of fp32 logits). It is CUDA-graph capturable:
no host syncs, no `.item()`, no data-dependent shapes, no boolean-mask indexing.

Weights are the params `MtpHead.bind` returns (canonical names, `mlp.gate_up_proj.weight` as one
[2I, H] matrix), so one dict serves the circuit and every torch strategy. A MoeConfig's step runs
`moe_mlp` (the params of `MoeMtpHead.bind`: stacked [E, 2I, H] / [E, H, I] experts) instead.
Params of `bind_draft_vocab` (a reduced draft vocabulary) map each argmax through `draft_vocab.ids`.

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

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.draft_vocab import DRAFT_VOCAB_IDS
from draft_circuit.circuit.layers.moe import (BIAS, EXPERTS_DOWN, EXPERTS_GATE_UP, GATE, SHARED_DOWN, SHARED_GATE_UP,
                            MoeConfig)
from draft_circuit.ops.moe import MoeRouteAttrs, route_select

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


_ROUTE_ATTRS: dict[MoeConfig, MoeRouteAttrs] = {}


def route_attrs(c: MoeConfig) -> MoeRouteAttrs:
    """The config's moe_route attrs, made once (a plain dict: torch.compile traces a lookup)."""
    if c not in _ROUTE_ATTRS:
        _ROUTE_ATTRS[c] = MoeRouteAttrs(
            top_k=c.num_experts_per_tok, scoring_func=c.scoring_func, n_group=c.n_group,
            topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor)
    return _ROUTE_ATTRS[c]


def moe_gathers(c: MoeConfig, n: int) -> bool:
    """Whether n rows evaluate experts by gathering each slot's expert weights (about 3 x n x k
    experts' bytes a step: the gather reads and writes them, the bmm reads them again) rather
    than running all E experts densely over every row (E experts' bytes once)."""
    return 3 * n * c.num_experts_per_tok < c.n_routed_experts


def moe_mlp(w: Mapping[str, torch.Tensor], c: MoeConfig, x: torch.Tensor,
            gather: bool | None = None) -> torch.Tensor:
    """The MoE MLP of a normed x [n, H], capturable (no host syncs, no data-dependent shapes).

    Routing is the project's own `route_select` (sigmoid or softmax, + e_score_correction_bias,
    group-limited top-k, ties to the lowest id) on fp32 logits. The experts, as a plain-torch
    engine without a grouped-GEMM kernel can run them at a static shape (`moe_gathers` picks by n):
      gather: per slot j, index_select the n selected [2I, H] gate_up and [H, I] down matrices and
              bmm: ~3 x n x k experts' bytes a step (duplicates read again), temporaries n experts;
      dense:  every expert over every row (two batched matmuls over [E, n, .]) and a [n, E]
              combine matrix of the top-k weights: E experts' bytes a step, n x E SwiGLUs of flops.
    Matmuls in the model dtype, SwiGLU in fp32 rounded back before down, the weighted sum in fp32
    (shared experts added), rounded once to x's dtype. `gather` None: moe_gathers decides."""
    logits = F.linear(x.float(), w[GATE].float())
    ids, weights = route_select(logits, w.get(BIAS), route_attrs(c))
    return moe_experts(w, c, x, ids, weights, gather)


def moe_experts(w: Mapping[str, torch.Tensor], c: MoeConfig, x: torch.Tensor, ids: torch.Tensor,
                weights: torch.Tensor, gather: bool | None = None) -> torch.Tensor:
    """moe_mlp after routing: x [n, H] through the experts `ids` [n, k] weighted by `weights`
    f32 [n, k], plus the shared experts, rounded once to x's dtype (the paths of moe_mlp)."""
    n, dt = x.shape[0], x.dtype
    gu, down = w[EXPERTS_GATE_UP], w[EXPERTS_DOWN]
    if moe_gathers(c, n) if gather is None else gather:
        acc = torch.zeros(n, x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(c.num_experts_per_tok):
            e = ids[:, j].long()
            h = torch.bmm(gu.index_select(0, e), x.unsqueeze(-1)).squeeze(-1)       # [n, 2I]
            g, u = h.float().chunk(2, -1)
            y = torch.bmm(down.index_select(0, e), (F.silu(g) * u).to(dt).unsqueeze(-1))
            acc = acc + weights[:, j:j + 1] * y.squeeze(-1).float()
    else:
        h = torch.matmul(x.unsqueeze(0), gu.transpose(1, 2))                         # [E, n, 2I]
        g, u = h.float().chunk(2, -1)
        y = torch.matmul((F.silu(g) * u).to(dt), down.transpose(1, 2))               # [E, n, H]
        combine = torch.zeros(n, c.n_routed_experts, dtype=torch.float32, device=x.device)
        combine = combine.scatter_add(1, ids.long(), weights)
        acc = torch.einsum("ne,enh->nh", combine, y.float())
    if SHARED_GATE_UP in w:
        g, u = F.linear(x, w[SHARED_GATE_UP]).float().chunk(2, -1)
        acc = acc + F.linear((F.silu(g) * u).to(dt), w[SHARED_DOWN]).float()
    return acc.to(dt)


def dense_mlp(w: Mapping[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w[GATE_UP]).float().chunk(2, -1)
    return F.linear((F.silu(gate) * up).to(x.dtype), w["mlp.down_proj.weight"])


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
    m = rmsnorm(x, w["post_attention_layernorm.weight"], eps)
    x = x + (moe_mlp(w, c, m) if isinstance(c, MoeConfig) else dense_mlp(w, m))
    logits = F.linear(rmsnorm(x, w["shared_head.norm.weight"], eps), w["shared_head.head.weight"]).float()
    best = logits.argmax(dim=-1)
    logprob = logits.gather(1, best.unsqueeze(1)).squeeze(1) - torch.logsumexp(logits, dim=-1)
    ids = w.get(DRAFT_VOCAB_IDS)  # a reduced draft vocabulary: the lm-head row's target id
    token = best if ids is None else ids[best]
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
