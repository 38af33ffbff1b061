"""MLA attention as a layer (DeepSeek-V2/V3, Kimi-K2): `MlaConfig` (config.json fields by their
real names on top of `MoeConfig`), the attention's checkpoint tensors, its circuit params and how
checkpoint weights become them (`bind_mla_attention`), and `emit_mla_attention`.

At bind time q_b_proj (or q_proj) and kv_a_proj_with_mqa are split into their position-free and
rope rows (rope rows de-interleaved when `rope_interleave`, so one rotate-half rope op serves),
and kv_b_proj into W_UK^T [H, R, Dn] (absorbed into the query) and W_UV [H, Dv, R] (applied to the
latent output). Decode then attends over the latent rows directly (ops/mla.py). The projections
may stay fp8 (DeepSeek-V3's block-scaled checkpoints; circuit/layers/fp8.py); the absorbed
W_UK^T and W_UV are always dequantised, as vLLM's MLA does.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.layers.config import _ROPE_THETA_ALIASES, ConfigError, _agreed, _is_int
from draft_circuit.circuit.layers.fp8 import ROW_SCALE, emit_linear, fp8_rows, row_scale_shape, take_rows
from draft_circuit.circuit.layers.moe import MoeConfig, _real
from draft_circuit.circuit.layers.rope import INV_FREQ, RopeScaling, deinterleaved
from draft_circuit.ops.moe import FP8

__all__ = ["MlaConfig", "is_mla_hf_config", "INV_FREQ", "LATENT_EPS", "mla_checkpoint_shapes", "mla_param_shapes",
           "mla_param_specs", "bind_mla_attention", "emit_mla_attention", "mla_cache_shapes", "MLA_PROJECTIONS"]

# INV_FREQ (rope.py): f32 [qk_rope_head_dim / 2], shared by every layer and step
LATENT_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepseekV3RMSNorm(rank) keeps its default eps
_RANKS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# the linear weights among the params: fp8 when the layer keeps its projections fp8
MLA_PROJECTIONS = tuple(f"self_attn.{p}.weight" for p in
                        ("q_a_proj", "q_nope", "q_rope", "kv_a_latent", "kv_a_rope", "o_proj"))


@dataclass(frozen=True, kw_only=True)
class MlaConfig(MoeConfig):
    """A DeepSeek-V3-architecture model: MLA attention in every layer, a MoE MLP from layer
    `first_k_dense_replace` on (and in the MTP layer), dense SwiGLU before it."""

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    first_k_dense_replace: int = 3  # transformers' DeepseekV3Config default
    rope_interleave: bool = True    # likewise: DeepSeek's checkpoints rotate interleaved pairs
    rope: RopeScaling = field(default_factory=RopeScaling)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in _RANKS:
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"config field {name!r} = {v!r}: must be a positive int")
        if self.q_lora_rank is not None and (not _is_int(self.q_lora_rank) or self.q_lora_rank <= 0):
            raise ConfigError(f"config field 'q_lora_rank' = {self.q_lora_rank!r}: must be a positive int or null")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"config field 'qk_rope_head_dim' = {self.qk_rope_head_dim}: must be even "
                              "(RoPE rotates pairs)")
        k = self.first_k_dense_replace
        if not _is_int(k) or not 0 <= k <= self.num_hidden_layers:
            raise ConfigError(f"config field 'first_k_dense_replace' = {k!r}: must be an int in "
                              f"[0, num_hidden_layers = {self.num_hidden_layers}]")
        if not isinstance(self.rope_interleave, bool):
            raise ConfigError(f"config field 'rope_interleave' = {self.rope_interleave!r}: must be a bool")
        if self.num_key_value_heads != self.num_attention_heads:  # every head is expanded from the latent
            raise ConfigError(f"config field 'num_key_value_heads' = {self.num_key_value_heads}: MLA needs it "
                              f"equal to 'num_attention_heads' = {self.num_attention_heads}")
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"config field 'scoring_func' = {self.scoring_func!r}: DeepSeek-V3 routing is sigmoid")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.rope.softmax_scale(self.qk_head_dim)

    def is_moe_layer(self, layer: int) -> bool:
        """Target layer `layer`'s MLP is a MoE (DeepseekV3DecoderLayer's rule)."""
        return layer >= self.first_k_dense_replace

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, source: str = "config") -> MlaConfig:
        """DeepSeek-V3's config.json (hub or transformers 5 names). The rope scaling is read here
        (RopeScaling), so the base config reads the rest as if RoPE were unscaled."""
        try:
            theta = _agreed(d, _ROPE_THETA_ALIASES)
            theta = 10000.0 if theta is None else theta
            plain = {**d, "rope_parameters": None, "rope_scaling": None, "rope_theta": theta}
            base = MoeConfig.from_hf(plain, source=source)
            rope = RopeScaling.from_hf(d, theta=base.rope_theta)
            fields: dict[str, Any] = {}
            for name in (*_RANKS, "q_lora_rank"):
                if name not in d:
                    raise ConfigError(f"config field {name!r} is required for MLA but missing")
                fields[name] = d[name]
            for name, default in (("first_k_dense_replace", 3), ("rope_interleave", True)):
                fields[name] = default if d.get(name) is None else d[name]
            return cls(**dataclasses.asdict(base), **fields, rope=rope)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A DeepSeek-V3 config.json in transformers 5's names, which from_hf reads back equal."""
        names = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "rms_norm_eps", "num_hidden_layers", "tie_word_embeddings", "max_position_embeddings",
                 "num_nextn_predict_layers", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                 "n_shared_experts", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob",
                 *_RANKS, "q_lora_rank", "first_k_dense_replace", "rope_interleave")
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_act": "silu",
                "attention_bias": False, **{k: getattr(self, k) for k in names},
                "rope_parameters": self.rope.to_hf()}


def is_mla_hf_config(d: Mapping[str, Any]) -> bool:
    """A config.json naming a KV latent rank describes MLA layers (DeepSeek-V2/V3, Kimi-K2)."""
    return d.get("kv_lora_rank") is not None


def mla_checkpoint_shapes(c: MlaConfig) -> dict[str, tuple[int, ...]]:
    """The attention's tensors as a checkpoint stores them, relative to the layer prefix."""
    h, heads, r, p = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    a = "self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is not None:
        shapes.update({a + "q_a_proj.weight": (c.q_lora_rank, h), a + "q_a_layernorm.weight": (c.q_lora_rank,),
                       a + "q_b_proj.weight": (heads * c.qk_head_dim, c.q_lora_rank)})
    else:
        shapes[a + "q_proj.weight"] = (heads * c.qk_head_dim, h)
    shapes.update({a + "kv_a_proj_with_mqa.weight": (r + p, h), a + "kv_a_layernorm.weight": (r,),
                   a + "kv_b_proj.weight": (heads * (c.qk_nope_head_dim + c.v_head_dim), r),
                   a + "o_proj.weight": (h, heads * c.v_head_dim)})
    return shapes


def mla_param_shapes(c: MlaConfig) -> dict[str, tuple[int, ...]]:
    """The circuit's attention params, relative to the layer prefix (INV_FREQ is not prefixed)."""
    h, heads, r, p = c.hidden_size, c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim
    dn, dv, a = c.qk_nope_head_dim, c.v_head_dim, "self_attn."
    q_in = h if c.q_lora_rank is None else c.q_lora_rank
    shapes: dict[str, tuple[int, ...]] = {}
    if c.q_lora_rank is not None:
        shapes.update({a + "q_a_proj.weight": (c.q_lora_rank, h), a + "q_a_layernorm.weight": (c.q_lora_rank,)})
    shapes.update({a + "q_nope.weight": (heads * dn, q_in), a + "q_rope.weight": (heads * p, q_in),
                   a + "kv_a_latent.weight": (r, h), a + "kv_a_rope.weight": (p, h),
                   a + "kv_a_layernorm.weight": (r,), a + "w_uk_t": (heads, r, dn), a + "w_uv": (heads, dv, r),
                   a + "o_proj.weight": (h, heads * dv)})
    return shapes


def mla_param_specs(c: MlaConfig, dtype: str, fp8: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each attention param; with fp8 the projections are fp8 beside their
    per-row scales (W_UK^T and W_UV, absorbed, stay in `dtype`)."""
    specs: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in mla_param_shapes(c).items():
        if fp8 and name in MLA_PROJECTIONS:
            specs[name], specs[name + ROW_SCALE] = (FP8, shape), ("float32", row_scale_shape(shape))
        else:
            specs[name] = (dtype, shape)
    return specs


def mla_cache_shapes(c: MlaConfig, num_blocks: int, block_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(pe_cache, latent_cache) pool shapes: one head per row, the GQA pools' layout."""
    return (num_blocks, block_size, 1, c.qk_rope_head_dim), (num_blocks, block_size, 1, c.kv_lora_rank)


def _row_sources(c: MlaConfig) -> dict[str, tuple[str, torch.Tensor]]:
    """Each projection param as rows of a stored weight: (its name, the row indices)."""
    heads, r, p, dn, qk = c.num_attention_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.qk_head_dim
    order = deinterleaved(p) if c.rope_interleave else torch.arange(p)
    per_head = torch.arange(heads)[:, None] * qk
    q = "self_attn.q_b_proj.weight" if c.q_lora_rank is not None else "self_attn.q_proj.weight"
    rows = {"self_attn.q_nope.weight": (q, (per_head + torch.arange(dn)).flatten()),
            "self_attn.q_rope.weight": (q, (per_head + dn + order).flatten()),
            "self_attn.kv_a_latent.weight": ("self_attn.kv_a_proj_with_mqa.weight", torch.arange(r)),
            "self_attn.kv_a_rope.weight": ("self_attn.kv_a_proj_with_mqa.weight", r + order)}
    for name in ("self_attn.o_proj.weight", *(("self_attn.q_a_proj.weight",) if c.q_lora_rank is not None else ())):
        rows[name] = (name, torch.arange(mla_checkpoint_shapes(c)[name][0]))
    return rows


def bind_mla_attention(c: MlaConfig, weights: Mapping[str, torch.Tensor], prefix: str = "", *,
                       fp8: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (`prefix` + mla_checkpoint_shapes' names, fp8 ones beside their
    `_scale_inv`) -> the params of mla_param_specs under the same prefix: projections split and
    their rope rows de-interleaved (fp32, or with fp8 as fp8 rows and row scales), norms fp32,
    kv_b_proj absorbed as W_UK^T and W_UV (fp32)."""
    heads, r, dn, dv = c.num_attention_heads, c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
    a = prefix + "self_attn."
    out: dict[str, torch.Tensor] = {}
    stored: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (source, index) in _row_sources(c).items():
        if fp8:
            if source not in stored:
                stored[source] = fp8_rows(weights, prefix + source)
            w, scale = stored[source]
            out[prefix + name], out[prefix + name + ROW_SCALE] = take_rows(w, index), scale[index].contiguous()
        else:
            out[prefix + name] = _real(weights, prefix + source).float()[index].contiguous()
    for norm in ("kv_a_layernorm", *(("q_a_layernorm",) if c.q_lora_rank is not None else ())):
        out[a + norm + ".weight"] = _real(weights, a + norm + ".weight").float()
    kv_b = _real(weights, a + "kv_b_proj.weight").float().view(heads, dn + dv, r)
    out[a + "w_uk_t"], out[a + "w_uv"] = kv_b[:, :dn].transpose(1, 2).contiguous(), kv_b[:, dn:].contiguous()
    return out


def emit_mla_attention(b: CircuitBuilder, c: MlaConfig, prefix: str, x: str, positions: str, tables: str,
                       live: str, pe_cache: str, latent_cache: str, active: str | None, *,
                       step: int = 0) -> tuple[str, str, str]:
    """MLA over the normed input x [n, H]: writes each row's latent row (row live_rows + step at
    position positions + step) and attends over rows 0..live_rows + step. Returns (o_proj's
    output [n, hidden], pe_cache, latent_cache)."""
    a = prefix + "self_attn."
    rope = {"head_dim": c.qk_rope_head_dim, "attention_factor": c.rope.attention_factor, "pos_offset": step}
    q_in = x
    if c.q_lora_rank is not None:
        q_in = b.op1("rmsnorm", [emit_linear(b, x, a + "q_a_proj.weight", "q_a_proj"),
                                 a + "q_a_layernorm.weight"], {"eps": LATENT_EPS}, name="q_a_layernorm")
    q_nope = emit_linear(b, q_in, a + "q_nope.weight", "q_nope_proj")      # [n, H*Dn]
    q_pe = emit_linear(b, q_in, a + "q_rope.weight", "q_rope_proj")        # [n, H*P]
    latent = b.op1("rmsnorm", [emit_linear(b, x, a + "kv_a_latent.weight", "kv_a_latent_proj"),
                               a + "kv_a_layernorm.weight"], {"eps": LATENT_EPS}, name="kv_a_layernorm")
    k_pe = emit_linear(b, x, a + "kv_a_rope.weight", "kv_a_rope_proj")     # [n, P]
    q_pe = b.op1("rope_freqs", [q_pe, positions, INV_FREQ], rope, name="rope_q")
    k_pe = b.op1("rope_freqs", [k_pe, positions, INV_FREQ], rope, name="rope_k")
    pe_cache, latent_cache = b.op("mla_kv_write", [pe_cache, latent_cache, latent, k_pe, tables, live, active],
                                  {"row_offset": step})
    q_lat = b.op1("head_linear", [q_nope, a + "w_uk_t"], name="absorb_uk")         # [n, H*R]
    o = b.op1("mla_decode_attention", [q_lat, q_pe, pe_cache, latent_cache, tables, live],
              {"scale": c.softmax_scale, "row_offset": step}, name="attention")
    o = b.op1("head_linear", [o, a + "w_uv"], name="absorb_uv")                    # [n, H*Dv]
    return emit_linear(b, o, a + "o_proj.weight", "o_proj"), pe_cache, latent_cache
