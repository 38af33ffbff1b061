"""Plain-torch formulas the independent reference chains share (the MTP chain's in
tests/ops/test_mtp_chain.py, EAGLE-3's in tests/layers/eagle3_reference.py): RMSNorm and
rotate-half RoPE over whole heads, written from their definitions, with no registry op."""
from __future__ import annotations

import torch


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: int, d: int, theta: float) -> torch.Tensor:
    """x's heads of `d` dims ([-1, d]) rotated to position `pos` (rotate-half, base `theta`)."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos * inv
    x = x.view(-1, d)
    x1, x2 = x[:, : d // 2], x[:, d // 2:]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)
