"""The Qwen3-Next MTP drafter (`Qwen3NextForCausalLM`'s `mtp.*` layer, as vLLM's qwen3_next_mtp.py
and SGLang's qwen3_next_mtp.py run it): `Qwen3NextMtpConfig` and `Qwen3NextMtpHead`, whose k-step
chain is `emit_draft_chain(head, k, ...)` like any head's.

One step (vLLM's Qwen3NextMultiTokenPredictor.forward):
  x = fc(cat[pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(hidden)])
  x = x + o_proj(attention(q_norm(q), k_norm(k), v) * sigmoid(gate))     q, gate = q_proj(input_layernorm(x))
  x = x + moe(post_attention_layernorm(x))                               moe: softmax top-k + gated shared expert
  y = norm(x);  draft = argmax(lm_head(y));  y is the hidden handed to the next step
The decoder layer is Qwen3NextDecoderLayer of layer type full_attention: q_proj emits, per head,
head_dim query columns then head_dim gate columns; q and k are normed per head before a partial
rotary (int(head_dim * partial_rotary_factor) dims, rotate-half); the MoE's shared expert output is
scaled by sigmoid(shared_expert_gate(x)) ([1, H]). Every RMSNorm is zero-centred: (1 + weight) * x.

How it is emitted from the layer library (new ops `sigmoid_mul`, `zero_centred_rmsnorm` and
`zero_centred_head_rmsnorm`, ops/family_ops.py, with their Triton kernels): each zero-centred norm
runs over the stored weight and forms 1 + weight in fp32 inside the norm, rounding once at the end,
as transformers' Qwen3NextRMSNorm. (A gain 1 + weight formed at bind and stored in bf16 keeps w only
to steps of 1/128, and `rmsnorm`'s Llama order rounds the normalised row before the gain: on CPU the
bf16 chain's first-step hidden was 0.0080 (relative) off transformers' bf16 layer that way, 0.0034
now; tests/layers/test_qwen3_next_bf16.py.) q_proj is
split at bind into its query rows and its gate rows (two `linear`s, no split op); routing is
`moe_route` with softmax scoring (normalised at top-1 too when norm_topk_prob, as transformers'
Qwen3NextTopKRouter), routed experts `moe_experts`, the shared expert a dense SwiGLU gated by
`sigmoid_mul`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.layers.config import ConfigError, MtpConfig, _is_int
from draft_circuit.circuit.layers.family_options import qwen3_next_options
from draft_circuit.circuit.layers.mtp import MtpHead, StepIO, rotary_attrs
from draft_circuit.ops import moe as moe_ops  # registers the MoE ops
from draft_circuit.ops.moe import KILL_SWITCH

__all__ = ["Qwen3NextMtpConfig", "Qwen3NextMtpHead", "qwen3_next_mtp_shapes", "MTP_PREFIX", "LAYER",
           "ZERO_CENTRED_NORMS", "ROUTER"]

MTP_PREFIX = "mtp."   # where the drafter's tensors are stored
LAYER = "layers.0."   # its one decoder layer, under MTP_PREFIX
# the zero-centred RMSNorms (Qwen3NextRMSNorm): stored `weight`, run by the zero_centred_* norm ops
ZERO_CENTRED_NORMS = ("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight",
                      f"{LAYER}input_layernorm.weight", f"{LAYER}post_attention_layernorm.weight",
                      f"{LAYER}self_attn.q_norm.weight", f"{LAYER}self_attn.k_norm.weight", "norm.weight")
Q_PROJ = f"{LAYER}self_attn.q_proj.weight"
QUERY, GATE = f"{LAYER}self_attn.q_proj.query.weight", f"{LAYER}self_attn.q_proj.gate.weight"
ROUTER = f"{LAYER}mlp.gate.weight"
EXPERTS_GATE_UP, EXPERTS_DOWN = f"{LAYER}mlp.experts.gate_up_proj.weight", f"{LAYER}mlp.experts.down_proj.weight"
SHARED_GATE_UP, SHARED_DOWN = f"{LAYER}mlp.shared_expert.gate_up_proj.weight", f"{LAYER}mlp.shared_expert.down_proj.weight"
SHARED_GATE = f"{LAYER}mlp.shared_expert_gate.weight"
EMBED, LM_HEAD = "embed_tokens.weight", "lm_head.weight"
_MTP_LAYERS_ALIASES = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
NORM, HEAD_NORM = "zero_centred_rmsnorm", "zero_centred_head_rmsnorm"  # ops/family_ops.py


@dataclass(frozen=True, kw_only=True)
class Qwen3NextMtpConfig(MtpConfig):
    """Qwen3NextConfig's fields the MTP layer reads. The layer is always a MoE layer here (vLLM and
    SGLang build `mtp.layers.0` at layer index 0: MoE iff num_experts > 0, 0 not in mlp_only_layers
    and decoder_sparse_step == 1, which the family table requires); `qk_norm` is always on and
    `partial_rotary_factor` defaults to 0.25 (family_options.qwen3_next_options)."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _validate(self)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, source: str = "config") -> Qwen3NextMtpConfig:
        """HF names. Absent: norm_topk_prob -> true (Qwen3NextConfig's); the MTP layer count is
        `num_nextn_predict_layers` or `mtp_num_hidden_layers` (they must agree), absent: 1."""
        base = MtpConfig.from_hf(d, source=source)
        try:
            found = {a: d[a] for a in _MTP_LAYERS_ALIASES if d.get(a) is not None}
            if len(set(map(repr, found.values()))) > 1:
                raise ConfigError(f"config aliases disagree: {found}; make them equal or drop one")
            layers = next(iter(found.values()), 1)
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                         "shared_expert_intermediate_size"):
                if d.get(name) is None:
                    raise ConfigError(f"config field {name!r} is required for the Qwen3-Next MTP layer but missing")
            # the base's fields as they are (asdict would turn a nested dataclass field into a dict)
            fields = {**{f.name: getattr(base, f.name) for f in dataclasses.fields(base)},
                      "num_nextn_predict_layers": layers, **qwen3_next_options(d)}
            return cls(**fields, num_experts=d["num_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                       moe_intermediate_size=d["moe_intermediate_size"],
                       shared_expert_intermediate_size=d["shared_expert_intermediate_size"],
                       norm_topk_prob=True if d.get("norm_topk_prob") is None else d["norm_topk_prob"])
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def _validate(c: Qwen3NextMtpConfig) -> None:
    for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"):
        v = getattr(c, name)
        if not _is_int(v) or v <= 0:
            raise ConfigError(f"config field {name!r} = {v!r}: must be a positive int (the MTP layer "
                              "is a MoE layer with a shared expert)")
    if c.num_experts_per_tok > c.num_experts:
        raise ConfigError(f"config field 'num_experts_per_tok' = {c.num_experts_per_tok}: more than "
                          f"'num_experts' = {c.num_experts}")
    if not isinstance(c.norm_topk_prob, bool):
        raise ConfigError(f"config field 'norm_topk_prob' = {c.norm_topk_prob!r}: must be a bool")
    if c.num_nextn_predict_layers > 1:  # vLLM cycles mtp.layers.{step % count}; the head runs one
        raise ConfigError(f"config field 'num_nextn_predict_layers' = {c.num_nextn_predict_layers}: "
                          "the Qwen3-Next head runs one MTP layer (mtp.layers.0)")
    if not c.qk_norm:
        raise ConfigError("attention option 'qk_norm' = False: Qwen3NextAttention always norms q and k")


def qwen3_next_mtp_shapes(c: Qwen3NextMtpConfig) -> dict[str, tuple[int, ...]]:
    """The drafter's stored tensors, named relative to `mtp.` (vLLM's and SGLang's names), plus the
    embedding and lm-head it shares with the target (`embed_tokens.weight` <- the target's
    `model.embed_tokens.weight`, `lm_head.weight` <- `lm_head.weight`, or the embedding when tied)."""
    h, d, v = c.hidden_size, c.head_dim, c.vocab_size
    q, kv = c.num_attention_heads * d, c.num_key_value_heads * d
    i, s = c.moe_intermediate_size, c.shared_expert_intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        EMBED: (v, h),
        "pre_fc_norm_embedding.weight": (h,), "pre_fc_norm_hidden.weight": (h,),
        "fc.weight": (h, 2 * h),
        f"{LAYER}input_layernorm.weight": (h,),
        Q_PROJ: (2 * q, h),  # per head: head_dim query rows, then head_dim gate rows
        f"{LAYER}self_attn.k_proj.weight": (kv, h), f"{LAYER}self_attn.v_proj.weight": (kv, h),
        f"{LAYER}self_attn.o_proj.weight": (h, q),
        f"{LAYER}self_attn.q_norm.weight": (d,), f"{LAYER}self_attn.k_norm.weight": (d,),
        f"{LAYER}post_attention_layernorm.weight": (h,),
        ROUTER: (c.num_experts, h),
    }
    for e in range(c.num_experts):
        p = f"{LAYER}mlp.experts.{e}."
        shapes.update({f"{p}gate_proj.weight": (i, h), f"{p}up_proj.weight": (i, h), f"{p}down_proj.weight": (h, i)})
    p = f"{LAYER}mlp.shared_expert."
    shapes.update({f"{p}gate_proj.weight": (s, h), f"{p}up_proj.weight": (s, h), f"{p}down_proj.weight": (h, s),
                   SHARED_GATE: (1, h), "norm.weight": (h,), LM_HEAD: (v, h)})
    return shapes


class Qwen3NextMtpHead(MtpHead):
    """The Qwen3-Next MTP layer: its params, their binding from the checkpoint (names of
    `qwen3_next_mtp_shapes`), and one draft step. A subclass of MtpHead for the chain's interface
    (param specs, cache shapes, batch refusals, notes); its step and MLP are its own."""

    config: Qwen3NextMtpConfig
    lm_head = LM_HEAD

    def __init__(self, config: Qwen3NextMtpConfig, dtype: str = "float32") -> None:
        if not isinstance(config, Qwen3NextMtpConfig):
            raise TypeError(f"Qwen3NextMtpHead needs a Qwen3NextMtpConfig, got {type(config).__name__}")
        super().__init__(config, dtype)

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        c, dt = self.config, self.dtype
        h, e, i = c.hidden_size, c.num_experts, c.moe_intermediate_size
        specs: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, shape in qwen3_next_mtp_shapes(c).items():
            if name == Q_PROJ:
                specs[QUERY] = specs[GATE] = (dt, (shape[0] // 2, h))
            elif ".experts." in name or ".shared_expert." in name:
                continue  # stacked below
            else:
                specs[name] = (dt, shape)
        s = c.shared_expert_intermediate_size
        specs[EXPERTS_GATE_UP], specs[EXPERTS_DOWN] = (dt, (e, 2 * i, h)), (dt, (e, h, i))
        specs[SHARED_GATE_UP], specs[SHARED_DOWN] = (dt, (2 * s, h)), (dt, (h, s))
        return specs

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: shape for k, (_, shape) in self.param_specs().items()}

    def declare_params(self, b: CircuitBuilder) -> None:
        for name, (dtype, shape) in self.param_specs().items():
            b.param(name, dtype, shape)

    def bind(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stored tensors (`qwen3_next_mtp_shapes`' names) -> params: the zero-centred norms'
        weights as stored (the norm ops add the 1), q_proj's query and gate rows apart, experts
        stacked, the shared expert's gate and up rows stacked."""
        c, dt = self.config, getattr(torch, self.dtype)
        missing = sorted(set(qwen3_next_mtp_shapes(c)) - set(weights))
        if missing:
            raise KeyError(f"Qwen3NextMtpHead.bind: weights {missing[:4]} missing")
        params: dict[str, torch.Tensor] = {}
        for name in qwen3_next_mtp_shapes(c):
            w = weights[name]
            if name == Q_PROJ:
                # q_proj's output viewed [.., heads, 2 * head_dim] and chunked: per head, query then gate
                rows = w.view(c.num_attention_heads, 2, c.head_dim, c.hidden_size)
                params[QUERY] = rows[:, 0].reshape(-1, c.hidden_size)
                params[GATE] = rows[:, 1].reshape(-1, c.hidden_size)
            elif ".experts." not in name and ".shared_expert." not in name:
                params[name] = w
        experts = range(c.num_experts)
        ex = f"{LAYER}mlp.experts."
        params[EXPERTS_GATE_UP] = torch.stack([torch.cat([weights[f"{ex}{e}.gate_proj.weight"],
                                                          weights[f"{ex}{e}.up_proj.weight"]]) for e in experts])
        params[EXPERTS_DOWN] = torch.stack([weights[f"{ex}{e}.down_proj.weight"] for e in experts])
        sh = f"{LAYER}mlp.shared_expert."
        params[SHARED_GATE_UP] = torch.cat([weights[f"{sh}gate_proj.weight"], weights[f"{sh}up_proj.weight"]])
        params[SHARED_DOWN] = weights[f"{sh}down_proj.weight"]
        return {k: params[k].to(dt).contiguous() for k in self.param_specs()}

    def emit_mlp(self, b: CircuitBuilder, x: str) -> str:
        """Qwen3NextSparseMoeBlock: routed experts + sigmoid(shared_expert_gate(x)) * shared_expert(x)."""
        c = self.config
        attrs = {"top_k": c.num_experts_per_tok, "scoring_func": "softmax", "norm_topk_prob": c.norm_topk_prob,
                 "norm_top1": c.norm_topk_prob}  # transformers normalises whatever top_k is
        ids, weights = b.op("moe_route", [x, ROUTER], attrs, name="router")
        routed = b.op1("moe_experts", [x, ids, weights, EXPERTS_GATE_UP, EXPERTS_DOWN], name="experts")
        act = b.op1("silu_mul", [b.op1("linear", [x, SHARED_GATE_UP], name="shared_gate_up_proj")])
        shared = b.op1("linear", [act, SHARED_DOWN], name="shared_down_proj")
        gate = b.op1("linear", [x, SHARED_GATE], name="shared_expert_gate")  # [n, 1]
        return b.op1("add", [routed, b.op1("sigmoid_mul", [shared, gate], name="shared_gated")],
                     name="moe_out")

    def emit_step(self, b: CircuitBuilder, step: int, token: str, hidden: str, positions: str,
                  tables: str, live: str, k_cache: str, v_cache: str, active: str,
                  bitmask: str | None = None) -> StepIO:
        c = self.config
        eps = {"eps": c.rms_norm_eps}
        rope = {"head_dim": c.head_dim, "theta": c.rope_theta, "pos_offset": step, **rotary_attrs(c)}
        attn = f"{LAYER}self_attn."
        emb = b.op1("embedding", [EMBED, token])
        x = b.op1("concat", [b.op1(NORM, [emb, "pre_fc_norm_embedding.weight"], eps, name="pre_fc_norm_embedding"),
                             b.op1(NORM, [hidden, "pre_fc_norm_hidden.weight"], eps, name="pre_fc_norm_hidden")])
        x = b.op1("linear", [x, "fc.weight"], name="fc")
        a = b.op1(NORM, [x, f"{LAYER}input_layernorm.weight"], eps, name="input_layernorm")
        q = b.op1(HEAD_NORM, [b.op1("linear", [a, QUERY], name="q_proj"), f"{attn}q_norm.weight"],
                  eps, name="q_norm")
        k = b.op1(HEAD_NORM, [b.op1("linear", [a, f"{attn}k_proj.weight"], name="k_proj"),
                              f"{attn}k_norm.weight"], eps, name="k_norm")
        v = b.op1("linear", [a, f"{attn}v_proj.weight"], name="v_proj")
        gate = b.op1("linear", [a, GATE], name="q_gate_proj")
        q = b.op1("rope", [q, positions], rope, name="rope_q")
        k = b.op1("rope", [k, positions], rope, name="rope_k")
        # rows that stopped (or are inert padding) write no drafter-KV row
        k_cache, v_cache = b.op("kv_write", [k_cache, v_cache, k, v, tables, live, active],
                                {"row_offset": step})
        o = b.op1("decode_attention", [q, k_cache, v_cache, tables, live], {"row_offset": step},
                  name="attention")
        o = b.op1("sigmoid_mul", [o, gate], name="attention_gate")
        x = b.op1("add", [x, b.op1("linear", [o, f"{attn}o_proj.weight"], name="o_proj")],
                  name="attn_residual")
        m = b.op1(NORM, [x, f"{LAYER}post_attention_layernorm.weight"], eps, name="post_attention_layernorm")
        x = b.op1("add", [x, self.emit_mlp(b, m)], name="mlp_residual")
        y = b.op1(NORM, [x, "norm.weight"], eps, name="norm")  # also the hidden handed on
        # fp32 logits: bf16 logits would tie neighbouring tokens
        logits = b.op1("linear", [y, LM_HEAD], {"out_dtype": "float32"}, name="lm_head")
        tok, lp = b.op("argmax_logprob", [logits, bitmask])
        return StepIO(hidden=y, token=tok, logprob=lp, k_cache=k_cache, v_cache=v_cache)

    def batch_refusal(self, n: int) -> str | None:
        """As MoeMtpHead's: only the grouped-decode kill switch sends a batch per sequence."""
        if moe_ops.grouped_decode_switched_off():
            return f"grouped MoE decode switched off ({KILL_SWITCH})"
        return None

    def plan_notes(self) -> dict[str, Any]:
        c = self.config
        return {"qwen3_next": {"num_experts": c.num_experts, "top_k": c.num_experts_per_tok,
                               "routing": "softmax", "shared_expert": "gated by sigmoid(shared_expert_gate)",
                               "attention_gate": "sigmoid(q_proj gate half)", "rotary_dim": c.rotary_dim,
                               "norms": "zero-centred (1 + weight), the gain formed in fp32 in the norm",
                               "hidden_handed_on": "after mtp.norm"}}
