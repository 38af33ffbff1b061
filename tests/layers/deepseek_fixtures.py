"""Tiny DeepSeek-V3 models for the tests: transformers' own DeepseekV3ForCausalLM on random weights
of O(1) activations (fp32), their tensors under the checkpoint's names (experts one by one), and
our layers emitted as a circuit over the same weights."""
from __future__ import annotations

import json
import math

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.ir import ROW, SCRATCH_BLOCK, Circuit
from draft_circuit.circuit.layers.deepseek import bind_layer, emit_decoder_layer, layer_param_specs
from draft_circuit.circuit.layers.mla import INV_FREQ, MlaConfig, mla_cache_shapes

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.9, "mscale_all_dim": 0.7}
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, kv_lora_rank=16,
            q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=10, n_group=2, topk_group=1,
            num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=64, routed_scaling_factor=2.5,
            rope_parameters=YARN)


def hf_model(seed: int = 0, **overrides):
    """transformers' model (eager attention, fp32) with every weight redrawn at O(1) scale."""
    import transformers
    fields = {**TINY, **overrides}
    config = transformers.DeepseekV3Config(**fields)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.1 * t if "norm" in name else t if "embed" in name else t / math.sqrt(p.shape[-1]))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=g))
    return model


def our_config(model) -> MlaConfig:
    return MlaConfig.from_hf(json.loads(model.config.to_json_string()))


def checkpoint_tensors(model) -> dict[str, torch.Tensor]:
    """The state dict under the checkpoint's names: fused experts split one by one."""
    out = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj"):
            p, half = k.removesuffix("gate_up_proj"), v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{p}{e}.gate_proj.weight"], out[f"{p}{e}.up_proj.weight"] = v[e, :half], v[e, half:]
        elif k.endswith("mlp.experts.down_proj"):
            p = k.removesuffix("down_proj")
            for e in range(v.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = v[e]
        else:
            out[k] = v
    return out


def layer_circuit(c: MlaConfig, layer: int, *, max_rows: int, num_blocks: int, block_size: int,
                  max_blocks: int, dtype: str = "float32") -> Circuit:
    """One target decoder layer over n rows: x -> y, writing each row's latent row."""
    b = CircuitBuilder(f"deepseek_layer_{layer}", max_width=max_rows)
    x = b.input("x", dtype, (ROW, c.hidden_size))
    positions = b.input("positions", "int32", (ROW,))
    tables = b.input("block_tables", "int32", (ROW, max_blocks), neutral=SCRATCH_BLOCK)
    live = b.input("live_rows", "int32", (ROW,))
    active = b.input("active", "int32", (ROW,), neutral=0)
    p, moe = f"model.layers.{layer}.", c.is_moe_layer(layer)
    for name, (dt, shape) in layer_param_specs(c, moe, dtype).items():
        b.param(p + name, dt, shape)
    b.param(INV_FREQ, "float32", (c.qk_rope_head_dim // 2,))
    pe_shape, latent_shape = mla_cache_shapes(c, num_blocks, block_size)
    pe, lat = b.state("pe_cache", dtype, pe_shape), b.state("latent_cache", dtype, latent_shape)
    y, pe, lat = emit_decoder_layer(b, c, p, x, positions, tables, live, pe, lat, active, moe=moe)
    b.output(y, "y")
    b.output(pe)
    b.output(lat)
    return b.build()


def layer_params(c: MlaConfig, tensors: dict[str, torch.Tensor], layer: int, dtype: str = "float32"):
    params = bind_layer(c, tensors, f"model.layers.{layer}.", c.is_moe_layer(layer), dtype)
    params[INV_FREQ] = c.rope.inv_freq(c.qk_rope_head_dim)
    return params


def tiny_config(**overrides) -> MlaConfig:
    """Our MlaConfig of TINY (transformers' names, read the way a config.json is)."""
    d = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **TINY, "head_dim": 8,
         "rope_interleave": True, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
         "n_group": 2, "topk_group": 1, "norm_topk_prob": True}
    return MlaConfig.from_hf({**d, **overrides})


def random_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """O(1) activations: norms near 1, the routing bias small, fan-in scaled matrices."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes.items():
        t = torch.randn(shape, generator=g)
        out[name] = (0.1 * t if name.endswith("correction_bias") else 1 + 0.1 * t if len(shape) == 1 else
                     t if "embed" in name else t / math.sqrt(shape[-1]))
    return out
