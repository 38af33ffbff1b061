"""Accept a verify's drafts on the device and move the next propose's staged rows by the count,
in one launch (issue 20 / 14: `MtpProposer.step_ahead`'s device work).

Contract: `accept_advance(drafts, greedy, counts, tokens, positions, live, index)`; drafts int32
[n, k] (-1 after a row's stop), greedy int32 [n, k + 1] (the target's argmax at each verify row),
counts int64 [n], tokens / positions / live int32 [n], index int64 [n]. For each row i:

    a = the leading drafts[i, j] >= 0 equal to greedy[i, j]   (`speculate.accept`; a -1 stops)
    counts[i] = a
    tokens[i] = max(greedy[i, a], 0)      (a verify row with no finite logit, -1, drafts as 0:
                                           its host raises at the read, FAULTS 27)
    positions[i] += a;  live[i] += a;  index[i] += a

which is what runners/accept_counts.py's torch ops write (`accept_counts` then four shifts and
the index add), bit for bit: ten launches there, one here. A row's values never depend on n (one
program reads a block of whole rows). The staged rows are read before they are written, each by
the program that writes it, so no ordering across programs matters.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import check, check_operand, describe, unspecialized_jit

BLOCK_N = 64  # rows a program: a decode batch is one program
LAUNCHES = 1


# one compile for every width, draft count and buffer layout: the warm-up's is the steps'
@unspecialized_jit(["n", "k", "stride_d", "stride_g"],
                   ["drafts_ptr", "greedy_ptr", "counts_ptr", "tokens_ptr", "positions_ptr",
                    "live_ptr", "index_ptr"])
def accept_advance_kernel(
    drafts_ptr, greedy_ptr, counts_ptr, tokens_ptr, positions_ptr, live_ptr, index_ptr,
    n, k, stride_d, stride_g,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    live_row = rows < n
    inside = live_row[:, None] & (cols[None, :] < k)
    rows64 = rows.to(tl.int64)
    d = tl.load(drafts_ptr + rows64[:, None] * stride_d + cols[None, :], mask=inside, other=-1)
    g = tl.load(greedy_ptr + rows64[:, None] * stride_g + cols[None, :], mask=inside, other=0)
    # the first column that does not extend the accepted prefix: a mismatch, a stop's -1, or a
    # column past k (masked to -1 above); a row that matches all k has none below BLOCK_K
    miss = (d != g) | (d < 0)
    a = tl.minimum(tl.min(tl.where(miss, cols[None, :], BLOCK_K), axis=1), k)
    tl.store(counts_ptr + rows, a.to(tl.int64), mask=live_row)
    token = tl.load(greedy_ptr + rows64 * stride_g + a, mask=live_row, other=0)
    tl.store(tokens_ptr + rows, tl.maximum(token, 0), mask=live_row)
    pos = tl.load(positions_ptr + rows, mask=live_row, other=0)
    tl.store(positions_ptr + rows, pos + a, mask=live_row)
    lv = tl.load(live_ptr + rows, mask=live_row, other=0)
    tl.store(live_ptr + rows, lv + a, mask=live_row)
    idx = tl.load(index_ptr + rows, mask=live_row, other=0)
    tl.store(index_ptr + rows, idx + a.to(tl.int64), mask=live_row)


def accept_advance(drafts: torch.Tensor, greedy: torch.Tensor, counts: torch.Tensor,
                   tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
                   index: torch.Tensor) -> None:
    """The module docstring's contract, enqueued (no host sync), its operands checked first
    (`KernelInputError` naming the operand). Rows of drafts and greedy may be strided; the
    1-D operands are unit-stride."""
    check(drafts.dim() == 2 and greedy.dim() == 2,
          lambda: f"{describe('drafts', drafts)}, {describe('greedy', greedy)}: expected [n, k] "
                  "and [n, k + 1]")
    n, k, dev = drafts.shape[0], drafts.shape[1], drafts.device
    check_operand("drafts", drafts, (n, k), (torch.int32,), dev)
    check_operand("greedy", greedy, (n, k + 1), (torch.int32,), dev)
    check_operand("counts", counts, (n,), (torch.int64,), dev)
    for name, t in (("tokens", tokens), ("positions", positions), ("live", live)):
        check_operand(name, t, (n,), (torch.int32,), dev)
    check_operand("index", index, (n,), (torch.int64,), dev)
    launch_accept_advance(drafts, greedy, counts, tokens, positions, live, index)


def launch_accept_advance(drafts: torch.Tensor, greedy: torch.Tensor, counts: torch.Tensor,
                          tokens: torch.Tensor, positions: torch.Tensor, live: torch.Tensor,
                          index: torch.Tensor) -> None:
    """`accept_advance` without its checks: for a caller that checked these operands' views
    once (runners/accept_counts.py, a step's host time)."""
    n, k = drafts.shape
    if n == 0:
        return
    accept_advance_kernel[(triton.cdiv(n, BLOCK_N),)](
        drafts, greedy, counts, tokens, positions, live, index,
        n, k, drafts.stride(0), greedy.stride(0),
        BLOCK_N=BLOCK_N, BLOCK_K=max(triton.next_power_of_2(k), 2), num_warps=1,
    )
