"""A DeepSeek-V3-architecture target emitted from the layer library: embedding, decoder layers
(MLA everywhere; dense SwiGLU below `first_k_dense_replace`, MoE from it), final norm, lm-head,
greedy token, over n query rows. Every query token is a row attending to its sequence's latent
rows 0..live_rows (its own written first), so prefill, verify and decode are one circuit.

`emit_deepseek_target` mirrors examples/engine/model.py's Llama target (same inputs and outputs);
states are each layer's two latent pools `pe_cache_{l}`, `latent_cache_{l}` (`target_state_shapes`).
"""
from __future__ import annotations

from typing import Mapping

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.ir import ROW, SCRATCH_BLOCK, Circuit
from draft_circuit.circuit.layers.deepseek import ParamSpecs, bind_layer, emit_decoder_layer, layer_param_specs
from draft_circuit.circuit.layers.mla import INV_FREQ, MlaConfig, mla_cache_shapes
from draft_circuit.circuit.layers.moe import _real
from draft_circuit.circuit.layers.mtp import KvLayout

__all__ = ["target_param_specs", "bind_deepseek_target", "target_state_shapes", "emit_deepseek_target"]


def _layer(layer: int) -> str:
    return f"model.layers.{layer}."


def target_param_specs(c: MlaConfig, dtype: str, *, fp8_experts: bool = False, fp8_dense: bool = False) -> ParamSpecs:
    """The target circuit's params: checkpoint names where they are stored as run, the layer
    library's derived names (split, absorbed, stacked) elsewhere, and the shared `rope.inv_freq`."""
    h, v = c.hidden_size, c.vocab_size
    specs: ParamSpecs = {"model.embed_tokens.weight": (dtype, (v, h))}
    for layer in range(c.num_hidden_layers):
        specs.update({_layer(layer) + k: s for k, s in
                      layer_param_specs(c, c.is_moe_layer(layer), dtype, fp8_experts, fp8_dense).items()})
    specs.update({"model.norm.weight": (dtype, (h,)), "lm_head.weight": (dtype, (v, h)),
                  INV_FREQ: ("float32", (c.qk_rope_head_dim // 2,))})
    return specs


def bind_deepseek_target(c: MlaConfig, weights: Mapping[str, torch.Tensor], dtype: str, *,
                         fp8_experts: bool = False, fp8_dense: bool = False) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (deepseek_checkpoint.target_checkpoint_shapes' names, fp8 ones beside
    their `_scale_inv`) -> the params of target_param_specs."""
    dt = getattr(torch, dtype)
    params = {k: _real(weights, k).to(dt).contiguous() for k in ("model.embed_tokens.weight", "model.norm.weight",
                                                                 "lm_head.weight")}
    for layer in range(c.num_hidden_layers):
        params.update(bind_layer(c, weights, _layer(layer), c.is_moe_layer(layer), dtype, fp8_experts, fp8_dense))
    # computed, not read: on the weights' device like every other param (issue 16)
    params[INV_FREQ] = c.rope.inv_freq(c.qk_rope_head_dim).to(params["model.embed_tokens.weight"].device)
    return {k: params[k] for k in target_param_specs(c, dtype, fp8_experts=fp8_experts, fp8_dense=fp8_dense)}


def target_state_shapes(c: MlaConfig, kv: KvLayout) -> dict[str, tuple[int, ...]]:
    pe, latent = mla_cache_shapes(c, kv.num_blocks, kv.block_size)
    return {name: shape for layer in range(c.num_hidden_layers)
            for name, shape in ((f"pe_cache_{layer}", pe), (f"latent_cache_{layer}", latent))}


def emit_deepseek_target(c: MlaConfig, *, kv: KvLayout, max_rows: int, dtype: str = "float32",
                         fp8_experts: bool = False, fp8_dense: bool = False,
                         name: str = "deepseek_v3_target") -> Circuit:
    """The target's forward over n query rows.

    Inputs: tokens i32[n], positions i32[n], block_tables i32[n, M], live_rows i32[n] (latent rows
    before this row: it writes row live_rows and attends to 0..live_rows), active i32[n] (0: an
    inert padding row that writes nothing). Outputs: token i32[n] (argmax), logprob f32[n],
    hidden [n, H] (after the final norm: what the MTP head drafts from)."""
    b = CircuitBuilder(name, max_width=max_rows)
    tokens = b.input("tokens", "int32", (ROW,))
    positions = b.input("positions", "int32", (ROW,))
    tables = b.input("block_tables", "int32", (ROW, kv.max_blocks_per_seq), neutral=SCRATCH_BLOCK)
    live = b.input("live_rows", "int32", (ROW,))
    active = b.input("active", "int32", (ROW,), neutral=0)
    for pname, (pdtype, shape) in target_param_specs(c, dtype, fp8_experts=fp8_experts, fp8_dense=fp8_dense).items():
        b.param(pname, pdtype, shape)
    x = b.op1("embedding", ["model.embed_tokens.weight", tokens], name="embed_tokens")
    for layer in range(c.num_hidden_layers):
        pe = b.state(f"pe_cache_{layer}", dtype, mla_cache_shapes(c, kv.num_blocks, kv.block_size)[0])
        latent = b.state(f"latent_cache_{layer}", dtype, mla_cache_shapes(c, kv.num_blocks, kv.block_size)[1])
        with b.scope(f"l{layer}"):
            x, pe, latent = emit_decoder_layer(b, c, _layer(layer), x, positions, tables, live, pe, latent,
                                               active, moe=c.is_moe_layer(layer))
        b.output(pe)
        b.output(latent)
    h = b.op1("rmsnorm", [x, "model.norm.weight"], {"eps": c.rms_norm_eps}, name="norm")
    logits = b.op1("linear", [h, "lm_head.weight"], {"out_dtype": "float32"}, name="lm_head")
    token, logprob = b.op("argmax_logprob", [logits])
    b.output(token, "token")
    b.output(logprob, "logprob")
    b.output(h, "hidden")
    return b.build()
