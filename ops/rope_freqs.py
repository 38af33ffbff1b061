"""`rope_freqs`: rotate-half RoPE whose frequencies are a param (`inv_freq` f32[head_dim / 2],
computed once from the config: default RoPE or YaRN, circuit.layers.rope) and whose cos and sin
are scaled by `attention_factor` (YaRN's mscale). The reference is transformers' arithmetic:
angle = float(position + pos_offset) * inv_freq, cos * factor, then x1 cos - x2 sin, x2 cos + x1 sin.
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.bindings import TRITON, Applies, KernelBinding, Tensors, kernel
from draft_circuit.ops.registry import ATTENTION, OpDef, check, dim_eq, index_dtype, rank, register


class RopeFreqsAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    head_dim: int
    attention_factor: float = 1.0
    pos_offset: int = 0

    def model_post_init(self, _: object) -> None:  # else the reference fails at run time
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and > 0, got {self.head_dim}")
        if not 0 < self.attention_factor < float("inf"):
            raise ValueError(f"attention_factor must be finite and > 0, got {self.attention_factor}")


def rope_freqs_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, head_dim: int,
                   attention_factor: float = 1.0, pos_offset: int = 0) -> torch.Tensor:
    """x [n, heads * head_dim] -> the same shape; fp32 arithmetic, rounded once to x's dtype."""
    n = x.shape[0]
    angle = (positions.long() + pos_offset).float().unsqueeze(-1) * inv_freq.float()  # [n, D/2]
    cos = (angle.cos() * attention_factor).unsqueeze(1)  # [n, 1, D/2]
    sin = (angle.sin() * attention_factor).unsqueeze(1)
    xf = x.float().view(n, -1, head_dim)
    x1, x2 = xf[..., : head_dim // 2], xf[..., head_dim // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).view(n, -1).to(x.dtype)


def _infer(ins: list[TensorSpec], a: RopeFreqsAttrs) -> list[TensorSpec]:
    x, pos, freqs = ins
    rank(x, 2, "rope_freqs input [n, heads * head_dim]")
    rank(pos, 1, "positions")
    index_dtype(pos, "positions")
    dim_eq(pos.shape[0], x.shape[0], "rope_freqs rows")
    check(isinstance(x.shape[1], int) and x.shape[1] % a.head_dim == 0,
          lambda: f"rope_freqs head_dim {a.head_dim} must divide {x}")
    check(freqs.dtype == "float32" and freqs.shape == (a.head_dim // 2,),
          lambda: f"inv_freq must be float32[{a.head_dim // 2}], got {freqs}")
    return [x]


_k_rope = kernel("rope_freqs", "rope_freqs")


def _launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    _k_rope()(ins[0], ins[1], ins[2], outs[0], head_dim=a.head_dim,
              attention_factor=a.attention_factor, pos_offset=a.pos_offset)


register(OpDef(
    name="rope_freqs", inputs=("x", "positions", "inv_freq"), outputs=("out",), attrs=RopeFreqsAttrs,
    infer=_infer, tags=frozenset({ATTENTION}),
    reference=lambda t, a: (rope_freqs_ref(t[0], t[1], t[2], a.head_dim, a.attention_factor, a.pos_offset),),
    kernels=(KernelBinding("triton_rope_freqs", _launch, Applies(TRITON)),),
))
