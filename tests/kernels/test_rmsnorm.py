"""rmsnorm / add_rmsnorm kernels against a straightforward HF-order torch reference; the zero-centred
rmsnorm (Qwen3-Next) against transformers' Qwen3NextRMSNorm arithmetic, directly and through the
zero_centred_rmsnorm / zero_centred_head_rmsnorm op bindings.

CPU: fp32 and fp16 under the Triton interpreter. cuda: bf16 and width independence.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.rmsnorm import add_rmsnorm, rmsnorm, zero_centred_rmsnorm
from draft_circuit.ops.registry import get_op

from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def reference_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def reference_zero_centred(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3NextRMSNorm.forward: fp32 norm times 1.0 + weight.float(), one rounding to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def _poisoned(like: torch.Tensor) -> torch.Tensor:
    return torch.full_like(like, float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,hidden", [(1, 72), (3, 200), (5, 64)])
def test_rmsnorm_matches_reference(dtype, n, hidden):
    gen = torch.Generator().manual_seed(n * 1000 + hidden)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    out = _poisoned(x)
    rmsnorm(x, weight, out, 1e-6)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_rmsnorm(x, weight, 1e-6), **TOL[dtype])


def test_rmsnorm_strided_rows():
    # Rows of a wider buffer: only the innermost dimension needs to be contiguous.
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(3, 100, generator=gen)
    x = base[:, :72]
    weight = torch.randn(72, generator=gen)
    out_base = torch.full((3, 90), float("nan"))
    out = out_base[:, 5:77]
    rmsnorm(x, weight, out, 1e-5)
    torch.testing.assert_close(out, reference_rmsnorm(x, weight, 1e-5), **TOL[torch.float32])
    assert out_base[:, :5].isnan().all() and out_base[:, 77:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("alias", [None, "x", "residual"])
def test_add_rmsnorm_matches_reference(dtype, alias):
    n, hidden = 5, 200
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(n, hidden, generator=gen).to(dtype)
    residual = torch.randn(n, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    expect_sum = x + residual
    expect_norm = reference_rmsnorm(expect_sum, weight, 1e-6)
    sum_out = {"x": x, "residual": residual, None: _poisoned(x)}[alias]
    norm_out = _poisoned(x)
    add_rmsnorm(x, residual, weight, sum_out, norm_out, 1e-6)
    assert torch.equal(sum_out, expect_sum)  # one rounding in x's dtype, as torch
    assert not norm_out.isnan().any()
    torch.testing.assert_close(norm_out, expect_norm, **TOL[dtype])


def test_rejects_bad_inputs():
    x = torch.randn(3, 72)
    with pytest.raises(KernelInputError, match="weight"):
        rmsnorm(x, torch.randn(70), torch.empty_like(x), 1e-6)
    with pytest.raises(KernelInputError, match="out"):
        rmsnorm(x, torch.randn(72), torch.empty(3, 72, dtype=torch.float16), 1e-6)
    with pytest.raises(KernelInputError, match="x"):
        rmsnorm(torch.randn(72, 3).t(), torch.randn(72), torch.empty(3, 72), 1e-6)
    with pytest.raises(KernelInputError, match="residual"):
        add_rmsnorm(x, torch.randn(3, 71), torch.randn(72), torch.empty_like(x), torch.empty_like(x), 1e-6)


# one rounding in fp16 (half an ulp, 2^-11 relative) plus fp32 sums in another order
ZC_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,hidden", [(1, 72), (3, 200), (5, 64)])
def test_zero_centred_rmsnorm_matches_qwen3_next_order(dtype, n, hidden):
    gen = torch.Generator().manual_seed(n * 1000 + hidden)
    x = (3 * torch.randn(n, hidden, generator=gen)).to(dtype)
    weight = (0.1 * torch.randn(hidden, generator=gen)).to(dtype)  # stored: the gain is 1 + weight
    out = _poisoned(x)
    zero_centred_rmsnorm(x, weight, out, 1e-6)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_zero_centred(x, weight, 1e-6), **ZC_TOL[dtype])
    in_place = x.clone()  # the op's inplace={0: 0}: out may alias x
    zero_centred_rmsnorm(in_place, weight, in_place, 1e-6)
    assert torch.equal(in_place, out)


@pytest.mark.parametrize("op_name, width", [("zero_centred_rmsnorm", 72), ("zero_centred_head_rmsnorm", 3 * 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_zero_centred_bindings_match_their_references(op_name, width, dtype):
    """The op bindings (head: each head_dim group of a row normalised alone) against the op
    references, which the eager chain runs."""
    op = get_op(op_name)
    (binding,) = op.kernels
    assert binding.name == f"triton_{op_name}"
    g = torch.Generator().manual_seed(0)
    d = 24 if "head" in op_name else width
    x = (3 * torch.randn(5, width, generator=g)).to(dtype)
    w = (0.1 * torch.randn(d, generator=g)).to(dtype)
    attrs = op.parse_attrs({"eps": 1e-6})
    out = _poisoned(x)
    binding.launch([x, w], [out], [], attrs)
    (want,) = op.reference([x, w], attrs)
    torch.testing.assert_close(out, want, **ZC_TOL[dtype])
    heads = x.view(-1, d)  # per head: the norm of that head alone, times 1 + weight
    torch.testing.assert_close(out.view(-1, d), reference_zero_centred(heads, w, 1e-6), **ZC_TOL[dtype])


@cuda
@pytest.mark.parametrize("hidden", [64, 256, 2048])
def test_cuda_bf16_zero_centred_rounds_once(hidden):
    """bf16 rows, bf16 stored weight: within one rounding of the fp32 product (2^-8 relative),
    where a gain 1 + weight stored in bf16 would already be off by up to 2^-8 before the norm;
    bitwise width-independent; the head binding equals the kernel on per-head views."""
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x = (3 * torch.randn(37, hidden, device="cuda", generator=gen)).bfloat16()
    weight = (0.1 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    out = _poisoned(x)
    zero_centred_rmsnorm(x, weight, out, 1e-6)
    exact = reference_zero_centred(x.float(), weight.float(), 1e-6)
    torch.testing.assert_close(out.float(), exact, atol=1e-6, rtol=2 ** -8)
    for n in (1, 2, 5, 64):
        rows = torch.randn(n, hidden, device="cuda", generator=gen).bfloat16()
        rows[0] = x[0]
        got = _poisoned(rows)
        zero_centred_rmsnorm(rows, weight, got, 1e-6)
        assert torch.equal(got[0], out[0]), n
    op = get_op("zero_centred_head_rmsnorm")
    d = 64
    head_w = weight[:d].contiguous()
    per_head, via_op = _poisoned(x), _poisoned(x)
    zero_centred_rmsnorm(x.view(-1, d), head_w, per_head.view(-1, d), 1e-6)
    op.kernels[0].launch([x, head_w], [via_op], [], op.parse_attrs({"eps": 1e-6}))
    assert torch.equal(via_op, per_head)


@cuda
@pytest.mark.parametrize("hidden", [72, 200, 4096])
def test_cuda_bf16_matches_fp32_reference(hidden):
    gen = torch.Generator(device="cuda").manual_seed(hidden)
    x = torch.randn(37, hidden, device="cuda", generator=gen).bfloat16()
    residual = torch.randn(37, hidden, device="cuda", generator=gen).bfloat16()
    weight = (1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)).bfloat16()
    out = _poisoned(x)
    rmsnorm(x, weight, out, 1e-6)
    torch.testing.assert_close(out.float(), reference_rmsnorm(x.float(), weight.float(), 1e-6),
                               **TOL[torch.bfloat16])
    sum_out, norm_out = _poisoned(x), _poisoned(x)
    add_rmsnorm(x, residual, weight, sum_out, norm_out, 1e-6)
    assert torch.equal(sum_out, x + residual)
    torch.testing.assert_close(norm_out.float(),
                               reference_rmsnorm((x + residual).float(), weight.float(), 1e-6),
                               **TOL[torch.bfloat16])


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_width_independence(dtype):
    hidden = 4096
    gen = torch.Generator(device="cuda").manual_seed(0)
    row0 = torch.randn(1, hidden, device="cuda", generator=gen).to(dtype)
    res0 = torch.randn(1, hidden, device="cuda", generator=gen).to(dtype)
    weight = torch.randn(hidden, device="cuda", generator=gen).to(dtype)
    alone, alone_sum, alone_norm = _poisoned(row0), _poisoned(row0), _poisoned(row0)
    rmsnorm(row0, weight, alone, 1e-6)
    add_rmsnorm(row0, res0, weight, alone_sum, alone_norm, 1e-6)
    for n in range(2, 65):
        x = torch.randn(n, hidden, device="cuda", generator=gen).to(dtype)
        res = torch.randn(n, hidden, device="cuda", generator=gen).to(dtype)
        x[0], res[0] = row0[0], res0[0]
        out, sum_out, norm_out = _poisoned(x), _poisoned(x), _poisoned(x)
        rmsnorm(x, weight, out, 1e-6)
        add_rmsnorm(x, res, weight, sum_out, norm_out, 1e-6)
        assert torch.equal(out[0], alone[0]), n
        assert torch.equal(norm_out[0], alone_norm[0]), n
        assert torch.equal(sum_out[0], alone_sum[0]), n
