"""linear / linear_silu_mul kernels against straightforward fp32-accumulating torch references.

CPU: fp32 and fp16 under the Triton interpreter, K and N off the block grid. cuda: bf16, larger
shapes, and width independence (a row's bits do not depend on n).
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear import linear, linear_silu_mul

from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU

# Accumulation order differs from torch's, so fp32 is compared relative to the size of the sums.
TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}


def reference_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (x.double() @ weight.double().T).to(out_dtype)


def reference_linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    inter = gate_up.shape[0] // 2
    gate = (x.double() @ gate_up[:inter].double().T).float()
    up = (x.double() @ gate_up[inter:].double().T).float()
    return (gate * torch.sigmoid(gate) * up).to(out_dtype)


def _inputs(n, k, rows, dtype, seed, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(rows, k, device=device, generator=gen) / k ** 0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,big_n", [(1, 200, 333), (3, 77, 40), (5, 130, 333), (17, 64, 33)])
def test_linear_matches_reference(dtype, n, k, big_n):
    x, w = _inputs(n, k, big_n, dtype, seed=n + k + big_n)
    out = torch.full((n, big_n), float("nan"), dtype=dtype)
    linear(x, w, out)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_linear(x, w, dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,inter", [(1, 200, 72), (5, 130, 45), (17, 48, 40)])
def test_linear_silu_mul_matches_reference(dtype, n, k, inter):
    x, gate_up = _inputs(n, k, 2 * inter, dtype, seed=n * k + inter)
    out = torch.full((n, inter), float("nan"), dtype=dtype)
    linear_silu_mul(x, gate_up, out)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_linear_silu_mul(x, gate_up, dtype), **TOL[dtype])


def test_strided_rows_and_fp32_out():
    x_base, w = _inputs(5, 300, 72, torch.float16, seed=5)
    x = x_base[:, 20:220]
    w = w[:, :200]  # weight rows with stride 300
    out_base = torch.full((5, 80), float("nan"))
    out = out_base[:, 3:75]
    linear(x, w, out)
    torch.testing.assert_close(out, reference_linear(x, w, torch.float32), atol=1e-4, rtol=1e-4)
    assert out_base[:, :3].isnan().all() and out_base[:, 75:].isnan().all()


@pytest.mark.parametrize("fn", [linear, linear_silu_mul])
def test_width_independence_interpreted(fn):
    x, w = _inputs(19, 130, 66, torch.float32, seed=1)
    batch = torch.full((19, 66 if fn is linear else 33), float("nan"))
    alone = torch.full((1, batch.shape[1]), float("nan"))
    fn(x, w, batch)
    fn(x[:1], w, alone)
    assert torch.equal(batch[0], alone[0])


def test_rejects_bad_inputs():
    x = torch.randn(3, 64)
    with pytest.raises(KernelInputError, match="weight"):
        linear(x, torch.randn(10, 63), torch.empty(3, 10))
    with pytest.raises(KernelInputError, match="weight"):
        linear(x, torch.randn(10, 64).half(), torch.empty(3, 10))
    with pytest.raises(KernelInputError, match="out"):
        linear(x, torch.randn(10, 64), torch.empty(3, 11))
    with pytest.raises(KernelInputError, match="gate_up_weight"):
        linear_silu_mul(x, torch.randn(11, 64), torch.empty(3, 5))
    with pytest.raises(KernelInputError, match="out"):
        linear_silu_mul(x, torch.randn(10, 64), torch.empty(3, 10))


@cuda
@pytest.mark.parametrize("n,k,big_n", [(1, 4096, 4096), (7, 2048, 1000), (64, 4096, 32000), (45, 200, 333)])
def test_cuda_bf16_linear_matches_fp32_reference(n, k, big_n):
    x, w = _inputs(n, k, big_n, torch.bfloat16, seed=n, device="cuda")
    out = torch.full((n, big_n), float("nan"), device="cuda", dtype=torch.bfloat16)
    linear(x, w, out)
    torch.testing.assert_close(out.float(), reference_linear(x, w, torch.float32), **TOL[torch.bfloat16])


@cuda
@pytest.mark.parametrize("n,k,inter", [(1, 4096, 14336), (9, 2048, 1000), (64, 200, 72)])
def test_cuda_bf16_linear_silu_mul_matches_fp32_reference(n, k, inter):
    x, gate_up = _inputs(n, k, 2 * inter, torch.bfloat16, seed=n, device="cuda")
    out = torch.full((n, inter), float("nan"), device="cuda", dtype=torch.bfloat16)
    linear_silu_mul(x, gate_up, out)
    torch.testing.assert_close(out.float(), reference_linear_silu_mul(x, gate_up, torch.float32),
                               **TOL[torch.bfloat16])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_fp32_fp16_match_reference(dtype):
    x, w = _inputs(33, 1000, 333, dtype, seed=2, device="cuda")
    out = torch.full((33, 333), float("nan"), device="cuda", dtype=dtype)
    linear(x, w, out)
    torch.testing.assert_close(out, reference_linear(x, w, dtype), **TOL[dtype])


@cuda
@pytest.mark.parametrize("fn", [linear, linear_silu_mul])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_width_independence(fn, dtype):
    k, rows = 2048, 2 * 1000
    out_cols = rows if fn is linear else rows // 2
    x0, w = _inputs(1, k, rows, dtype, seed=0, device="cuda")
    alone = torch.full((1, out_cols), float("nan"), device="cuda", dtype=dtype)
    fn(x0, w, alone)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n in range(2, 65):
        x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
        x[0] = x0[0]
        out = torch.full((n, out_cols), float("nan"), device="cuda", dtype=dtype)
        fn(x, w, out)
        assert torch.equal(out[0], alone[0]), n
