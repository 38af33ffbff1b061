"""`write_random_checkpoint`: a Hugging Face-layout checkpoint (config.json + safetensors) of
random weights in exactly the layout circuit/layers/checkpoint.py reads (its names, its MTP layer
tables, its index file), for tests and benchmarks. Deterministic for (config, flags, seed)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from draft_circuit.circuit.layers.checkpoint import CONFIG_NAME, INDEX_NAME, _layer_shapes
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG, TARGET_PARAM_SHAPES, MtpConfig
from draft_circuit.circuit.layers.moe import SCALE, MoeConfig, quantize_blocks

__all__ = ["write_random_checkpoint", "write_shards"]


def _checkpoint_shapes(config: MtpConfig, mtp_at_layer0: bool, include_target: bool,
                       mtp_shares_embed: bool, mtp_shares_head: bool) -> dict[str, tuple[int, ...]]:
    embed = {"model.embed_tokens.weight": (config.vocab_size, config.hidden_size)}
    shapes = dict(TARGET_PARAM_SHAPES(config)) if include_target else {}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    mtp = _layer_shapes(config)
    if mtp_shares_embed:
        del mtp["embed_tokens.weight"]
        shapes = {**embed, **shapes}
    if mtp_shares_head:
        del mtp["shared_head.head.weight"]
        if not config.tie_word_embeddings:
            shapes.setdefault("lm_head.weight", (config.vocab_size, config.hidden_size))
    first = 0 if mtp_at_layer0 else config.num_hidden_layers
    for i in range(config.num_nextn_predict_layers):
        shapes.update({f"model.layers.{first + i}.{name}": s for name, s in mtp.items()})
    return shapes


def _random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    t = torch.randn(shape, generator=gen)
    if name.removesuffix(".weight").endswith("norm"):
        return 1.0 + 0.1 * t  # RMSNorm gains near 1
    if name.endswith("embed_tokens.weight"):
        return t
    return t / math.sqrt(shape[-1])  # fan-in scaling keeps activations O(1)


def write_shards(root: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """`tensors` into model.safetensors, or into `shards` files with their index json (the
    DeepSeek-V3 writer, circuit/layers/deepseek_checkpoint.py, writes its files with it too)."""
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.fspath(root / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s * len(names) // shards:(s + 1) * len(names) // shards]
        save_file({k: tensors[k] for k in part}, os.fspath(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")


def write_random_checkpoint(
    path: str | os.PathLike[str], config: MtpConfig = DEFAULT_CONFIG, *, seed: int = 0, mtp_at_layer0: bool = False,
    include_target: bool = True, dtype: torch.dtype = torch.float32, shards: int = 1,
    mtp_shares_embed: bool = False, mtp_shares_head: bool = False, fp8_experts: bool = False,
) -> Path:
    """Write config.json and random safetensors in the layout `load_*_weights` read; returns the directory.

    Deterministic for (config, flags, seed). The MTP layer sits at `num_hidden_layers`, or at 0
    with `mtp_at_layer0` (an exported draft; needs include_target=False). `mtp_shares_embed` /
    `mtp_shares_head` leave the layer's own embed_tokens / shared_head.head out so the loader's
    fallbacks are used. shards > 1 splits the tensors across files listed by an index json.
    A `MoeConfig` gives the MTP layer the MoE layout (router, its fp32 bias, per-expert and shared
    experts, DeepSeek-V3 names); `fp8_experts` stores the expert weights fp8 e4m3 with
    `weight_scale_inv` 128x128 block scales.
    """
    if fp8_experts and not isinstance(config, MoeConfig):
        raise ValueError("write_random_checkpoint: fp8_experts=True needs a MoeConfig")
    if mtp_at_layer0 and include_target:
        raise ValueError("write_random_checkpoint: mtp_at_layer0=True needs include_target=False "
                         "(the MTP layer would overwrite the target's layer 0)")
    shapes = _checkpoint_shapes(config, mtp_at_layer0, include_target, mtp_shares_embed, mtp_shares_head)
    if not 1 <= shards <= len(shapes):
        raise ValueError(f"write_random_checkpoint: shards={shards} must be in [1, {len(shapes)}] (the tensor count)")
    root = Path(path)
    if (root / CONFIG_NAME).exists() or (root.is_dir() and any(root.glob("*.safetensors"))):
        raise FileExistsError(f"{root} already holds a checkpoint; refusing to mix files into it")
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {name: _random_tensor(name, shape, gen).to(torch.float32 if name.endswith("correction_bias")
                                                         else dtype) for name, shape in shapes.items()}
    for name in [n for n in tensors if fp8_experts and ("mlp.experts." in n or "mlp.shared_experts." in n)]:
        tensors[name], tensors[name + SCALE] = quantize_blocks(tensors[name])
    (root / CONFIG_NAME).write_text(json.dumps(config.to_hf(), indent=2) + "\n")
    write_shards(root, tensors, shards)
    return root
