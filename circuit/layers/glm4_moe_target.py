"""GLM-4.5's target layers as stored by `Glm4MoeForCausalLM` (transformers' names, experts one by
one): `model.embed_tokens`, `model.layers.{l}` (Glm4MoeAttention: q/k/v biases iff
`attention_bias`, `q_norm` / `k_norm` iff `use_qk_norm`; a dense Glm4MoeMLP below
`first_k_dense_replace`, Glm4MoeMoE from it: `mlp.gate` with its `e_score_correction_bias`,
`mlp.experts.{e}.*`, `mlp.shared_experts.*`), `model.norm`, `lm_head` (the embedding when tied).
`load_target_weights` sends a `glm4_moe` checkpoint here; the engine's target over these weights
is examples/engine/glm_target.py.

Refused by name as for the other targets: a missing tensor, a tensor inside a module a target
layer runs that the layer does not implement (a dense MLP under a MoE layer or the reverse, an
o_proj bias), a non-float or non-finite weight; strict=True also refuses tensors outside the
target and its MTP layers. The router and its bias are read in fp32 (transformers keeps them fp32).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

import torch

from draft_circuit.circuit.layers.checkpoint import (_first_present, _inventory, _label, _raw_config,
                                                     _reject_extras, read_config, read_planned)
from draft_circuit.circuit.layers.config import ConfigError, _decoder_shapes, _is_int
from draft_circuit.circuit.layers.families import UnsupportedArchitectureError, family_label
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import MoeConfig, moe_checkpoint_shapes
from draft_circuit.circuit.layers.tensor_checks import refuse_unimplemented

__all__ = ["first_dense_layers", "glm4_moe_target_shapes", "load_glm4_moe_target_weights", "is_moe_layer",
           "moe_target_layers"]

MODEL_TYPE = "glm4_moe"


def first_dense_layers(d: Mapping[str, Any], source: str = "config") -> int:
    """`first_k_dense_replace` (Glm4MoeConfig's default 1): layers below it are dense."""
    k = d.get("first_k_dense_replace", 1)
    k = 1 if k is None else k
    layers = d.get("num_hidden_layers")
    too_many = isinstance(layers, int) and isinstance(k, int) and k > layers
    if not _is_int(k) or k < 0 or too_many:
        raise ConfigError(f"{source}: config field 'first_k_dense_replace' = {k!r}: must be an int in "
                          f"[0, num_hidden_layers = {layers}]")
    return int(k)


def glm4_moe_target_shapes(c: MoeConfig, first_dense: int) -> dict[str, tuple[int, ...]]:
    """The target's stored tensors: each layer's attention (with the family's bias / norm options),
    its dense MLP below `first_dense`, its MoE MLP (per-expert, as stored) from it."""
    h, v = c.hidden_size, c.vocab_size
    moe_mlp = {k: s for k, s in moe_checkpoint_shapes(c).items() if k.startswith("mlp.")}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        own = _decoder_shapes(c, p)
        if layer >= first_dense:
            own = {k: s for k, s in own.items() if not k.startswith(p + "mlp.")}
            own.update({p + k: s for k, s in moe_mlp.items()})
        shapes.update(own)
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def is_moe_layer(weights: Mapping[str, torch.Tensor], layer: int) -> bool:
    """A loaded target layer is a MoE layer iff its router was loaded."""
    return f"model.layers.{layer}.mlp.gate.weight" in weights


def moe_target_layers(weights: Mapping[str, torch.Tensor], num_layers: int) -> tuple[bool, ...]:
    """Which layers of loaded target weights are MoE (True) or dense (False)."""
    return tuple(is_moe_layer(weights, layer) for layer in range(num_layers))


def load_glm4_moe_target_weights(
    path: str | os.PathLike[str], config: MoeConfig | None = None, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", *, strict: bool = False,
) -> dict[str, torch.Tensor]:
    """The target's weights under their stored names (`glm4_moe_target_shapes`); `lm_head.weight`
    is the embedding when tied. The MTP layer at model.layers.{num_hidden_layers} is not read."""
    root = Path(path)
    d = _raw_config(root)
    file = os.fspath(root / "config.json")
    if d.get("model_type") != MODEL_TYPE:
        raise UnsupportedArchitectureError(f"{file}: {family_label(d)}: the MoE target layers the engine "
                                           "runs are GLM-4.5's (Glm4MoeForCausalLM)")
    read = config if config is not None else read_config(root)
    if not isinstance(read, MoeConfig) or isinstance(read, MlaConfig):
        raise UnsupportedArchitectureError(f"{file}: a GLM-4.5 target needs a MoE config, got {type(read).__name__}")
    c = read
    shapes = glm4_moe_target_shapes(c, first_dense_layers(d, file))
    inv = _inventory(root)
    plan = {n: _first_present(inv, f"target tensor {n!r}", [n])
            for n in shapes if not (n == "lm_head.weight" and c.tie_word_embeddings)}
    if c.tie_word_embeddings:
        plan["lm_head.weight"] = plan["model.embed_tokens.weight"]
    refuse_unimplemented(inv.where, plan.values(), [f"model.layers.{i}." for i in range(c.num_hidden_layers)],
                         _label(root))
    if strict:
        mtp = tuple(f"model.layers.{c.num_hidden_layers + i}." for i in range(c.num_nextn_predict_layers))
        _reject_extras(inv, sorted(k for k in inv.where if k not in shapes and not k.startswith(mtp)),
                       "outside the target and MTP layers")
    # transformers keeps the router and its correction bias fp32 (_keep_in_fp32_modules_strict)
    fp32 = {n: plan.pop(n) for n in list(plan) if n.endswith(("mlp.gate.weight", "e_score_correction_bias"))}
    return read_planned(inv, plan, fp32, {}, shapes, dtype, device, keep_fp8=False)
