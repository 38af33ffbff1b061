"""The dense MTP head (DeepSeek-V3 layout, Llama decoder block) and the k-step draft chain.

`emit_draft_chain(head, k, ...)` unrolls k draft steps into one circuit over n rows: step 0 reads
the target's hidden state, step j > 0 the drafter's own hidden from step j - 1, and step j writes
drafter-KV row live_rows + j at position positions + j.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.ir import ROW, SCRATCH_BLOCK, Circuit
from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES, MtpConfig
from draft_circuit.circuit.layers.draft_vocab import DRAFT_VOCAB_IDS, chain_param_specs, chain_vocab_size
from draft_circuit.ops.sampling import mask_words

GATE_UP = "mlp.gate_up_proj.weight"  # the one derived param: gate rows, then up rows


@dataclass(frozen=True)
class KvLayout:
    """The paged drafter-KV pool a chain writes: shapes only, the pool itself is a state."""

    num_blocks: int
    block_size: int
    max_blocks_per_seq: int

    @property
    def max_rows(self) -> int:
        return self.block_size * self.max_blocks_per_seq


@dataclass(frozen=True)
class StepIO:
    """What one emitted draft step hands to the next."""

    hidden: str
    token: str
    logprob: str
    k_cache: str
    v_cache: str


class MtpHead:
    """One MTP layer: emits a draft step through a builder, binds checkpoint weights to params."""

    def __init__(self, config: MtpConfig, dtype: str = "float32") -> None:
        self.config, self.dtype = config, dtype

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = dict(MTP_PARAM_SHAPES(self.config))
        gate = shapes.pop("mlp.gate_proj.weight")
        shapes.pop("mlp.up_proj.weight")
        shapes[GATE_UP] = (2 * gate[0], gate[1])
        return shapes

    def declare_params(self, b: CircuitBuilder) -> None:
        for name, (dtype, shape) in self.param_specs().items():
            b.param(name, dtype, shape)

    def bind(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (canonical names) -> the circuit's params, in the head's dtype."""
        dt = getattr(torch, self.dtype)
        params = {k: w.to(dt).contiguous() for k, w in weights.items()
                  if k not in ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
        params[GATE_UP] = torch.cat([weights["mlp.gate_proj.weight"],
                                     weights["mlp.up_proj.weight"]]).to(dt).contiguous()
        return {k: params[k] for k in self.param_shapes()} | yarn_params(self.config, params[GATE_UP].device)

    def emit_mlp(self, b: CircuitBuilder, x: str) -> str:
        """The block's MLP on the normed residual: dense SwiGLU here; MoE heads override it."""
        g = b.op1("silu_mul", [b.op1("linear", [x, GATE_UP], name="gate_up_proj")])
        return b.op1("linear", [g, "mlp.down_proj.weight"], name="down_proj")

    def batch_refusal(self, n: int) -> str | None:
        """Why an n-row batch must draft per sequence (None: it need not). Dense: never."""
        return None

    def plan_notes(self) -> dict[str, object]:
        """What this head states in the plan report (an MoE head: its refusals). Dense: nothing."""
        return {}

    def row_parallel_sum(self, b: CircuitBuilder, x: str) -> str:
        """The output of a row-parallel projection (o_proj, the MLP's down projection): x itself
        on one device; a tensor-parallel shard all-reduces its partial sum (circuit/layers/tp.py)."""
        return x

    def emit_argmax(self, b: CircuitBuilder, logits: str, bitmask: str | None) -> tuple[str, str]:
        """The draft and its log-probability from the lm-head's logits (a tensor-parallel shard:
        its vocabulary rows, reduced across ranks)."""
        tok, lp = b.op("argmax_logprob", [logits, bitmask])
        return tok, lp

    def emit_step(self, b: CircuitBuilder, step: int, token: str, hidden: str, positions: str,
                  tables: str, live: str, k_cache: str, v_cache: str, active: str,
                  bitmask: str | None = None) -> StepIO:
        c = self.config
        eps = {"eps": c.rms_norm_eps}
        rope = {"head_dim": c.head_dim, "theta": c.rope_theta, "pos_offset": step, **rotary_attrs(c)}
        emb = b.op1("embedding", ["embed_tokens.weight", token])
        x = b.op1("concat", [b.op1("rmsnorm", [emb, "enorm.weight"], eps, name="enorm"),
                             b.op1("rmsnorm", [hidden, "hnorm.weight"], eps, name="hnorm")])
        x = b.op1("linear", [x, "eh_proj.weight"], name="eh_proj")
        a = b.op1("rmsnorm", [x, "input_layernorm.weight"], eps, name="input_layernorm")
        q = emit_qk_norm(b, c, "q", b.op1("linear", [a, *qkv_params(c, "q")], name="q_proj"))
        k = emit_qk_norm(b, c, "k", b.op1("linear", [a, *qkv_params(c, "k")], name="k_proj"))
        v = b.op1("linear", [a, *qkv_params(c, "v")], name="v_proj")
        q = b.op1(*rope_op(b, c, q, positions, rope), name="rope_q")  # YaRN: rope_freqs
        k = b.op1(*rope_op(b, c, k, positions, rope), name="rope_k")
        # rows that stopped (or are inert padding) write no drafter-KV row
        k_cache, v_cache = b.op("kv_write", [k_cache, v_cache, k, v, tables, live, active],
                                {"row_offset": step})
        o = b.op1("decode_attention", [q, k_cache, v_cache, tables, live], {"row_offset": step},
                  name="attention")
        o = self.row_parallel_sum(b, b.op1("linear", [o, "self_attn.o_proj.weight"], name="o_proj"))
        x = b.op1("add", [x, o], name="attn_residual")
        m = b.op1("rmsnorm", [x, "post_attention_layernorm.weight"], eps,
                  name="post_attention_layernorm")
        x = b.op1("add", [x, self.row_parallel_sum(b, self.emit_mlp(b, m))], name="mlp_residual")
        y = b.op1("rmsnorm", [x, "shared_head.norm.weight"], eps, name="shared_head_norm")
        # fp32 logits: bf16 logits would tie neighbouring tokens (their ulp near 8 is 0.06)
        logits = b.op1("linear", [y, "shared_head.head.weight"], {"out_dtype": "float32"},
                       name="lm_head")
        tok, lp = self.emit_argmax(b, logits, bitmask)
        return StepIO(hidden=x, token=tok, logprob=lp, k_cache=k_cache, v_cache=v_cache)

    # ---- what a chain reads beyond emit_step (draft_vocab.py, emit_draft_chain) ----
    lm_head = "shared_head.head.weight"  # the param a reduced draft vocabulary gathers rows of
    draft_vocab_size: int | None = None  # its logits run over the whole target vocabulary

    @property
    def hidden_in_size(self) -> int:
        """The width of the chain's `hidden` input (the target's last hidden)."""
        return self.config.hidden_size

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {k: (self.dtype, s) for k, s in self.param_shapes().items()} | yarn_param_specs(self.config)

    def cache_shapes(self, kv: KvLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The shapes of the two drafter-KV pools emit_step threads as k_cache and v_cache: GQA's
        K and V here; an MLA head's roped keys and latents (circuit/layers/mla.py)."""
        shape = (kv.num_blocks, kv.block_size, self.config.num_key_value_heads, self.config.head_dim)
        return shape, shape


def emit_draft_chain(head: MtpHead, num_drafts: int, *, max_width: int, kv: KvLayout,
                     bitmask: bool = False, embed_target: bool = False,
                     confidence_stop: bool = False, draft_vocab: int | None = None,
                     name: str = "mtp_draft_chain") -> Circuit:
    """The k-step draft chain over n rows.

    Inputs: tokens i32[n] (each row's last token), hidden [n, H] (the target's last hidden,
    after its final norm), positions i32[n] (the position of `tokens`), block_tables i32[n, M],
    live_rows i32[n] (drafter-KV rows each sequence holds before this chain), active i32[n]
    (1: draft this row; 0: an inert row that writes no KV and drafts -1), optionally
    bitmask i32[n, ceil(V/32)] (the same mask at every draft position) and log_tau f32[n]
    (confidence stop: a row stops after the first draft whose log-probability is below it;
    NaN never stops). States: k_cache and v_cache (`head.cache_shapes(kv)`: GQA's
    [num_blocks, block_size, kv_heads, head_dim]),
    optionally embed_target [n, H] (the embedding of each row's last kept draft).
    Outputs: drafts i32[n, k] (-1 after a row stopped), confidences f32[n, k] (top-1
    log-probabilities), hidden_out [n, H] (the drafter's hidden after the last step).
    `draft_vocab` S (or the head's own draft vocabulary, EAGLE-3's): the lm-head runs over S
    rows with the id table `draft_vocab.ids` (params from `bind_draft_vocab`), drafts are mapped
    to target ids and the bitmask to the subset on the device, and each confidence is
    renormalised over the subset (circuit/layers/draft_vocab.py).
    """
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    c, dt = head.config, head.dtype
    subset = chain_vocab_size(head, draft_vocab)
    b = CircuitBuilder(name, max_width=max_width)
    # neutral: what an inert (padded) row holds. It drafts nothing and writes no KV (active 0);
    # every block it could follow is the runner's scratch block, so even a kernel that ignored
    # `active` could only touch scratch; its mask allows every token and it never stops early.
    tokens = b.input("tokens", "int32", (ROW,), neutral=0)
    hidden = b.input("hidden", dt, (ROW, head.hidden_in_size), neutral=0)
    positions = b.input("positions", "int32", (ROW,), neutral=0)
    tables = b.input("block_tables", "int32", (ROW, kv.max_blocks_per_seq), neutral=SCRATCH_BLOCK)
    live = b.input("live_rows", "int32", (ROW,), neutral=0)
    active = b.input("active", "int32", (ROW,), neutral=0)
    mask = b.input("bitmask", "int32", (ROW, mask_words(c.vocab_size)), neutral=-1) \
        if bitmask else None
    log_tau = b.input("log_tau", "float32", (ROW,), neutral=float("-inf")) \
        if confidence_stop else None
    k_shape, v_shape = head.cache_shapes(kv)
    k_cache, v_cache = b.state("k_cache", dt, k_shape), b.state("v_cache", dt, v_shape)
    target = b.state("embed_target", dt, (ROW, c.hidden_size)) if embed_target else None
    for pname, (pdtype, pshape) in chain_param_specs(head, subset).items():
        b.param(pname, pdtype, pshape)
    if subset is not None and mask is not None:  # the host's mask is over target ids
        mask = b.op1("remap_bitmask", [mask, DRAFT_VOCAB_IDS], name="draft_vocab_mask")

    token, kept, logprobs, last, drafting = tokens, [], [], None, active
    for j in range(num_drafts):
        with b.scope(f"s{j}"):
            io = head.emit_step(b, j, token, hidden, positions, tables, live, k_cache, v_cache,
                                active, mask)
            if subset is not None:  # a subset row -> its target id (-1 stays -1)
                io = replace(io, token=b.op1("map_ids", [io.token, DRAFT_VOCAB_IDS], name="draft_id"))
            kept.append(b.op1("keep_if_active", [io.token, active], name="draft"))
            last = b.op1("keep_if_active", [io.token, active, last], name="last_kept") \
                if last is not None else kept[-1]
            if log_tau is not None and j + 1 < num_drafts:
                active = b.op1("confidence_gate", [active, io.logprob, log_tau])
        hidden, token, k_cache, v_cache = io.hidden, io.token, io.k_cache, io.v_cache
        logprobs.append(io.logprob)
    b.output(b.op1("stack", kept, name="drafts"), "drafts")
    b.output(b.op1("stack", logprobs, name="confidences"), "confidences")
    b.output(hidden, "hidden_out")
    b.output(k_cache)
    b.output(v_cache)
    if target is not None:
        # only the last kept draft's embedding goes to the host buffer (the deferred draft)
        b.output(b.op1("embed_write", [target, "embed_tokens.weight", last, drafting]))
    return b.build()


# ---- the attention's family options (MtpConfig.qkv_bias, qk_norm, partial_rotary_factor), also
# emitted by the engine's target; defined last so the lines above keep their numbers (node origins)
def rotary_attrs(c: MtpConfig) -> dict[str, int]:
    """rope's `rotary_dim` when only part of each head rotates (GLM-4.5); nothing when the whole
    head does, so a Llama circuit's attrs are what they always were."""
    return {"rotary_dim": c.rotary_dim} if c.rotary_dim != c.head_dim else {}


def qkv_params(c: MtpConfig, which: str, prefix: str = "") -> list[str]:
    """The params of the q, k or v projection: its weight, and its bias where the family has one
    (Qwen2, GLM-4.5's attention_bias): `linear`'s optional third input."""
    weight = f"{prefix}self_attn.{which}_proj.weight"
    return [weight, f"{prefix}self_attn.{which}_proj.bias"] if c.qkv_bias else [weight]


def emit_qk_norm(b: CircuitBuilder, c: MtpConfig, which: str, x: str, prefix: str = "") -> str:
    """q or k normed per head before RoPE where the family does it (Qwen3, GLM-4.5's use_qk_norm);
    else x itself."""
    if not c.qk_norm:
        return x
    return b.op1("head_rmsnorm", [x, f"{prefix}self_attn.{which}_norm.weight"], {"eps": c.rms_norm_eps},
                 name=f"{which}_norm")


# ---- YaRN for the GQA layers (MtpConfig.rope_scaling), also emitted by the engine's target; last,
# so the lines above keep their numbers (node origins); default RoPE emits what it always did
from typing import Any  # noqa: E402

from draft_circuit.circuit.layers.config import ConfigError  # noqa: E402
from draft_circuit.circuit.layers.rope import INV_FREQ  # noqa: E402


def yarn_param_specs(c: MtpConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The YaRN frequency table param (f32 [head_dim / 2], shared by every step and layer) when
    the config scales RoPE; nothing for default RoPE."""
    return {} if c.rope_scaling is None else {INV_FREQ: ("float32", (c.head_dim // 2,))}


def yarn_params(c: MtpConfig, device: torch.device) -> dict[str, torch.Tensor]:
    """Its bound value, transformers' YaRN inv_freq, on the device of the other params."""
    return {} if c.rope_scaling is None else {INV_FREQ: c.rope_scaling.inv_freq(c.head_dim).to(device)}


def rope_op(b: CircuitBuilder, c: MtpConfig, x: str, positions: str,
            rope: dict[str, Any]) -> tuple[str, list[str], dict[str, Any]]:
    """(op, inputs, attrs) of a GQA layer's RoPE on q or k: `rope` with `rope` attrs for default
    RoPE; with YaRN `rope_freqs` over the INV_FREQ param, cos and sin scaled by YaRN's attention
    factor (transformers' LlamaRotaryEmbedding with rope_type yarn: same frequencies, same
    arithmetic). A layer that declares no INV_FREQ param cannot run YaRN: refused by name."""
    if c.rope_scaling is None:
        return "rope", [x, positions], rope
    try:
        b.spec(INV_FREQ)
    except KeyError:
        raise ConfigError(f"rope_scaling yarn: this layer ({b.name}) declares no {INV_FREQ!r} param; "
                          "YaRN runs in the dense and MoE MTP heads and the engine's Llama target only") from None
    return "rope_freqs", [x, positions, INV_FREQ], {"head_dim": c.head_dim, "pos_offset": rope.get("pos_offset", 0),
                                                    "attention_factor": c.rope_scaling.attention_factor}
