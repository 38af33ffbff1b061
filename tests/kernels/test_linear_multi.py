"""linear_qkv / linear_concat (kernels.linear_multi) against kernels.linear on the same operands:
bitwise, since they share its tiles and K order (CPU interpreter, fp32 and fp16; K and N off the
block grid, K1 off the K tile); a cuda test in bf16 at the MTP shapes."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear import linear
from draft_circuit.kernels.linear_multi import linear_concat, linear_qkv
from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU


def _rand(shape, dtype, g, device="cpu"):
    return torch.randn(shape, generator=g).to(device=device, dtype=dtype)


def _check_qkv(n, k, rows, dtype, device="cpu"):
    g = torch.Generator().manual_seed(n * 31 + k)
    x = _rand((n, k), dtype, g, device)
    ws = [_rand((r, k), dtype, g, device) / k ** 0.5 for r in rows]
    outs = [torch.full((n, r), float("nan"), dtype=dtype, device=device) for r in rows]
    linear_qkv(x, ws, outs)
    for w, o in zip(ws, outs):
        want = torch.empty_like(o)
        linear(x, w, want)
        assert torch.equal(o, want)


def _check_concat(n, k1, k2, rows, dtype, device="cpu"):
    g = torch.Generator().manual_seed(n * 7 + k1 + k2)
    x1, x2 = _rand((n, k1), dtype, g, device), _rand((n, k2), dtype, g, device)
    w = _rand((rows, k1 + k2), dtype, g, device) / (k1 + k2) ** 0.5
    out = torch.full((n, rows), float("nan"), dtype=dtype, device=device)
    linear_concat(x1, x2, w, out)
    want = torch.empty_like(out)
    linear(torch.cat([x1, x2], dim=1), w, want)
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,rows", [(1, 200, (40, 8, 8)), (3, 77, (33, 16, 5)), (17, 64, (64, 32, 32))])
def test_linear_qkv_is_three_linears(dtype, n, k, rows):
    _check_qkv(n, k, rows, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k1,k2,rows", [(1, 100, 100, 40), (3, 130, 70, 33), (17, 64, 64, 8)])
def test_linear_concat_is_a_linear_over_the_concat(dtype, n, k1, k2, rows):
    _check_concat(n, k1, k2, rows, dtype)


def test_launchers_name_the_bad_operand():
    x, w = torch.zeros(2, 8), torch.zeros(4, 8)
    with pytest.raises(KernelInputError, match="weight1"):
        linear_qkv(x, [w, torch.zeros(4, 9), w], [torch.zeros(2, 4)] * 3)
    with pytest.raises(KernelInputError, match="x2"):
        linear_concat(x, torch.zeros(2, 8, dtype=torch.float16), torch.zeros(4, 16), torch.zeros(2, 4))


@cuda
@pytest.mark.parametrize("n", [1, 8, 64])
def test_mtp_shapes_bf16_cuda(n):
    _check_qkv(n, 2048, (2048, 512, 512), torch.bfloat16, "cuda")
    _check_concat(n, 2048, 2048, 2048, torch.bfloat16, "cuda")
