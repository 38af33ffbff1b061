"""What a family's config.json sets in `MtpConfig`'s attention options (`qkv_bias`, `qk_norm`,
`partial_rotary_factor`), read as transformers' config and attention classes read them. Each reader
takes the raw config.json and returns the options; a field of the wrong type is a `ConfigError`
naming it. The family table (families.py) names one reader per family.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

from draft_circuit.circuit.layers.config import ConfigError

__all__ = ["OptionReader", "no_options", "qwen2_options", "qwen3_options", "glm4_moe_options",
           "qwen3_next_options"]

OptionReader = Callable[[Mapping[str, Any]], dict[str, Any]]
_ABSENT = object()


def no_options(d: Mapping[str, Any]) -> dict[str, Any]:
    """Llama's attention: no bias (rules refuse `attention_bias`), no q/k norm, the whole head rotates."""
    return {}


def qwen2_options(d: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen2Attention hard-codes `bias=True` on q/k/v (no config field); o_proj has none."""
    return {"qkv_bias": True}


def qwen3_options(d: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3Attention always norms q and k per head before RoPE (`q_norm`, `k_norm`)."""
    return {"qk_norm": True}


def glm4_moe_options(d: Mapping[str, Any]) -> dict[str, Any]:
    """Glm4MoeAttention: q/k/v biases iff `attention_bias`, per-head q/k norms iff `use_qk_norm`,
    RoPE over int(head_dim * partial_rotary_factor) dims; the factor sits in `rope_parameters`
    since transformers 5 and top-level in older config.json files, absent: 0.5 (the class's)."""
    if all(d.get(k) is None for k in ("n_routed_experts", "num_local_experts")):
        raise ConfigError("config field 'n_routed_experts' is absent: Glm4MoeConfig would build 128 "
                          "experts by default; give the count explicitly")
    layers, dense = d.get("num_hidden_layers"), d.get("first_k_dense_replace", 1)
    if isinstance(layers, int) and isinstance(dense, int) and dense > layers:
        # Glm4MoeDecoderLayer: MoE iff layer_idx >= first_k_dense_replace; the MTP layer is index L
        raise ConfigError(f"config field 'first_k_dense_replace' = {dense} > 'num_hidden_layers' = "
                          f"{layers}: the MTP layer would be dense; the GLM-4.5 MTP head is a MoE layer")
    return {"qkv_bias": _flag(d, "attention_bias"), "qk_norm": _flag(d, "use_qk_norm"),
            "partial_rotary_factor": _rotary_factor(d, default=0.5)}


def qwen3_next_options(d: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3NextAttention always norms q and k per head (`q_norm`, `k_norm`); RoPE over
    int(head_dim * partial_rotary_factor) dims, the factor in `rope_parameters` (transformers 5)
    or top-level (the released config.json), absent: 0.25 (Qwen3NextConfig's)."""
    return {"qk_norm": True, "partial_rotary_factor": _rotary_factor(d, default=0.25)}


def _flag(d: Mapping[str, Any], field: str) -> bool:
    v = d.get(field)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise ConfigError(f"config field {field!r} = {v!r}: must be a bool")
    return v


def _rotary_factor(d: Mapping[str, Any], default: float) -> float:
    params = d.get("rope_parameters")
    nested = params.get("partial_rotary_factor", _ABSENT) if isinstance(params, Mapping) else _ABSENT
    found = {name: v for name, v in (("rope_parameters.partial_rotary_factor", nested),
                                     ("partial_rotary_factor", d.get("partial_rotary_factor", _ABSENT)))
             if v is not _ABSENT and v is not None}
    for name, v in found.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ConfigError(f"config field {name!r} = {v!r}: must be a number in (0, 1]")
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{k}={v!r}" for k, v in found.items())
        raise ConfigError(f"config aliases disagree: {listed}; make them equal or drop one")
    return float(next(iter(found.values()), default))  # type: ignore[arg-type]  # checked numeric above
