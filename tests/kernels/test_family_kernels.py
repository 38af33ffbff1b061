"""The kernel side of the families' ops, under the Triton interpreter (fp32, fp16): rope_kv_write with
a partial rotary_dim (GLM-4.5: rotate-half inside each head's first R dims, the rest copied bit for
bit), linear with a bias epilogue, and head_rmsnorm through the rmsnorm kernel on per-head views.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear import linear
from draft_circuit.kernels.rope_kv_write import rope_kv_write
from draft_circuit.ops import get_op
from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU
from tests.kernels.test_rope_kv_write import TOL, _case, reference_kv_write


def partial_rope(x: torch.Tensor, pos: torch.Tensor, heads: int, head_dim: int, rotary_dim: int,
                 theta: float) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb with cos/sin over rotary_dim (Glm4MoeRotaryEmbedding), float64."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    freqs = pos.double()[:, None] * inv_freq
    emb = torch.cat([freqs, freqs], -1)[:, None, :]  # [n, 1, R]
    xh = x.double().view(x.shape[0], heads, head_dim)
    rot, rest = xh[..., :rotary_dim], xh[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], -1)
    return torch.cat([rot * emb.cos() + rotated * emb.sin(), rest], -1).reshape(x.shape)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim, rotary_dim", [(16, 8), (24, 12), (20, 4), (16, 16)])
def test_rope_kv_write_partial_rotary(dtype, head_dim, rotary_dim):
    heads, kv_heads, theta = 4, 2, 10000.0
    q, k, v, positions, live, tables, k_cache, v_cache = _case(5, heads, kv_heads, head_dim, dtype, seed=head_dim,
                                                               live=[0, 15, 16, 33, 46])
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = torch.full_like(q, float("nan"))
    rope_kv_write(q, k, v, positions, live, tables, k_cache, v_cache, q_out, num_heads=heads,
                  num_kv_heads=kv_heads, head_dim=head_dim, theta=theta, pos_offset=3, row_offset=1,
                  rotary_dim=rotary_dim)
    pos = positions.long() + 3
    torch.testing.assert_close(q_out, partial_rope(q, pos, heads, head_dim, rotary_dim, theta).to(dtype),
                               **TOL[dtype])
    rest = lambda t, h: t.view(t.shape[0], h, head_dim)[..., rotary_dim:]  # noqa: E731
    assert torch.equal(rest(q_out, heads), rest(q, heads))  # the unrotated dims are copied exactly
    k_rot = partial_rope(k, pos, kv_heads, head_dim, rotary_dim, theta).to(dtype)
    k_want, v_want, written = reference_kv_write(k_rot, v, live, tables, k_before, v_before, 1, None)
    assert torch.equal(k_cache[~written], k_before[~written]) and torch.equal(v_cache[~written], v_before[~written])
    torch.testing.assert_close(k_cache[written], k_want[written], **TOL[dtype])
    assert torch.equal(k_cache[written][..., rotary_dim:], k_want[written][..., rotary_dim:])
    assert torch.equal(v_cache[written], v_want[written])


def test_rope_kv_write_rotary_dim_default_is_the_whole_head():
    case = _case(3, 2, 1, 16, torch.float32, seed=5)
    outs = []
    for rotary_dim in (None, 16):
        q, k, v, positions, live, tables, k_cache, v_cache = (t.clone() for t in case)
        q_out = torch.empty_like(q)
        rope_kv_write(q, k, v, positions, live, tables, k_cache, v_cache, q_out, num_heads=2, num_kv_heads=1,
                      head_dim=16, theta=1e4, pos_offset=0, row_offset=0, rotary_dim=rotary_dim)
        outs.append((q_out, k_cache))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@pytest.mark.parametrize("rotary_dim", [0, 7, 18, -2])
def test_rope_kv_write_refuses_a_bad_rotary_dim(rotary_dim):
    q, k, v, positions, live, tables, k_cache, v_cache = _case(2, 2, 1, 16, torch.float32, seed=0)
    with pytest.raises(KernelInputError, match=f"rotary_dim {rotary_dim} must be even"):
        rope_kv_write(q, k, v, positions, live, tables, k_cache, v_cache, torch.empty_like(q), num_heads=2,
                      num_kv_heads=1, head_dim=16, theta=1e4, pos_offset=0, row_offset=0, rotary_dim=rotary_dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n, k, rows", [(1, 200, 333), (5, 130, 40), (17, 64, 33)])
def test_linear_with_bias(dtype, n, k, rows):
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(n, k, generator=g).to(dtype)
    w = (torch.randn(rows, k, generator=g) / k ** 0.5).to(dtype)
    bias = torch.randn(rows, generator=g).to(dtype)
    out = torch.full((n, rows), float("nan"), dtype=dtype)
    linear(x, w, out, bias)
    want = (x.double() @ w.double().T + bias.double()).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, want, **tol)
    plain = torch.empty_like(out)
    linear(x, w, plain)
    assert not torch.equal(plain, out)  # the bias is really added


def test_linear_refuses_a_bias_of_the_wrong_shape_or_dtype():
    x, w, out = torch.randn(2, 8), torch.randn(6, 8), torch.empty(2, 6)
    with pytest.raises(KernelInputError, match="bias"):
        linear(x, w, out, torch.randn(5))
    with pytest.raises(KernelInputError, match="bias"):
        linear(x, w, out, torch.randn(6, dtype=torch.float16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_head_rmsnorm_binding_normalises_each_head(dtype):
    op = get_op("head_rmsnorm")
    (binding,) = op.kernels
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3 * 24, generator=g).to(dtype) * 3
    w = (1 + 0.1 * torch.randn(24, generator=g)).to(dtype)
    attrs = op.parse_attrs({"eps": 1e-6})
    out = torch.full_like(x, float("nan"))
    binding.launch([x, w], [out], [], attrs)
    (want,) = op.reference([x, w], attrs)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out, want, **tol)


# ---- GPU (run by `pytest -m cuda` on the GPU machine) ----
@cuda
@pytest.mark.parametrize("head_dim, rotary_dim", [(128, 64), (128, 32), (80, 40)])
def test_cuda_bf16_partial_rope_kv_write(head_dim, rotary_dim):
    n, heads, kv_heads = 37, 8, 2
    q, k, v, positions, live, tables, k_cache, v_cache = _case(n, heads, kv_heads, head_dim, torch.bfloat16,
                                                               seed=head_dim, device="cuda", max_blocks=8)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = torch.full_like(q, float("nan"))
    rope_kv_write(q, k, v, positions, live, tables, k_cache, v_cache, q_out, num_heads=heads,
                  num_kv_heads=kv_heads, head_dim=head_dim, theta=1e6, pos_offset=2, row_offset=1,
                  rotary_dim=rotary_dim)
    pos = positions.long().cpu() + 2
    want_q = partial_rope(q.cpu(), pos, heads, head_dim, rotary_dim, 1e6)
    torch.testing.assert_close(q_out.cpu().double(), want_q, **TOL[torch.bfloat16])
    rest = lambda t, h: t.view(t.shape[0], h, head_dim)[..., rotary_dim:]  # noqa: E731
    assert torch.equal(rest(q_out, heads), rest(q, heads))
    k_rot = partial_rope(k.cpu(), pos, kv_heads, head_dim, rotary_dim, 1e6).float()
    k_want, v_want, written = reference_kv_write(k_rot, v.cpu(), live.cpu(), tables.cpu(), k_before.cpu().float(),
                                                 v_before.cpu(), 1, None)
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    assert torch.equal(k_cache[~written], k_before.cpu()[~written])
    assert torch.equal(v_cache[written], v_want[written])
    torch.testing.assert_close(k_cache[written].float(), k_want[written], **TOL[torch.bfloat16])


@cuda
def test_cuda_linear_bias_is_width_independent():
    g = torch.Generator(device="cuda").manual_seed(0)
    k, rows = 2048, 1000
    w = (torch.randn(rows, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
    bias = torch.randn(rows, device="cuda", generator=g).bfloat16()
    x0 = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    alone = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
    linear(x0, w, alone, bias)
    want = (x0.double() @ w.double().T + bias.double()).float()
    torch.testing.assert_close(alone.float(), want, atol=5e-2, rtol=2e-2)
    for n in (2, 17, 64):
        x = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        x[n // 2] = x0[0]
        out = torch.empty(n, rows, device="cuda", dtype=torch.bfloat16)
        linear(x, w, out, bias)
        assert torch.equal(out[n // 2], alone[0]), n
