"""FP8 block-scaled dense projections in a layer: a weight kept as stored (fp8 e4m3 with its
128x128 `weight_scale_inv`, or quantised per block when given real numbers) becomes an fp8 param
and a per-row scale param `<name>_row_scale_inv` [N, ceil(K / 128)], so bind may split and permute
its rows; `emit_linear` emits `linear_fp8` for an fp8 param and `linear` otherwise.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.layers.moe import SCALE, _real, quantize_blocks
from draft_circuit.ops.moe import FP8, SCALE_BLOCK

__all__ = ["ROW_SCALE", "emit_linear", "fp8_rows", "take_rows", "row_scale_shape"]

ROW_SCALE = "_row_scale_inv"


def row_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return shape[0], math.ceil(shape[1] / SCALE_BLOCK)


def fp8_rows(weights: Mapping[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight [N, K], f32 row scales [N, ceil(K / 128)]) of a checkpoint weight: as stored
    when it is fp8 beside its block scales, else its real values quantised per 128x128 block."""
    w, scale = weights[name], weights.get(name + SCALE)
    if w.dtype != torch.float8_e4m3fn or scale is None:
        w, scale = quantize_blocks(_real(weights, name))
    return w, scale.float().repeat_interleave(SCALE_BLOCK, dim=0)[: w.shape[0]].contiguous()


def take_rows(w: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """w[index] for any dtype (fp8 rows are moved as bytes)."""
    if w.dtype == torch.float8_e4m3fn:
        return w.view(torch.uint8)[index].view(torch.float8_e4m3fn).contiguous()
    return w[index].contiguous()


def emit_linear(b: CircuitBuilder, x: str, weight: str, name: str, attrs: dict[str, Any] | None = None) -> str:
    """x @ weight^T through the op the param's dtype asks for."""
    if b.spec(weight).dtype == FP8:
        return b.op1("linear_fp8", [x, weight, weight + ROW_SCALE], name=name)
    return b.op1("linear", [x, weight], attrs, name=name)
