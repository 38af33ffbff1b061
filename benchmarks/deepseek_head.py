"""The draft-chain benchmark's DeepSeek-V3 MTP layer (`--configs deepseek_v3`): DeepSeek-V3 / R1's
shapes (hidden 7168, 128 heads, q_lora 1536, kv_lora 512, nope 128 / rope 64 / v 128, YaRN factor
40 over 4096, MoE top-8 of 256 experts in 8 groups (4 kept), 1 shared, expert intermediate 2048,
vocabulary 129280), every projection and expert fp8 e4m3 with 128x128 block scales as the released
checkpoints store them (embedding, lm-head, eh_proj, norms and router bf16 / fp32), and its floor.
All 256 experts are made (about 11 GiB of fp8 on the device, made one tensor at a time).

The plain-torch peer strategies run benchmarks/torch_mtp_mla.py (its fp8 weights dequantised to
bf16 once at setup, so it holds the 256 experts in bf16 beside the circuit's fp8 ones: ~22 GiB more);
every strategy's drafts are checked against the project's eager oracle.
"""
from __future__ import annotations

import math

import torch

from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead, mtp_checkpoint_shapes
from draft_circuit.circuit.layers.deepseek_checkpoint import FP8_STORED
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.moe import BIAS, SCALE, quantize_blocks
from draft_circuit.circuit.layers.rope import RopeScaling
from draft_circuit.ops.moe import SCALE_BLOCK, expected_distinct_experts

_YARN = RopeScaling(rope_type="yarn", theta=10000.0, factor=40.0, original_max_position_embeddings=4096,
                    beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
DEEPSEEK_V3 = MlaConfig(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_attention_heads=128,
                        num_key_value_heads=128, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                        num_hidden_layers=61, tie_word_embeddings=False, max_position_embeddings=163840,
                        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
                        n_shared_experts=1, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
                        v_head_dim=128, first_k_dense_replace=3, rope=_YARN)
DRY_DEEPSEEK = MlaConfig(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                         num_key_value_heads=4, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                         num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                         n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, n_shared_experts=1,
                         n_group=4, topk_group=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=0,
                         rope=RopeScaling(rope_type="yarn", theta=10000.0, factor=4.0,
                                          original_max_position_embeddings=32, mscale=1.0, mscale_all_dim=1.0))


def is_mla(config: MtpConfig) -> bool:
    return isinstance(config, MlaConfig)


def make_head(config: MlaConfig, dtype_name: str) -> DeepseekMtpHead:
    """fp8 projections and experts, as the released checkpoints are run."""
    return DeepseekMtpHead(config, dtype_name, fp8_experts=config.moe_intermediate_size % SCALE_BLOCK == 0,
                           fp8_dense=True)


def random_weights(config: MlaConfig, device: torch.device, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    """Checkpoint-name weights (the released layout): FP8_STORED ones fp8 e4m3 beside their
    `weight_scale_inv`, made and quantised one at a time (norms 1 + 0.1 N, projections N / sqrt(fan-in),
    the routing bias 0.1 N in fp32, embedding N)."""
    g = torch.Generator(device=device).manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in mtp_checkpoint_shapes(config).items():
        if name == BIAS:
            out[name] = 0.1 * torch.randn(shape, generator=g, device=device, dtype=torch.float32)
            continue
        t = torch.randn(shape, generator=g, device=device, dtype=dtype)
        if len(shape) == 1:
            t.mul_(0.1).add_(1.0)
        elif "embed" not in name:
            t.mul_(1.0 / math.sqrt(shape[-1]))
        if name.endswith(FP8_STORED):
            out[name], out[name + SCALE] = quantize_blocks(t)
        else:
            out[name] = t
        del t
    return out


def floor_bytes(config: MlaConfig, width: int, num_drafts: int, kv_rows: float, dtype_bytes: int = 2,
                max_blocks: int = 64) -> dict[str, float]:
    """The fewest bytes the k-step chain moves, by part, in the head's own param dtypes (fp8
    projections with their row scales, bf16 W_UK^T / W_UV, lm-head, eh_proj, fp32 routing bias):
    weights: k x every param but the embedding table and the routed experts; experts: k x the
    expected distinct experts the rows select (uniform routing) x one expert's fp8 bytes and
    scales; kv_read: step j reads kv_rows + j + 1 latent rows (kv_lora_rank + qk_rope_head_dim)
    of every sequence; kv_write: one latent row a sequence a step; activations as the MTP chain's."""
    head = make_head(config, {2: "bfloat16", 4: "float32"}[dtype_bytes])
    elem = {"float8_e4m3fn": 1, "bfloat16": 2, "float16": 2, "float32": 4}
    k, h, e = num_drafts, config.hidden_size, config.n_routed_experts
    step = experts = 0
    for name, (dt, shape) in head.param_specs().items():
        nbytes = math.prod(shape) * elem[dt]
        if name.startswith("mlp.experts."):
            experts += nbytes // e
        elif name != "embed_tokens.weight":
            step += nbytes
    row = (config.kv_lora_rank + config.qk_rope_head_dim) * dtype_bytes
    parts = {
        "weights": float(k * step),
        "kv_read": float(width * sum(kv_rows + j + 1 for j in range(k)) * row),
        "kv_write": float(width * k * row),
        "activations": float(width * (3 * 4 + h * dtype_bytes + max_blocks * 4 + 2 * 4 * k + h * dtype_bytes
                                      + k * h * dtype_bytes)),
        "experts": float(k * expected_distinct_experts(e, config.num_experts_per_tok, width) * experts),
    }
    parts["total"] = sum(parts.values())
    return parts
