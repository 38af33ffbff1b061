"""decode_attention's reference shares one KV gather among consecutive rows with the same block
table (a sequence's verify or prefill rows) and stays row-wise: every row's bits are the bits
it gets alone, which is what makes a k+1-row verify agree with one-row decoding exactly."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.ops.attention import decode_attention_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim,block", [(4, 2, 32, 16), (6, 2, 24, 8), (8, 8, 16, 16)])
def test_rows_sharing_a_table_give_their_bits_alone(dtype, heads, kv_heads, dim, block):
    g = torch.Generator().manual_seed(heads * dim)
    kc = torch.randn(30, block, kv_heads, dim, generator=g).to(dtype)
    vc = torch.randn(30, block, kv_heads, dim, generator=g).to(dtype)
    seqs = torch.randint(1, 30, (3, 12), generator=g).int()  # 96 rows at block 8
    which = torch.tensor([0, 0, 0, 1, 2, 2, 0, 0, 1])  # runs of one table, a table seen twice
    tables = seqs[which]
    live = torch.tensor([40, 41, 42, 7, 0, 1, 90, 93, 10], dtype=torch.int32)
    q = torch.randn(len(which), heads * dim, generator=g).to(dtype)
    for row_offset in (0, 2):
        together = decode_attention_ref(q, kc, vc, tables, live, None, row_offset)
        for i in range(len(which)):
            alone = decode_attention_ref(q[i:i + 1], kc, vc, tables[i:i + 1], live[i:i + 1], None, row_offset)
            assert torch.equal(alone[0], together[i]), f"row {i}, row_offset {row_offset}"


def test_a_row_reads_only_its_own_live_rows():
    """Non-finite KV past a row's length (stale rows of a longer row sharing the table) is never read."""
    kc, vc = torch.randn(4, 16, 2, 32), torch.randn(4, 16, 2, 32)
    kc[1, 5:], vc[1, 5:] = float("nan"), float("nan")
    tables = torch.tensor([[1, 2]] * 2, dtype=torch.int32)
    out = decode_attention_ref(torch.randn(2, 128), kc, vc, tables, torch.tensor([4, 20], dtype=torch.int32), None, 0)
    assert torch.isfinite(out[0]).all() and torch.isnan(out[1]).all()


def test_a_negative_length_is_refused():
    kc = torch.randn(4, 16, 2, 32)
    with pytest.raises(ValueError, match="row 1: live_rows 0 \\+ row_offset -2"):
        decode_attention_ref(torch.randn(2, 128), kc, kc, torch.ones(2, 2, dtype=torch.int32),
                             torch.tensor([3, 0], dtype=torch.int32), None, -2)
