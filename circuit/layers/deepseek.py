"""DeepSeek-V3 decoder layers from the layer library: `emit_decoder_layer` (MLA attention, then a
dense SwiGLU or the MoE MLP, each behind its RMSNorm and residual, as DeepseekV3DecoderLayer),
their params (`layer_param_specs`, `bind_layer`: checkpoint names -> circuit params), and
`DeepseekMtpHead`, the MTP layer (enorm, hnorm, eh_proj, a MoE decoder layer, shared_head).

Names are relative to a layer prefix: "" for the MTP layer's canonical names, `model.layers.{l}.`
for a target layer. Weights are real numbers (block-scaled fp8 ones dequantised) unless the layer
keeps its fp8 experts (`fp8_experts`: stored fp8 plus scales, as MoeMtpHead keeps them).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.layers.fp8 import ROW_SCALE, emit_linear, fp8_rows, row_scale_shape
from draft_circuit.circuit.layers.mla import (INV_FREQ, MlaConfig, bind_mla_attention, emit_mla_attention,
                                              mla_cache_shapes, mla_checkpoint_shapes, mla_param_specs)
from draft_circuit.circuit.layers.moe import (BIAS, EXPERTS_DOWN, EXPERTS_GATE_UP, GATE, SCALE, SHARED_DOWN,
                                              SHARED_GATE_UP, MoeMtpHead, MoeWeightError, _real, quantize_blocks)
from draft_circuit.circuit.layers.mtp import GATE_UP, KvLayout, StepIO
from draft_circuit.ops.moe import FP8, SCALE_BLOCK

__all__ = ["ParamSpecs", "layer_checkpoint_shapes", "layer_param_specs", "bind_layer", "emit_decoder_layer",
           "emit_moe_mlp", "DeepseekMtpHead", "mtp_checkpoint_shapes"]

ParamSpecs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")
_DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def layer_checkpoint_shapes(c: MlaConfig, moe: bool) -> dict[str, tuple[int, ...]]:
    """A decoder layer's tensors as stored (relative names; MoE experts one by one)."""
    h = c.hidden_size
    shapes = {_NORMS[0]: (h,), **mla_checkpoint_shapes(c), _NORMS[1]: (h,)}
    if not moe:
        i = c.intermediate_size
        return {**shapes, _DENSE[0]: (i, h), _DENSE[1]: (i, h), _DENSE[2]: (h, i)}
    i, s = c.moe_intermediate_size, c.shared_intermediate_size
    shapes.update({GATE: (c.n_routed_experts, h), BIAS: (c.n_routed_experts,)})
    for p, size in [*((f"mlp.experts.{e}.", i) for e in range(c.n_routed_experts)),
                    *((("mlp.shared_experts.", s),) if s else ())]:
        shapes.update({f"{p}gate_proj.weight": (size, h), f"{p}up_proj.weight": (size, h),
                       f"{p}down_proj.weight": (h, size)})
    return shapes


def _moe_specs(c: MlaConfig, dtype: str, fp8_experts: bool) -> ParamSpecs:
    return {k: v for k, v in MoeMtpHead(c, dtype, fp8_experts).param_specs().items() if k.startswith("mlp.")}


def layer_param_specs(c: MlaConfig, moe: bool, dtype: str, fp8_experts: bool = False,
                      fp8_dense: bool = False) -> ParamSpecs:
    """A decoder layer's circuit params (relative names); INV_FREQ is the model's, not listed.
    fp8_experts: routed experts fp8 (moe_experts_fp8); fp8_dense: the attention projections and a
    dense MLP fp8 with per-row scales (linear_fp8). Shared experts stay in `dtype` (moe_experts
    takes them so)."""
    h = c.hidden_size
    specs: ParamSpecs = {_NORMS[0]: (dtype, (h,)), **mla_param_specs(c, dtype, fp8_dense), _NORMS[1]: (dtype, (h,))}
    if moe:
        specs.update(_moe_specs(c, dtype, fp8_experts))
        return specs
    i = c.intermediate_size
    for name, shape in ((GATE_UP, (2 * i, h)), (_DENSE[2], (h, i))):
        specs[name] = (FP8 if fp8_dense else dtype, shape)
        if fp8_dense:
            specs[name + ROW_SCALE] = ("float32", row_scale_shape(shape))
    return specs


def _stack_experts(c: MlaConfig, w: Mapping[str, torch.Tensor], p: str, fp8: bool) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> the stacked [E, 2I, H] / [E, H, I] params (stored fp8 kept as stored)."""
    out: dict[str, torch.Tensor] = {}
    experts = range(c.n_routed_experts)
    groups = {EXPERTS_GATE_UP: [[f"{p}mlp.experts.{e}.{q}_proj.weight" for q in ("gate", "up")] for e in experts],
              EXPERTS_DOWN: [[f"{p}mlp.experts.{e}.down_proj.weight"] for e in experts]}
    for name, keys in groups.items():
        stored = all(w[k].dtype == torch.float8_e4m3fn and k + SCALE in w for g in keys for k in g)
        if fp8 and stored:
            if name == EXPERTS_GATE_UP and c.moe_intermediate_size % SCALE_BLOCK:
                raise MoeWeightError(f"fp8 experts: moe_intermediate_size = {c.moe_intermediate_size} is "
                                     f"no multiple of {SCALE_BLOCK}, so gate and up scales cannot stack")
            out[name] = torch.stack([torch.cat([w[k] for k in g]) for g in keys])
            out[name + SCALE] = torch.stack([torch.cat([w[k + SCALE] for k in g]) for g in keys])
        else:
            out[name] = torch.stack([torch.cat([_real(w, k) for k in g]) for g in keys])
            if fp8:
                out[name], out[name + SCALE] = quantize_blocks(out[name])
    return out


def bind_layer(c: MlaConfig, weights: Mapping[str, torch.Tensor], prefix: str, moe: bool, dtype: str,
               fp8_experts: bool = False, fp8_dense: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (`prefix` + layer_checkpoint_shapes' names; fp8 ones beside their
    `_scale_inv`) -> the params of layer_param_specs under `prefix`, in their dtypes."""
    p = prefix
    params = {**bind_mla_attention(c, weights, p, fp8=fp8_dense), **{p + k: _real(weights, p + k) for k in _NORMS}}
    if moe:
        params[p + GATE], params[p + BIAS] = _real(weights, p + GATE), weights[p + BIAS]
        if c.shared_intermediate_size:
            params[p + SHARED_GATE_UP] = torch.cat([_real(weights, f"{p}mlp.shared_experts.{q}_proj.weight")
                                                    for q in ("gate", "up")])
            params[p + SHARED_DOWN] = _real(weights, f"{p}mlp.shared_experts.down_proj.weight")
        params.update({p + k: v for k, v in _stack_experts(c, weights, p, fp8_experts).items()})
    elif fp8_dense:
        (gw, gs), (uw, us) = fp8_rows(weights, p + _DENSE[0]), fp8_rows(weights, p + _DENSE[1])
        params[p + GATE_UP] = torch.cat([gw.view(torch.uint8), uw.view(torch.uint8)]).view(gw.dtype)
        params[p + GATE_UP + ROW_SCALE] = torch.cat([gs, us])
        params[p + _DENSE[2]], params[p + _DENSE[2] + ROW_SCALE] = fp8_rows(weights, p + _DENSE[2])
    else:
        params[p + GATE_UP] = torch.cat([_real(weights, p + _DENSE[0]), _real(weights, p + _DENSE[1])])
        params[p + _DENSE[2]] = _real(weights, p + _DENSE[2])
    specs = layer_param_specs(c, moe, dtype, fp8_experts, fp8_dense)
    return {p + k: params[p + k].to(getattr(torch, dt)).contiguous() for k, (dt, _) in specs.items()}


def emit_moe_mlp(b: CircuitBuilder, c: MlaConfig, prefix: str, x: str) -> str:
    """DeepseekV3MoE on the normed x: sigmoid group-limited routing, routed and shared experts
    (fp8 experts when the stacked params are fp8)."""
    p = prefix
    attrs = {"top_k": c.num_experts_per_tok, "scoring_func": c.scoring_func, "n_group": c.n_group,
             "topk_group": c.topk_group, "norm_topk_prob": c.norm_topk_prob,
             "routed_scaling_factor": c.routed_scaling_factor}
    ids, weights = b.op("moe_route", [x, p + GATE, p + BIAS if c.scoring_func == "sigmoid" else None], attrs,
                        name="router")
    shared = [p + SHARED_GATE_UP, p + SHARED_DOWN] if c.shared_intermediate_size else []
    gu, down = p + EXPERTS_GATE_UP, p + EXPERTS_DOWN
    if b.spec(gu).dtype == FP8:
        return b.op1("moe_experts_fp8", [x, ids, weights, gu, gu + SCALE, down, down + SCALE, *shared],
                     name="experts")
    return b.op1("moe_experts", [x, ids, weights, gu, down, *shared], name="experts")


def emit_decoder_layer(b: CircuitBuilder, c: MlaConfig, prefix: str, x: str, positions: str, tables: str,
                       live: str, pe_cache: str, latent_cache: str, active: str | None, *, moe: bool,
                       step: int = 0) -> tuple[str, str, str]:
    """DeepseekV3DecoderLayer over the residual stream x [n, H]: (x out, pe_cache, latent_cache)."""
    eps = {"eps": c.rms_norm_eps}
    a = b.op1("rmsnorm", [x, prefix + _NORMS[0]], eps, name="input_layernorm")
    o, pe_cache, latent_cache = emit_mla_attention(b, c, prefix, a, positions, tables, live, pe_cache,
                                                   latent_cache, active, step=step)
    x = b.op1("add", [x, o], name="attn_residual")
    m = b.op1("rmsnorm", [x, prefix + _NORMS[1]], eps, name="post_attention_layernorm")
    if moe:
        y = emit_moe_mlp(b, c, prefix, m)
    else:
        g = b.op1("silu_mul", [emit_linear(b, m, prefix + GATE_UP, "gate_up_proj")])
        y = emit_linear(b, g, prefix + _DENSE[2], "down_proj")
    return b.op1("add", [x, y], name="mlp_residual"), pe_cache, latent_cache


_MTP_OWN = ("embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
            "shared_head.head.weight")


class DeepseekMtpHead(MoeMtpHead):
    """DeepSeek-V3's MTP layer: like MoeMtpHead, with MLA attention over two pools (k_cache: the
    roped keys, v_cache: the latents) and YaRN frequencies (`rope.inv_freq`)."""

    config: MlaConfig

    def __init__(self, config: MlaConfig, dtype: str = "float32", fp8_experts: bool = False,
                 fp8_dense: bool = False) -> None:
        if not isinstance(config, MlaConfig):
            raise TypeError(f"DeepseekMtpHead needs an MlaConfig, got {type(config).__name__}")
        super().__init__(config, dtype, fp8_experts)
        self.fp8_dense = fp8_dense

    def param_specs(self) -> ParamSpecs:
        c, dt = self.config, self.dtype
        h, v = c.hidden_size, c.vocab_size
        own = dict(zip(_MTP_OWN, [(v, h), (h,), (h,), (h, 2 * h), (h,), (v, h)]))
        specs: ParamSpecs = {k: (dt, s) for k, s in list(own.items())[:4]}
        specs.update(layer_param_specs(c, True, dt, self.fp8_experts, self.fp8_dense))
        specs.update({k: (dt, s) for k, s in list(own.items())[4:]})
        specs[INV_FREQ] = ("float32", (c.qk_rope_head_dim // 2,))
        return specs

    def bind(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical MTP-layer weights (checkpoint names, `_scale_inv` beside fp8 ones) -> params."""
        dt = getattr(torch, self.dtype)
        params = {k: _real(weights, k).to(dt).contiguous() for k in _MTP_OWN}
        params.update(bind_layer(self.config, weights, "", True, self.dtype, self.fp8_experts, self.fp8_dense))
        # computed, not read: put it where the weights are, as every other bound param is (issue 16:
        # left on the CPU, the H200 benchmark's chain failed at setup)
        device = params["embed_tokens.weight"].device
        params[INV_FREQ] = self.config.rope.inv_freq(self.config.qk_rope_head_dim).to(device)
        return {k: params[k] for k in self.param_specs()}

    def cache_shapes(self, kv: KvLayout) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return mla_cache_shapes(self.config, kv.num_blocks, kv.block_size)

    def emit_step(self, b: CircuitBuilder, step: int, token: str, hidden: str, positions: str,
                  tables: str, live: str, k_cache: str, v_cache: str, active: str,
                  bitmask: str | None = None) -> StepIO:
        c = self.config
        eps = {"eps": c.rms_norm_eps}
        emb = b.op1("embedding", ["embed_tokens.weight", token])
        x = b.op1("concat", [b.op1("rmsnorm", [emb, "enorm.weight"], eps, name="enorm"),
                             b.op1("rmsnorm", [hidden, "hnorm.weight"], eps, name="hnorm")])
        x = b.op1("linear", [x, "eh_proj.weight"], name="eh_proj")
        # rows that stopped (or are inert padding) write no latent row
        x, k_cache, v_cache = emit_decoder_layer(b, c, "", x, positions, tables, live, k_cache, v_cache,
                                                 active, moe=True, step=step)
        y = b.op1("rmsnorm", [x, "shared_head.norm.weight"], eps, name="shared_head_norm")
        # fp32 logits: bf16 logits would tie neighbouring tokens
        logits = b.op1("linear", [y, "shared_head.head.weight"], {"out_dtype": "float32"}, name="lm_head")
        tok, lp = b.op("argmax_logprob", [logits, bitmask])
        return StepIO(hidden=x, token=tok, logprob=lp, k_cache=k_cache, v_cache=v_cache)

    def plan_notes(self) -> dict[str, Any]:
        c = self.config
        return {**super().plan_notes(),
                "mla": {"kv_lora_rank": c.kv_lora_rank, "qk_rope_head_dim": c.qk_rope_head_dim,
                        "latent_row_bytes": (c.kv_lora_rank + c.qk_rope_head_dim) *
                        torch.finfo(getattr(torch, self.dtype)).bits // 8,
                        "rope": c.rope.rope_type, "softmax_scale": c.softmax_scale}}


def mtp_checkpoint_shapes(c: MlaConfig) -> dict[str, tuple[int, ...]]:
    """The MTP layer's tensors as stored, canonical (relative) names."""
    h, v = c.hidden_size, c.vocab_size
    own = dict(zip(_MTP_OWN, [(v, h), (h,), (h,), (h, 2 * h), (h,), (v, h)]))
    return {**own, **layer_checkpoint_shapes(c, moe=True)}

