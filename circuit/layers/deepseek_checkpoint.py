"""DeepSeek-V3-layout checkpoints (config.json + safetensors, as the released V3 / R1 and as
transformers' DeepseekV3ForCausalLM.save_pretrained write them): the target's tensors
(`model.embed_tokens`, `model.layers.{l}` with MLA attention and a dense MLP below
`first_k_dense_replace`, a MoE from it, `model.norm`, `lm_head`), read with the loader's checks;
fp8 e4m3 weights come with their 128x128 `weight_scale_inv`, dequantised or kept. The MTP layer
(`model.layers.{num_hidden_layers}`) is read by checkpoint.load_mtp_weights. `write_deepseek_checkpoint`
writes random weights in the same layout.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from draft_circuit.circuit.layers.checkpoint import (CONFIG_NAME, _first_present, _inventory, _label,
                                                     _reject_extras, read_config, read_planned)
from draft_circuit.circuit.layers.checkpoint_writer import write_shards
from draft_circuit.circuit.layers.checkpoint_errors import MissingTensorError
from draft_circuit.circuit.layers.deepseek import layer_checkpoint_shapes, mtp_checkpoint_shapes
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import SCALE, quantize_blocks
from draft_circuit.circuit.layers.tensor_checks import refuse_unimplemented
from draft_circuit.ops.moe import SCALE_BLOCK

__all__ = ["target_checkpoint_shapes", "load_deepseek_target_weights", "write_deepseek_checkpoint",
           "FP8_STORED"]

# What DeepSeek-V3 stores fp8 (with `weight_scale_inv`): every projection of the attention and the
# MLPs, experts included. Embeddings, norms, the router, eh_proj and the heads stay bf16.
FP8_STORED = ("q_a_proj.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
              "kv_b_proj.weight", "o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight")


def target_checkpoint_shapes(c: MlaConfig) -> dict[str, tuple[int, ...]]:
    """The target's stored tensors; `lm_head.weight` is listed even when tied."""
    h, v = c.hidden_size, c.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(c.num_hidden_layers):
        shapes.update({f"model.layers.{layer}.{k}": s
                       for k, s in layer_checkpoint_shapes(c, c.is_moe_layer(layer)).items()})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes


def load_deepseek_target_weights(
    path: str | os.PathLike[str], config: MlaConfig | None = None, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", *, strict: bool = False, keep_fp8: bool = False,
) -> dict[str, torch.Tensor]:
    """The target's weights under their checkpoint names (target_checkpoint_shapes); the routing
    biases in fp32; an fp8 weight dequantised to `dtype`, or with keep_fp8 as stored beside its
    `_scale_inv`. Tied embeddings: `lm_head.weight` is the embedding. Refusals as for any target:
    a tensor inside a module it runs that it does not use, and with strict=True any tensor that
    is neither a target nor an MTP-layer tensor."""
    root = Path(path)
    read = config if config is not None else read_config(root)
    if not isinstance(read, MlaConfig):
        raise TypeError(f"{root}: a DeepSeek-V3 target needs an MlaConfig, got {type(read).__name__}")
    config, inv = read, _inventory(root)
    for layer in range(config.num_hidden_layers):
        if (marker := f"model.layers.{layer}.eh_proj.weight") in inv.where:
            raise MissingTensorError(f"target layer {layer}: {inv.where[marker]} holds {marker!r}, so "
                                     f"model.layers.{layer} is an MTP layer, not a target layer")
    shapes = target_checkpoint_shapes(config)
    tied = config.tie_word_embeddings
    plan = {n: _first_present(inv, f"target tensor {n!r}", [n]) for n in shapes if not (tied and n == "lm_head.weight")}
    if tied:
        plan["lm_head.weight"] = plan["model.embed_tokens.weight"]
    scales = {n + SCALE: k + SCALE for n, k in plan.items() if k + SCALE in inv.where}
    layers = [f"model.layers.{i}." for i in range(config.num_hidden_layers)]
    refuse_unimplemented(inv.where, {*plan.values(), *scales.values()}, layers, _label(root))
    if strict:
        mtp = tuple(f"model.layers.{config.num_hidden_layers + i}." for i in range(config.num_nextn_predict_layers))
        known = set(shapes) | set(scales.values())
        _reject_extras(inv, sorted(k for k in inv.where if k not in known and not k.startswith(mtp)),
                       "outside the target and MTP layers")
    fp32 = {n: plan.pop(n) for n in list(plan) if n.endswith("e_score_correction_bias")}
    return read_planned(inv, plan, fp32, scales, shapes, dtype, device, keep_fp8)


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, generator=gen)
    if name.endswith("correction_bias"):
        return 0.1 * t
    if name.removesuffix(".weight").endswith("norm"):
        return 1.0 + 0.1 * t
    return t if name.endswith("embed_tokens.weight") else t / math.sqrt(shape[-1])


def write_deepseek_checkpoint(path: str | os.PathLike[str], config: MlaConfig, *, seed: int = 0,
                              dtype: torch.dtype = torch.float32, fp8: bool = False, shards: int = 1,
                              mtp_shares_embed: bool = True, mtp_shares_head: bool = True) -> Path:
    """config.json and random safetensors in DeepSeek-V3's layout: the target, then the MTP layer
    at `model.layers.{num_hidden_layers}` (its own embed_tokens / shared_head.head unless shared,
    as the released checkpoints store them). fp8: FP8_STORED weights fp8 e4m3 beside their
    `weight_scale_inv`, as the released checkpoints. Deterministic for (config, flags, seed)."""
    root = Path(path)
    if (root / CONFIG_NAME).exists() or (root.is_dir() and any(root.glob("*.safetensors"))):
        raise FileExistsError(f"{root} already holds a checkpoint; refusing to mix files into it")
    shapes = target_checkpoint_shapes(config)
    if config.tie_word_embeddings:
        del shapes["lm_head.weight"]
    mtp = mtp_checkpoint_shapes(config)
    for name, drop in (("embed_tokens.weight", mtp_shares_embed), ("shared_head.head.weight", mtp_shares_head)):
        if drop:
            del mtp[name]
    for i in range(config.num_nextn_predict_layers):
        shapes.update({f"model.layers.{config.num_hidden_layers + i}.{k}": s for k, s in mtp.items()})
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        t = _random(name, shape, gen)
        if fp8 and name.endswith(FP8_STORED) and "eh_proj" not in name:
            tensors[name], tensors[name + SCALE] = quantize_blocks(t)
        else:
            tensors[name] = t.to(torch.float32 if name.endswith("correction_bias") else dtype)
    root.mkdir(parents=True, exist_ok=True)
    hf = config.to_hf()
    if fp8:
        hf["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                     "weight_block_size": [SCALE_BLOCK, SCALE_BLOCK]}
    (root / CONFIG_NAME).write_text(json.dumps(hf, indent=2) + "\n")
    write_shards(root, tensors, shards)
    return root
