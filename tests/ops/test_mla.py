"""Absorbed MLA decode (W_UK^T into the query, attention over the paged latent rows, W_UV out of
the latent) equals transformers' unabsorbed formulation, for decode and for prefill rows (each
query row over its own causal prefix), with the latent rows scattered over blocks."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.ops.mla import head_linear_ref, mla_decode_attention_ref, mla_kv_write_ref, mla_unabsorbed_ref


def test_absorbed_equals_unabsorbed_over_a_paged_cache():
    g = torch.Generator().manual_seed(0)
    heads, dn, dv, r, p, length, bs = 3, 10, 7, 12, 6, 21, 4
    kv_b = torch.randn(heads * (dn + dv), r, generator=g) / 4
    latent, k_pe = torch.randn(length, r, generator=g), torch.randn(length, p, generator=g)
    q_nope, q_pe = torch.randn(length, heads, dn, generator=g), torch.randn(length, heads, p, generator=g)
    scale = 0.23
    want = mla_unabsorbed_ref(q_nope, q_pe, latent, k_pe, kv_b, scale)  # [L, H, Dv], causal
    # the latent pool: one sequence's rows in scrambled blocks, written one row per query
    blocks = torch.randperm(12, generator=g)[:6].int()
    pc, lc = torch.randn(12, bs, 1, p, generator=g), torch.randn(12, bs, 1, r, generator=g)
    tables = blocks.expand(length, -1).contiguous()
    live = torch.arange(length, dtype=torch.int32)  # query row t attends to rows 0..t
    for t in range(length):
        mla_kv_write_ref(pc, lc, latent[t:t + 1], k_pe[t:t + 1], tables[t:t + 1], live[t:t + 1], None, 0)
    w = kv_b.view(heads, dn + dv, r)
    w_uk_t, w_uv = w[:, :dn].transpose(1, 2).contiguous(), w[:, dn:].contiguous()  # [H, R, Dn], [H, Dv, R]
    q_lat = head_linear_ref(q_nope.reshape(length, -1), w_uk_t)
    o_lat = mla_decode_attention_ref(q_lat, q_pe.reshape(length, -1), pc, lc, tables, live, scale, 0)
    got = head_linear_ref(o_lat, w_uv).view(length, heads, dv)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("row_offset", [0, 2])
def test_inactive_rows_write_nothing(row_offset):
    pc, lc = torch.zeros(4, 2, 1, 1), torch.zeros(4, 2, 1, 2)
    tables = torch.tensor([[1, 2], [3, 0]], dtype=torch.int32)
    live = torch.tensor([1, 0], dtype=torch.int32)
    mla_kv_write_ref(pc, lc, torch.ones(2, 2), torch.full((2, 1), 2.0), tables, live,
                     torch.tensor([1, 0], dtype=torch.int32), row_offset)
    r = 1 + row_offset
    assert lc[tables[0, r // 2], r % 2, 0].tolist() == [1.0, 1.0] and pc[tables[0, r // 2], r % 2, 0].tolist() == [2.0]
    assert int((lc != 0).sum()) == 2 and int((pc != 0).sum()) == 1
