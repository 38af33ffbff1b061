"""rope_kv_write against a straightforward torch reference: rotary values, the paged slots written,
every other cache slot bitwise unchanged, inactive rows writing nothing.

CPU: fp32 and fp16 under the Triton interpreter. cuda: bf16, large positions, width independence.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.rope_kv_write import rope_kv_write

from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU

TOL = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
BLOCK_SIZE = 16


def reference_rope(x: torch.Tensor, pos: torch.Tensor, num_heads: int, head_dim: int, theta: float,
                   out_dtype: torch.dtype, compute: torch.dtype = torch.float32) -> torch.Tensor:
    # x: [n, H*D]; pos: [n] (positions + pos_offset)
    # compute=float64 gives the truth the fp32 reference and the kernel are both measured against.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=x.device).to(compute) / head_dim))
    angle = pos.to(compute)[:, None] * inv_freq[None, :]  # [n, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    xh = x.to(compute).view(x.shape[0], num_heads, head_dim)
    x1, x2 = xh[..., : head_dim // 2], xh[..., head_dim // 2:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.reshape(x.shape).to(out_dtype)


def reference_kv_write(k_rot, v, live_rows, block_tables, k_cache, v_cache, row_offset, active):
    """Applies the write to copies; returns them and a bool [blocks, block_size] mask of written slots."""
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    n, block_size = k_rot.shape[0], k_cache.shape[1]
    for i in range(n):
        if active is not None and int(active[i]) == 0:
            continue
        r = int(live_rows[i]) + row_offset
        blk, slot = int(block_tables[i, r // block_size]), r % block_size
        k_cache[blk, slot] = k_rot[i].view(k_cache.shape[2:]).to(k_cache.dtype)
        v_cache[blk, slot] = v[i].view(v_cache.shape[2:]).to(v_cache.dtype)
        written[blk, slot] = True
    return k_cache, v_cache, written


def _case(n, num_heads, num_kv_heads, head_dim, dtype, seed, device="cpu", live=None, pos_dtype=torch.int32,
          max_blocks=4, pos_base=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(n, num_heads * head_dim, device=device, generator=gen).to(dtype)
    k = torch.randn(n, num_kv_heads * head_dim, device=device, generator=gen).to(dtype)
    v = torch.randn(n, num_kv_heads * head_dim, device=device, generator=gen).to(dtype)
    if live is None:
        live = torch.randint(0, max_blocks * BLOCK_SIZE - 2, (n,), device=device, generator=gen)
    live_rows = torch.as_tensor(live, device=device).to(torch.int32)
    positions = (live_rows.long() + pos_base).to(pos_dtype)
    # Each row owns distinct blocks, in a scrambled order, so no two rows share a slot.
    num_blocks = n * max_blocks + 3
    perm = torch.randperm(num_blocks, device=device, generator=gen)[: n * max_blocks]
    block_tables = perm.view(n, max_blocks).to(torch.int32)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device=device, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, device=device, generator=gen).to(dtype)
    return q, k, v, positions, live_rows, block_tables, k_cache, v_cache


def _run_and_check(case, num_heads, num_kv_heads, head_dim, theta, pos_offset, row_offset, active, tol):
    q, k, v, positions, live_rows, block_tables, k_cache, v_cache = case
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = torch.full_like(q, float("nan"))
    rope_kv_write(q, k, v, positions, live_rows, block_tables, k_cache, v_cache, q_out,
                  num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, theta=theta,
                  pos_offset=pos_offset, row_offset=row_offset, active=active)
    pos = positions.long() + pos_offset
    assert not q_out.isnan().any()
    torch.testing.assert_close(q_out, reference_rope(q, pos, num_heads, head_dim, theta, q.dtype), **tol)
    k_rot = reference_rope(k, pos, num_kv_heads, head_dim, theta, k.dtype)
    k_expect, v_expect, written = reference_kv_write(k_rot, v, live_rows, block_tables, k_before, v_before,
                                                     row_offset, active)
    assert torch.equal(k_cache[~written], k_before[~written])  # untouched slots: bitwise the same
    assert torch.equal(v_cache[~written], v_before[~written])
    torch.testing.assert_close(k_cache[written], k_expect[written], **tol)
    assert torch.equal(v_cache[written], v_expect[written])  # v is copied, not computed
    return written


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [80, 16])
def test_rope_kv_write_matches_reference(dtype, head_dim):
    # Live rows end mid-block and span several blocks: 0, 15 (block end), 16, 33, 47 (+ row_offset 1).
    case = _case(5, 3, 2, head_dim, dtype, seed=head_dim, live=[0, 15, 16, 33, 46])
    written = _run_and_check(case, 3, 2, head_dim, theta=10000.0, pos_offset=2, row_offset=1, active=None,
                             tol=TOL[dtype])
    assert int(written.sum()) == 5


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_inactive_rows_write_nothing(pos_dtype):
    case = _case(5, 4, 1, 96, torch.float32, seed=3, pos_dtype=pos_dtype)
    active = torch.tensor([1, 0, 1, 0, 1], dtype=torch.int32)
    written = _run_and_check(case, 4, 1, 96, theta=1e6, pos_offset=0, row_offset=0, active=active,
                             tol=TOL[torch.float32])
    assert int(written.sum()) == 3


def test_single_row_gqa():
    case = _case(1, 8, 2, 64, torch.float16, seed=4, live=[37])
    written = _run_and_check(case, 8, 2, 64, theta=500000.0, pos_offset=5, row_offset=2,
                             active=torch.ones(1, dtype=torch.int32), tol=TOL[torch.float16])
    assert int(written.sum()) == 1


def test_large_positions_close_to_float64_truth():
    # At position ~30000 an fp32 angle is only good to ~1e-3 rad, so the kernel is held to the
    # error of the fp32 reference itself, both measured against a float64 computation.
    n, heads, head_dim, theta = 3, 2, 80, 10000.0
    gen = torch.Generator().manual_seed(9)
    q = torch.randn(n, heads * head_dim, generator=gen)
    positions = torch.tensor([29999, 31234, 32767], dtype=torch.int64)
    live = torch.zeros(n, dtype=torch.int32)
    tables = torch.arange(n, dtype=torch.int32).view(n, 1)
    cache = torch.zeros(n, BLOCK_SIZE, 1, head_dim)
    q_out = torch.full_like(q, float("nan"))
    rope_kv_write(q, torch.zeros(n, head_dim), torch.zeros(n, head_dim), positions, live, tables,
                  cache, cache.clone(), q_out, num_heads=heads, num_kv_heads=1, head_dim=head_dim,
                  theta=theta, pos_offset=1, row_offset=0)
    truth = reference_rope(q, positions + 1, heads, head_dim, theta, torch.float64, compute=torch.float64)
    ref = reference_rope(q, positions + 1, heads, head_dim, theta, torch.float32)
    ref_err = (ref.double() - truth).abs().max()
    kernel_err = (q_out.double() - truth).abs().max()
    assert kernel_err <= 2 * ref_err + 1e-5, (float(kernel_err), float(ref_err))


def test_rejects_bad_inputs():
    q, k, v, positions, live_rows, block_tables, k_cache, v_cache = _case(3, 2, 1, 16, torch.float32, seed=0)
    kwargs = dict(num_heads=2, num_kv_heads=1, head_dim=16, theta=1e4, pos_offset=0, row_offset=0)
    with pytest.raises(KernelInputError, match="live_rows"):
        rope_kv_write(q, k, v, positions, live_rows.long(), block_tables, k_cache, v_cache, q.clone(),
                      **kwargs)
    with pytest.raises(KernelInputError, match="k_cache"):
        rope_kv_write(q, k, v, positions, live_rows, block_tables, k_cache[..., :8], v_cache, q.clone(),
                      **kwargs)
    with pytest.raises(KernelInputError, match="q_out"):
        rope_kv_write(q, k, v, positions, live_rows, block_tables, k_cache, v_cache, q[:, :16], **kwargs)
    with pytest.raises(KernelInputError, match="head_dim"):
        rope_kv_write(q, k, v, positions, live_rows, block_tables, k_cache, v_cache, q.clone(),
                      **{**kwargs, "head_dim": 15})


@cuda
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_cuda_bf16_matches_fp32_reference(head_dim):
    n, heads, kv_heads = 37, 8, 2
    case = _case(n, heads, kv_heads, head_dim, torch.bfloat16, seed=head_dim, device="cuda", max_blocks=8)
    q, k, v, positions, live_rows, block_tables, k_cache, v_cache = case
    active = (torch.arange(n, device="cuda") % 5 != 3).to(torch.int32)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    q_out = torch.full_like(q, float("nan"))
    rope_kv_write(q, k, v, positions, live_rows, block_tables, k_cache, v_cache, q_out,
                  num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, theta=1e6,
                  pos_offset=3, row_offset=1, active=active)
    pos = positions.long() + 3
    q_ref = reference_rope(q.float(), pos, heads, head_dim, 1e6, torch.float32)
    torch.testing.assert_close(q_out.float(), q_ref, **TOL[torch.bfloat16])
    k_rot = reference_rope(k.float(), pos, kv_heads, head_dim, 1e6, torch.float32)
    k_expect, v_expect, written = reference_kv_write(k_rot, v, live_rows, block_tables, k_before.float(),
                                                     v_before, 1, active)
    assert torch.equal(k_cache[~written], k_before[~written])
    assert torch.equal(v_cache[~written], v_before[~written])
    assert torch.equal(v_cache[written], v_expect[written])
    torch.testing.assert_close(k_cache[written].float(), k_expect[written], **TOL[torch.bfloat16])
    assert int(written.sum()) == int(active.sum())


@cuda
def test_cuda_large_positions_close_to_float64_truth():
    # The libdevice trig path: positions up to 2**17 must be as good as torch's fp32 on the GPU.
    n, heads, head_dim, theta = 64, 4, 128, 10000.0
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(n, heads * head_dim, device="cuda", generator=gen)
    positions = torch.randint(0, 2 ** 17, (n,), device="cuda", generator=gen)
    tables = torch.arange(n, dtype=torch.int32, device="cuda").view(n, 1)
    cache = torch.zeros(n, BLOCK_SIZE, 1, head_dim, device="cuda")
    q_out = torch.full_like(q, float("nan"))
    rope_kv_write(q, torch.zeros(n, head_dim, device="cuda"), torch.zeros(n, head_dim, device="cuda"),
                  positions, torch.zeros(n, dtype=torch.int32, device="cuda"), tables, cache, cache.clone(),
                  q_out, num_heads=heads, num_kv_heads=1, head_dim=head_dim, theta=theta, pos_offset=0,
                  row_offset=0)
    truth = reference_rope(q, positions, heads, head_dim, theta, torch.float64, compute=torch.float64)
    ref = reference_rope(q, positions, heads, head_dim, theta, torch.float32)
    ref_err = (ref.double() - truth).abs().max()
    kernel_err = (q_out.double() - truth).abs().max()
    assert kernel_err <= 2 * ref_err + 1e-5, (float(kernel_err), float(ref_err))


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_width_independence(dtype):
    heads, kv_heads, head_dim = 8, 2, 128
    kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, theta=1e6, pos_offset=1,
                  row_offset=0)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q0 = torch.randn(1, heads * head_dim, device="cuda", generator=gen).to(dtype)
    k0 = torch.randn(1, kv_heads * head_dim, device="cuda", generator=gen).to(dtype)
    v0 = torch.randn(1, kv_heads * head_dim, device="cuda", generator=gen).to(dtype)
    pos0, live0 = 1234, 21  # row 0 writes block tables[0, 1], slot 5
    for n in range(1, 65):
        q, k, v, positions, live_rows, block_tables, k_cache, v_cache = _case(
            n, heads, kv_heads, head_dim, dtype, seed=n, device="cuda", max_blocks=2)
        q[0], k[0], v[0], positions[0], live_rows[0] = q0[0], k0[0], v0[0], pos0, live0
        q_out = torch.full_like(q, float("nan"))
        rope_kv_write(q, k, v, positions, live_rows, block_tables, k_cache, v_cache, q_out, **kwargs)
        blk = int(block_tables[0, 1])
        got = (q_out[0].clone(), k_cache[blk, 5].clone(), v_cache[blk, 5].clone())
        if n == 1:
            alone = got
        else:
            assert all(torch.equal(a, b) for a, b in zip(got, alone)), n
