"""silu_mul kernel against a straightforward torch reference (fp32 maths, one rounding).

CPU: fp32 and fp16 under the Triton interpreter. cuda: bf16 and width independence.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.silu_mul import silu_mul

from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def reference_silu_mul(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    inter = x.shape[1] // 2
    a, b = x[:, :inter].float(), x[:, inter:].float()
    return (a * torch.sigmoid(a) * b).to(out_dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,inter", [(1, 72), (3, 200), (5, 1100)])  # 1100 spans two column blocks
def test_silu_mul_matches_reference(dtype, n, inter):
    gen = torch.Generator().manual_seed(n * 7 + inter)
    x = (3 * torch.randn(n, 2 * inter, generator=gen)).to(dtype)
    out = torch.full((n, inter), float("nan"), dtype=dtype)
    silu_mul(x, out)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_silu_mul(x, dtype), **TOL[dtype])


def test_silu_mul_strided_rows_and_fp32_out():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 300, generator=gen).half()[:, :144]  # rows of a wider buffer
    out_base = torch.full((3, 80), float("nan"))
    out = out_base[:, 4:76]
    silu_mul(x, out)
    torch.testing.assert_close(out, reference_silu_mul(x, torch.float32), **TOL[torch.float32])
    assert out_base[:, :4].isnan().all() and out_base[:, 76:].isnan().all()


def test_rejects_bad_inputs():
    with pytest.raises(KernelInputError, match="x"):
        silu_mul(torch.randn(3, 71), torch.empty(3, 35))
    with pytest.raises(KernelInputError, match="out"):
        silu_mul(torch.randn(3, 72), torch.empty(3, 72))
    with pytest.raises(KernelInputError, match="out"):
        silu_mul(torch.randn(3, 72), torch.empty(3, 36, dtype=torch.int32))


@cuda
@pytest.mark.parametrize("inter", [200, 14336])
def test_cuda_bf16_matches_fp32_reference(inter):
    gen = torch.Generator(device="cuda").manual_seed(inter)
    x = (3 * torch.randn(37, 2 * inter, device="cuda", generator=gen)).bfloat16()
    out = torch.full((37, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    silu_mul(x, out)
    torch.testing.assert_close(out.float(), reference_silu_mul(x.float(), torch.float32),
                               **TOL[torch.bfloat16])


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_width_independence(dtype):
    inter = 2000
    gen = torch.Generator(device="cuda").manual_seed(0)
    row0 = torch.randn(1, 2 * inter, device="cuda", generator=gen).to(dtype)
    alone = torch.full((1, inter), float("nan"), device="cuda", dtype=dtype)
    silu_mul(row0, alone)
    for n in range(2, 65):
        x = torch.randn(n, 2 * inter, device="cuda", generator=gen).to(dtype)
        x[0] = row0[0]
        out = torch.full((n, inter), float("nan"), device="cuda", dtype=dtype)
        silu_mul(x, out)
        assert torch.equal(out[0], alone[0]), n
