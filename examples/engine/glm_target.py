"""The engine's GLM-4.5 target (`Glm4MoeForCausalLM`): its decoder emitted from the layer library
behind TargetModel's interface (`forward(rows)`: each row's greedy token and final-norm hidden).

A layer is Glm4MoeDecoderLayer: RMSNorm, Glm4MoeAttention (q/k/v with their biases iff
attention_bias, per-head q/k RMSNorm iff use_qk_norm, RoPE over the first int(head_dim *
partial_rotary_factor) dims, o_proj without bias), residual, RMSNorm, then a dense SwiGLU below
`first_k_dense_replace` or Glm4MoeMoE from it (an fp32 router: sigmoid scores plus
`e_score_correction_bias`, group-limited top-k, weights normalised and scaled; routed experts
plus the shared experts), residual. The same ops as the Llama target (examples/engine/model.py)
and the MoE MTP head (moe_route, moe_experts), so the KV pools are the Llama target's: one K and
one V pool per layer.

Additive beside deepseek_target.py: `target_for` here picks this model for GLM-4.5 target
weights (`load_target_weights` on a glm4_moe checkpoint, circuit/layers/glm4_moe_target.py) and
defers to deepseek_target.target_for otherwise.
"""
from __future__ import annotations

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.ir import ROW, SCRATCH_BLOCK, Circuit
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.deepseek import _stack_experts
from draft_circuit.circuit.layers.glm4_moe_target import moe_target_layers
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import (BIAS, EXPERTS_DOWN, EXPERTS_GATE_UP, GATE, SHARED_DOWN, SHARED_GATE_UP,
                                              MoeConfig, MoeMtpHead)
from draft_circuit.circuit.layers.mtp import GATE_UP, KvLayout, emit_qk_norm, qkv_params, rotary_attrs
from draft_circuit.runners.eager import EagerDraftRunner
from draft_circuit.runners.protocol import DraftRunner
from examples.engine.capture import GRAPH_ROWS, TargetPasses
from examples.engine.deepseek_target import target_for as _other_target_for
from examples.engine.model import TargetModel

ParamSpecs = dict[str, tuple[str, tuple[int, ...]]]
_DOWN = "mlp.down_proj.weight"


def _layer(layer: int) -> str:
    return f"model.layers.{layer}."


def glm_target_param_specs(c: MoeConfig, moe: tuple[bool, ...], dtype: str) -> ParamSpecs:
    """The circuit's params: stored names where stored as run; per layer the dense MLP's gate and
    up stacked (GATE_UP), or the MoE MLP's params as MoeMtpHead names them (the router and its
    bias fp32, experts stacked, the shared experts' gate and up stacked)."""
    h, v, i = c.hidden_size, c.vocab_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    moe_specs = {k: s for k, s in MoeMtpHead(c, dtype).param_specs().items() if k.startswith("mlp.")}
    specs: ParamSpecs = {"model.embed_tokens.weight": (dtype, (v, h))}
    for layer, is_moe in enumerate(moe):
        p = _layer(layer)
        specs[p + "input_layernorm.weight"] = (dtype, (h,))
        for which, rows in (("q", q), ("k", kv), ("v", kv)):
            specs.update({name: (dtype, (rows, h) if name.endswith(".weight") else (rows,))
                          for name in qkv_params(c, which, p)})
        if c.qk_norm:
            specs.update({f"{p}self_attn.{w}_norm.weight": (dtype, (c.head_dim,)) for w in ("q", "k")})
        specs[p + "self_attn.o_proj.weight"] = (dtype, (h, q))
        specs[p + "post_attention_layernorm.weight"] = (dtype, (h,))
        if is_moe:
            specs.update({p + k: s for k, s in moe_specs.items()})
        else:
            specs[p + GATE_UP], specs[p + _DOWN] = (dtype, (2 * i, h)), (dtype, (h, i))
    specs.update({"model.norm.weight": (dtype, (h,)), "lm_head.weight": (dtype, (v, h))})
    return specs


def bind_glm_target(c: MoeConfig, weights: dict[str, torch.Tensor], moe: tuple[bool, ...],
                    dtype: str) -> dict[str, torch.Tensor]:
    """Stored target tensors (glm4_moe_target_shapes' names) -> the params of glm_target_param_specs."""
    specs = glm_target_param_specs(c, moe, dtype)
    params = {k: w for k, w in weights.items() if k in specs}
    for layer, is_moe in enumerate(moe):
        p = _layer(layer)
        if is_moe:
            params.update({p + k: t for k, t in _stack_experts(c, weights, p, fp8=False).items()})
            if c.shared_intermediate_size:
                params[p + SHARED_GATE_UP] = torch.cat([weights[f"{p}mlp.shared_experts.{w}_proj.weight"]
                                                        for w in ("gate", "up")])
                params[p + SHARED_DOWN] = weights[f"{p}mlp.shared_experts.down_proj.weight"]
        else:
            params[p + GATE_UP] = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
    return {k: params[k].to(getattr(torch, dt)).contiguous() for k, (dt, _) in specs.items()}


def emit_glm_moe_mlp(b: CircuitBuilder, c: MoeConfig, prefix: str, x: str) -> str:
    """Glm4MoeMoE on the normed x, as MoeMtpHead.emit_mlp emits the MTP layer's (the same attrs:
    Glm4MoeTopkRouter's sigmoid, group-limited routing, normalised at top-1 too)."""
    p = prefix
    attrs = {"top_k": c.num_experts_per_tok, "scoring_func": c.scoring_func, "n_group": c.n_group,
             "topk_group": c.topk_group, "norm_topk_prob": c.norm_topk_prob,
             "routed_scaling_factor": c.routed_scaling_factor, **({"norm_top1": True} if c.norm_top1 else {})}
    ids, weights = b.op("moe_route", [x, p + GATE, p + BIAS if c.scoring_func == "sigmoid" else None], attrs,
                        name="router")
    shared = [p + SHARED_GATE_UP, p + SHARED_DOWN] if c.shared_intermediate_size else []
    return b.op1("moe_experts", [x, ids, weights, p + EXPERTS_GATE_UP, p + EXPERTS_DOWN, *shared], name="experts")


def emit_glm_target(c: MoeConfig, moe: tuple[bool, ...], *, kv: KvLayout, max_rows: int, dtype: str = "float32",
                    name: str = "glm4_moe_target") -> Circuit:
    """The target's forward over n query rows; inputs, states and outputs are the Llama target's
    (examples/engine/model.py emit_target): tokens, positions, block_tables, live_rows, active in;
    k_cache_{l} / v_cache_{l}; token, logprob, hidden (after the final norm) out."""
    b = CircuitBuilder(name, max_width=max_rows)
    tokens = b.input("tokens", "int32", (ROW,))
    positions = b.input("positions", "int32", (ROW,))
    tables = b.input("block_tables", "int32", (ROW, kv.max_blocks_per_seq), neutral=SCRATCH_BLOCK)
    live = b.input("live_rows", "int32", (ROW,))
    active = b.input("active", "int32", (ROW,), neutral=0)  # inert rows write no KV
    for pname, (pdtype, shape) in glm_target_param_specs(c, moe, dtype).items():
        b.param(pname, pdtype, shape)
    cache_shape = (kv.num_blocks, kv.block_size, c.num_key_value_heads, c.head_dim)
    eps = {"eps": c.rms_norm_eps}
    rope = {"head_dim": c.head_dim, "theta": c.rope_theta, **rotary_attrs(c)}
    x = b.op1("embedding", ["model.embed_tokens.weight", tokens], name="embed_tokens")
    for layer, is_moe in enumerate(moe):
        p = _layer(layer)
        k_cache = b.state(f"k_cache_{layer}", dtype, cache_shape)
        v_cache = b.state(f"v_cache_{layer}", dtype, cache_shape)
        with b.scope(f"l{layer}"):
            a = b.op1("rmsnorm", [x, p + "input_layernorm.weight"], eps, name="input_layernorm")
            q = emit_qk_norm(b, c, "q", b.op1("linear", [a, *qkv_params(c, "q", p)], name="q_proj"), p)
            k = emit_qk_norm(b, c, "k", b.op1("linear", [a, *qkv_params(c, "k", p)], name="k_proj"), p)
            v = b.op1("linear", [a, *qkv_params(c, "v", p)], name="v_proj")
            q = b.op1("rope", [q, positions], rope, name="rope_q")
            k = b.op1("rope", [k, positions], rope, name="rope_k")
            k_cache, v_cache = b.op("kv_write", [k_cache, v_cache, k, v, tables, live, active])
            o = b.op1("decode_attention", [q, k_cache, v_cache, tables, live], name="attention")
            x = b.op1("add", [x, b.op1("linear", [o, p + "self_attn.o_proj.weight"], name="o_proj")],
                      name="attn_residual")
            m = b.op1("rmsnorm", [x, p + "post_attention_layernorm.weight"], eps, name="post_attention_layernorm")
            if is_moe:
                y = emit_glm_moe_mlp(b, c, p, m)
            else:
                g = b.op1("silu_mul", [b.op1("linear", [m, p + GATE_UP], name="gate_up_proj")])
                y = b.op1("linear", [g, p + _DOWN], name="down_proj")
            x = b.op1("add", [x, y], name="mlp_residual")
        b.output(k_cache)
        b.output(v_cache)
    h = b.op1("rmsnorm", [x, "model.norm.weight"], eps, name="norm")
    logits = b.op1("linear", [h, "lm_head.weight"], {"out_dtype": "float32"}, name="lm_head")
    token, logprob = b.op("argmax_logprob", [logits])
    b.output(token, "token")
    b.output(logprob, "logprob")
    b.output(h, "hidden")
    return b.build()


class GlmTargetModel(TargetModel):
    """forward="eager": the eager oracle at any row count; "circuit": compiled (TargetModel's
    policy: power-of-two buckets up to max_rows, decode / verify ones CUDA graphs on CUDA).
    Which layers are MoE is read off the weights (a layer whose router was loaded)."""

    def __init__(self, config: MoeConfig, weights: dict[str, torch.Tensor], kv: KvLayout, *,
                 max_rows: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 forward: str = "eager", tap_layers: tuple[int, ...] | None = None,
                 graph_rows: int = GRAPH_ROWS) -> None:
        if not isinstance(config, MoeConfig) or isinstance(config, MlaConfig):
            raise TypeError(f"GlmTargetModel needs a (GLM-4.5) MoeConfig, got {type(config).__name__}")
        if tap_layers is not None:  # an EAGLE-3 drafter's taps: not emitted here
            raise ValueError(f"tap_layers {list(tap_layers)}: the GLM-4.5 target taps no layers "
                             "(draft with its MTP layer)")
        self.config, self.kv, self.device, self.max_rows = config, kv, torch.device(device), max_rows
        self.hidden_size = config.hidden_size  # the final-norm hidden its MTP layer reads
        self.moe_layers = moe_target_layers(weights, config.num_hidden_layers)
        name = str(dtype).removeprefix("torch.")
        self.circuit = emit_glm_target(config, self.moe_layers, kv=kv, max_rows=max_rows, dtype=name)
        params = {k: w.to(self.device) for k, w in bind_glm_target(config, weights, self.moe_layers, name).items()}
        shape = (kv.num_blocks, kv.block_size, config.num_key_value_heads, config.head_dim)
        states = {f"{kind}_cache_{layer}": torch.zeros(shape, dtype=dtype, device=self.device)
                  for layer in range(config.num_hidden_layers) for kind in ("k", "v")}
        self.runner: DraftRunner
        if forward == "eager":
            self.runner = EagerDraftRunner(self.circuit, params, states)
        elif forward == "circuit":
            self.runner = TargetPasses(self.circuit, params, states, max_rows=max_rows, device=str(self.device),
                                       graph_rows=graph_rows)
        else:
            raise ValueError(f"target forward must be 'eager' or 'circuit', got {forward!r}")


def is_glm_target(config: MtpConfig, weights: dict[str, torch.Tensor]) -> bool:
    """GLM-4.5 target weights: a (non-MLA) MoE config whose target layers carry routers."""
    return isinstance(config, MoeConfig) and not isinstance(config, MlaConfig) and \
        any(moe_target_layers(weights, config.num_hidden_layers))


def target_for(config: MtpConfig, weights: dict[str, torch.Tensor], kv: KvLayout, **kwargs) -> TargetModel:
    """GLM-4.5's target for its weights, else deepseek_target.target_for (DeepSeek-V3's, Llama's)."""
    if is_glm_target(config, weights):
        assert isinstance(config, MoeConfig)  # is_glm_target checked it
        return GlmTargetModel(config, weights, kv, **kwargs)
    return _other_target_for(config, weights, kv, **kwargs)
