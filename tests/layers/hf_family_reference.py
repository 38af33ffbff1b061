"""Test helpers for the checkpoint families against transformers: a genuine checkpoint
(`XxxForCausalLM(config).save_pretrained`, plus an MTP layer in the DeepSeek-V3 names) with every
tensor re-drawn at random (HF initialises biases to 0 and norms to 1, which would hide them), and
the MTP draft chain computed with transformers' own decoder layer class for the family.

The HF chain: step j embeds the last token, `eh_proj(cat[enorm(emb), hnorm(h)])` (composed with
the family's RMSNorm class, as DeepSeek-V3's MTP forward does), runs `DecoderLayer` at position
`pos + j` over a `DynamicCache` holding the prefix, and drafts argmax(`shared_head.head`(
`shared_head.norm`(out))); `out` is the hidden handed to the next step.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.layers.test_hf_checkpoints import L, SMALL, hf_checkpoint

import transformers  # noqa: E402  (the callers importorskip it first)


def randomize(root: Path, seed: int = 0) -> None:
    """Every stored tensor re-drawn: norms 1 + 0.1 N, biases 0.1 N, embeddings N, weights N/sqrt(fan_in)."""
    file = root / "model.safetensors"
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(os.fspath(file))
    for name, t in sorted(tensors.items()):
        r = torch.randn(t.shape, generator=g)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            r = 1 + 0.1 * r
        elif name.endswith(".bias") or name.endswith("e_score_correction_bias"):
            r = 0.1 * r
        elif "embed_tokens" not in name:
            r = r / math.sqrt(t.shape[-1])
        tensors[name] = r.to(t.dtype)
    save_file(tensors, os.fspath(file), metadata={"format": "pt"})


def family_checkpoint(root: Path, family: str, seed: int = 0, **fields) -> Path:
    """transformers' own checkpoint of `family` with a DeepSeek-named MTP layer at model.layers.{L}
    (a copy of the last layer's tensor names), every tensor random."""
    hf_checkpoint(root, family, **fields)
    randomize(root, seed)
    return root


def hf_config(root: Path):
    config = transformers.AutoConfig.from_pretrained(root)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"  # the per-expert loop (what a standalone layer runs)
    return config


@dataclass
class HfChain:
    drafts: list[int]
    confidences: list[float]
    hidden: torch.Tensor      # [H]: the hidden after the last step (handed to the next)
    keys: torch.Tensor        # [rows, kv_heads, head_dim]: every cached key (prefix, then drafts)
    values: torch.Tensor


def hf_draft_chain(root: Path, weights: dict[str, torch.Tensor], prefix: torch.Tensor, token: int,
                   hidden: torch.Tensor, num_drafts: int) -> HfChain:
    """prefix [T, H]: decoder-layer inputs already in the cache (positions 0..T-1); the chain then
    drafts from `token` and the target's `hidden` at position T."""
    config = hf_config(root)
    module = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__module__
    modeling = __import__(module, fromlist=["_"])
    stem = type(config).__name__.removesuffix("Config")
    layer_idx = L - 1  # the last target layer's kind (transformers has no class for index L)
    layer = getattr(modeling, f"{stem}DecoderLayer")(config, layer_idx=layer_idx).eval()
    state = {k: weights[k] for k in layer.state_dict()} if not hasattr(layer.mlp, "experts") else \
        moe_state(layer, weights)
    layer.load_state_dict(state, strict=True)
    rotary = getattr(modeling, f"{stem}RotaryEmbedding")(config)
    norm = lambda x, name: rms(x, weights[name], config.rms_norm_eps)  # noqa: E731
    cache = transformers.DynamicCache(config=config)

    def run(x: torch.Tensor, pos: int) -> torch.Tensor:
        x = x.view(1, 1, -1)
        ids = torch.tensor([[pos]])
        with torch.no_grad():
            return layer(x, attention_mask=None, position_ids=ids, cache=cache, use_cache=True,
                         position_embeddings=rotary(x, ids)).view(-1)

    for t in range(prefix.shape[0]):
        run(prefix[t], t)
    drafts, confs = [], []
    for j in range(num_drafts):
        e = weights["embed_tokens.weight"][token]
        x = F.linear(torch.cat([norm(e, "enorm.weight"), norm(hidden, "hnorm.weight")]), weights["eh_proj.weight"])
        hidden = run(x, prefix.shape[0] + j)
        logits = F.linear(norm(hidden, "shared_head.norm.weight"), weights["shared_head.head.weight"])
        token = int(logits.argmax())
        drafts.append(token)
        confs.append(float(logits.log_softmax(-1)[token]))
    kv = cache.layers[layer_idx]
    return HfChain(drafts, confs, hidden, kv.keys[0].transpose(0, 1), kv.values[0].transpose(0, 1))


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm / Qwen2RMSNorm / Glm4MoeRMSNorm's arithmetic (the DeepSeek MTP norms)."""
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def moe_state(layer: torch.nn.Module, w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> transformers 5's fused expert parameters."""
    state = {}
    for k in layer.state_dict():
        if k == "mlp.experts.gate_up_proj":
            state[k] = torch.stack([torch.cat([w[f"mlp.experts.{e}.gate_proj.weight"], w[f"mlp.experts.{e}.up_proj.weight"]])
                                    for e in range(layer.mlp.experts.num_experts)])
        elif k == "mlp.experts.down_proj":
            state[k] = torch.stack([w[f"mlp.experts.{e}.down_proj.weight"] for e in range(layer.mlp.experts.num_experts)])
        else:
            state[k] = w[k]
    return state


def set_config(root: Path, **fields) -> None:
    d = json.loads((root / "config.json").read_text())
    d.update(fields)
    (root / "config.json").write_text(json.dumps(d))


__all__ = ["SMALL", "L", "family_checkpoint", "hf_draft_chain", "HfChain", "randomize", "set_config"]
