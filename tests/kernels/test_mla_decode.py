"""MLA kernels against ops.mla's references: the absorbed decode (paged latent rows across block
boundaries, block sizes of any kind, head counts off the head block, live lengths that end
mid-split), the latent write (inactive rows untouched) and the per-head matmul.

CPU: fp32 under the Triton interpreter. cuda: bf16 at DeepSeek-V3's shapes, row alone == row in
a batch bitwise, ragged lengths.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.head_linear import head_linear
from draft_circuit.kernels.mla_decode import mla_decode_attention
from draft_circuit.kernels.mla_kv_write import mla_kv_write
from draft_circuit.ops.mla import head_linear_ref, mla_decode_attention_ref, mla_kv_write_ref
from draft_circuit.runners.testing import cuda


def _case(lives, heads, r, p, block_size, max_blocks, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    n = len(lives)
    num_blocks = n * max_blocks + 3
    pe_cache = torch.randn(num_blocks, block_size, 1, p, generator=g)
    latent_cache = torch.randn(num_blocks, block_size, 1, r, generator=g)
    tables = torch.randperm(num_blocks, generator=g)[: n * max_blocks].view(n, max_blocks).int()
    q_lat = torch.randn(n, heads * r, generator=g)
    q_pe = torch.randn(n, heads * p, generator=g)
    live = torch.tensor(lives, dtype=torch.int32)
    return [t.to(dtype).to(device) if t.is_floating_point() else t.to(device)
            for t in (q_lat, q_pe, pe_cache, latent_cache, tables, live)]


@pytest.mark.parametrize("lives, heads, r, p, block_size, max_blocks, row_offset", [
    ([0, 7, 8, 9, 40], 4, 16, 8, 8, 6, 0),          # lengths ending on and across block edges
    ([130, 3, 257], 20, 32, 16, 16, 17, 1),          # heads off the 16-head block, 3 splits
    ([5, 11], 3, 12, 6, 6, 4, 2),                    # block size 6, R and P not powers of two
    ([0], 1, 16, 16, 16, 1, 0),                      # one row, one head
])
def test_kernel_matches_reference_fp32(lives, heads, r, p, block_size, max_blocks, row_offset):
    q_lat, q_pe, pc, lc, tables, live = _case(lives, heads, r, p, block_size, max_blocks)
    out = torch.empty_like(q_lat)
    scale = 0.37
    mla_decode_attention(q_lat, q_pe, pc, lc, tables, live, out, scale=scale, row_offset=row_offset)
    want = mla_decode_attention_ref(q_lat, q_pe, pc, lc, tables, live, scale, row_offset)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    # each row alone gives the bits it got inside the batch
    for i in range(len(lives)):
        alone = torch.empty_like(q_lat[i:i + 1])
        mla_decode_attention(q_lat[i:i + 1], q_pe[i:i + 1], pc, lc, tables[i:i + 1], live[i:i + 1], alone,
                             scale=scale, row_offset=row_offset)
        assert torch.equal(alone, out[i:i + 1])


def test_bad_operands_are_refused_by_name():
    q_lat, q_pe, pc, lc, tables, live = _case([3, 4], 2, 16, 8, 8, 2)
    with pytest.raises(KernelInputError, match="do not split into the same heads"):
        mla_decode_attention(q_lat[:, :-1], q_pe, pc, lc, tables, live, torch.empty(2, 31), scale=1.0)
    with pytest.raises(KernelInputError, match="row_offset must be >= 0"):
        mla_decode_attention(q_lat, q_pe, pc, lc, tables, live, torch.empty_like(q_lat), scale=1.0, row_offset=-1)
    with pytest.raises(KernelInputError, match="q_pe"):
        mla_decode_attention(q_lat, q_pe.half(), pc, lc, tables, live, torch.empty_like(q_lat), scale=1.0)


@pytest.mark.parametrize("with_active", [False, True])
def test_latent_write_matches_reference(with_active):
    g = torch.Generator().manual_seed(1)
    n, r, p, bs = 5, 12, 6, 4
    pc, lc = torch.randn(20, bs, 1, p, generator=g), torch.randn(20, bs, 1, r, generator=g)
    tables = torch.randperm(20, generator=g)[:15].view(n, 3).int()
    live = torch.tensor([0, 3, 4, 7, 10], dtype=torch.int32)
    latent, k_pe = torch.randn(n, r, generator=g), torch.randn(n, p, generator=g)
    active = torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32) if with_active else None
    want_pc, want_lc = pc.clone(), lc.clone()
    mla_kv_write_ref(want_pc, want_lc, latent, k_pe, tables, live, active, 1)
    mla_kv_write(pc, lc, latent, k_pe, tables, live, row_offset=1, active=active)
    assert torch.equal(pc, want_pc) and torch.equal(lc, want_lc)


@pytest.mark.parametrize("n, heads, rows, k", [(1, 3, 16, 8), (5, 4, 70, 33), (17, 2, 12, 130)])
def test_head_linear_matches_reference(n, heads, rows, k):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, heads * k, generator=g), torch.randn(heads, rows, k, generator=g)
    out = torch.empty(n, heads * rows)
    head_linear(x, w, out)
    torch.testing.assert_close(out, head_linear_ref(x, w), atol=1e-4, rtol=1e-5)
    one = torch.empty(1, heads * rows)
    head_linear(x[-1:], w, one)
    assert torch.equal(one, out[-1:])  # width independent


@cuda
@pytest.mark.parametrize("lives", [[1, 100, 1023, 4000], [4096] * 8])
def test_bf16_at_deepseek_shapes_and_rows_alone_are_bitwise(lives):
    heads, r, p = 128, 512, 64
    q_lat, q_pe, pc, lc, tables, live = _case(lives, heads, r, p, 64, 65, torch.bfloat16, "cuda")
    scale = 0.1352
    out = torch.empty_like(q_lat)
    mla_decode_attention(q_lat, q_pe, pc, lc, tables, live, out, scale=scale)
    want = mla_decode_attention_ref(q_lat, q_pe, pc, lc, tables, live, scale, 0)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
    for i in range(len(lives)):
        alone = torch.empty_like(q_lat[i:i + 1])
        mla_decode_attention(q_lat[i:i + 1], q_pe[i:i + 1], pc, lc, tables[i:i + 1], live[i:i + 1], alone,
                             scale=scale)
        assert torch.equal(alone, out[i:i + 1])


@cuda
def test_head_linear_bf16_on_gpu_is_width_independent():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 128 * 128, generator=g).bfloat16().cuda()
    w = (torch.randn(128, 512, 128, generator=g) / 11).bfloat16().cuda()
    out = torch.empty(64, 128 * 512, dtype=torch.bfloat16, device="cuda")
    head_linear(x, w, out)
    torch.testing.assert_close(out.float(), head_linear_ref(x, w).float(), atol=2e-2, rtol=2e-2)
    for n in (1, 7):
        part = torch.empty(n, 128 * 512, dtype=torch.bfloat16, device="cuda")
        head_linear(x[:n], w, part)
        assert torch.equal(part, out[:n])
