"""RoPE scaling as a config states it: `RopeScaling.from_hf(config.json)` reads `rope_parameters`
(transformers 5) or `rope_scaling` (older configs, DeepSeek-V3's hub config), type `default` or
`yarn`; any other type is refused by name. `inv_freq(dim)` is transformers' frequency table,
computed with the same torch ops in the same order (so fp32 bits agree); `attention_factor`
scales cos/sin; `softmax_scale(qk_head_dim)` is DeepSeek's MLA softmax scale with YaRN's mscale.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from draft_circuit.circuit.layers.config import ConfigError

__all__ = ["RopeScaling", "yarn_get_mscale", "SUPPORTED_ROPE_TYPES", "INV_FREQ"]

INV_FREQ = "rope.inv_freq"  # the param of a scaled RoPE's frequencies: f32 [rotated dims / 2]

SUPPORTED_ROPE_TYPES = ("default", "yarn")
_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
              "mscale_all_dim", "attention_factor", "truncate")
_NUMBER = (int, float)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """transformers' (and DeepSeek's) yarn_get_mscale: 0.1 * mscale * ln(scale) + 1, 1 at scale <= 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _params(d: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the field read, its object): rope_parameters wins; both given must agree on each key."""
    found = {f: d[f] for f in ("rope_parameters", "rope_scaling") if d.get(f) is not None}
    for f, v in found.items():
        if not isinstance(v, Mapping):
            raise ConfigError(f"config field {f!r} = {v!r}: expected an object or null")
    if not found:
        return "rope_parameters", {}
    if len(found) == 2:
        a, b = found["rope_parameters"], found["rope_scaling"]
        for key in set(a) & set(b):
            if a[key] != b[key]:
                raise ConfigError(f"config aliases disagree: rope_parameters.{key}={a[key]!r}, "
                                  f"rope_scaling.{key}={b[key]!r}; make them equal or drop one")
        return "rope_parameters", {**b, **a}
    (field, value), = found.items()
    return field, dict(value)


@dataclass(frozen=True)
class RopeScaling:
    """One model's RoPE: `rope_type` "default" (theta only) or "yarn" (DeepSeek-V3's)."""

    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor_override: float | None = None  # `attention_factor` when the config gives it
    truncate: bool = True

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, theta: float) -> RopeScaling:
        """`theta`: the rope_theta already read (and checked against its aliases) by MtpConfig."""
        field, p = _params(d)
        kind = p.get("rope_type", p.get("type", "default"))
        if "rope_type" in p and "type" in p and p["rope_type"] != p["type"]:
            raise ConfigError(f"config fields '{field}.rope_type' = {p['rope_type']!r} and "
                              f"'{field}.type' = {p['type']!r} disagree")
        if kind not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(f"config field '{field}.rope_type' = {kind!r}: implemented RoPE types "
                              f"are {', '.join(SUPPORTED_ROPE_TYPES)}")
        if kind == "default":
            return cls(theta=theta)
        for key in _YARN_KEYS:
            v = p.get(key)
            ok = v is None or (isinstance(v, bool) if key == "truncate" else
                               isinstance(v, _NUMBER) and not isinstance(v, bool) and math.isfinite(v))
            if not ok:
                raise ConfigError(f"config field '{field}.{key}' = {v!r}: expected a finite number")
        orig = p.get("original_max_position_embeddings") or d.get("max_position_embeddings")
        if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
            raise ConfigError(f"config field '{field}.original_max_position_embeddings' = {orig!r}: "
                              "yarn needs a positive int")
        factor = p.get("factor")
        if factor is None:  # transformers 5 refuses it as well (a required yarn key)
            raise ConfigError(f"config field '{field}.factor' is missing: yarn needs it")
        if not factor >= 1:
            raise ConfigError(f"config field '{field}.factor' = {factor!r}: yarn needs factor >= 1")
        return cls(rope_type="yarn", theta=theta, factor=float(factor),
                   original_max_position_embeddings=orig,
                   beta_fast=float(p.get("beta_fast") or 32), beta_slow=float(p.get("beta_slow") or 1),
                   mscale=p.get("mscale"), mscale_all_dim=p.get("mscale_all_dim"),
                   attention_factor_override=p.get("attention_factor"),
                   truncate=p.get("truncate", True) if p.get("truncate") is not None else True)

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by (transformers' `attention_scaling`)."""
        if self.rope_type == "default":
            return 1.0
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        if self.mscale and self.mscale_all_dim:
            return float(yarn_get_mscale(self.factor, self.mscale) / yarn_get_mscale(self.factor, self.mscale_all_dim))
        return yarn_get_mscale(self.factor)

    def softmax_scale(self, qk_head_dim: int) -> float:
        """DeepSeek's MLA softmax scale, as transformers' yarn_apply_mscale computes it (same float
        order): qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) twice when that is set."""
        scaling: float = qk_head_dim ** (-0.5)
        if self.rope_type != "default" and self.mscale_all_dim:
            m = yarn_get_mscale(self.factor, self.mscale_all_dim)
            scaling = scaling * m * m
        return scaling

    def inv_freq(self, dim: int) -> torch.Tensor:
        """fp32 [dim // 2]: transformers' compute_default / _compute_yarn_parameters, op for op."""
        if self.rope_type == "default":
            return 1.0 / (self.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
        base, factor = self.theta, self.factor

        def correction_dim(rotations: float) -> float:
            return (dim * math.log(self.original_max_position_embeddings / (rotations * 2 * math.pi))) \
                / (2 * math.log(base))

        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001  # transformers: prevent a singular ramp
        pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation_factor = 1 - ramp
        return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor

    def to_hf(self) -> dict[str, Any]:
        """The `rope_parameters` object transformers 5 writes."""
        if self.rope_type == "default":
            return {"rope_type": "default", "rope_theta": self.theta}
        out: dict[str, Any] = {"rope_type": "yarn", "rope_theta": self.theta, "factor": self.factor,
                               "original_max_position_embeddings": self.original_max_position_embeddings,
                               "beta_fast": self.beta_fast, "beta_slow": self.beta_slow}
        for key, v in (("mscale", self.mscale), ("mscale_all_dim", self.mscale_all_dim),
                       ("attention_factor", self.attention_factor_override)):
            if v is not None:
                out[key] = v
        if not self.truncate:
            out["truncate"] = False
        return out


def deinterleaved(dim: int) -> torch.Tensor:
    """The row order [0, 2, 4, .., 1, 3, 5, ..] of a `dim`-wide rope part: DeepSeek's interleaved
    RoPE (`rope_interleave`, pairs (x0, x1), (x2, x3), ..) is rotate-half RoPE on the rows in this
    order, which is also the order transformers' apply_rotary_pos_emb_interleave returns. Weights
    whose outputs feed the rope part are permuted once at bind time, so one rope op serves both."""
    return torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2)])
