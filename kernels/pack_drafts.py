"""A device-resident batch's drafts packed for the host and for the verify, in one launch
(issue 14 / 20: runners/proposer_device.py `DeviceDrafts.fill`).

Contract: `pack_drafts(drafts, bits, tokens, records, flat, verify)`; drafts int32 [n * k] (-1
after a row's stop), bits int32 [n * k] (the confidences' float32 bits), tokens int32 [n], at
most two fault records int32 [FAULT_WORDS] each, flat int32 and verify int32 with room:

    flat[0 : nk] = drafts;  flat[nk : 2 nk] = bits;  flat[2 nk + r W : 2 nk + (r + 1) W] = records[r]
    verify[i (k + 1)] = tokens[i];  verify[i (k + 1) + 1 + j] = max(drafts[i k + j], 0)

which is what the fill's torch ops write (one `cat`, the token column's copy and a `clamp`:
three launches), bit for bit. A program covers BLOCK verify words (and as many drafts); the
first also copies the records. Nothing is read that a program also writes.
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import check, check_operand, describe, unspecialized_jit

BLOCK = 1024  # verify words a program: a decode batch (n (k + 1) <= 1024) is one program
LAUNCHES = 1
MAX_RECORDS = 2


# one compile per record count: the warm-up's scratch and a step's views alike
@unspecialized_jit(["n", "k"], ["drafts_ptr", "bits_ptr", "tokens_ptr", "rec0_ptr", "rec1_ptr",
                                "flat_ptr", "verify_ptr"])
def pack_drafts_kernel(
    drafts_ptr, bits_ptr, tokens_ptr, rec0_ptr, rec1_ptr, flat_ptr, verify_ptr,
    n, k,
    RECORDS: tl.constexpr, WORDS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    e = pid * BLOCK + tl.arange(0, BLOCK)
    nk = n * k
    inside = e < nk
    tl.store(flat_ptr + e, tl.load(drafts_ptr + e, mask=inside, other=0), mask=inside)
    tl.store(flat_ptr + nk + e, tl.load(bits_ptr + e, mask=inside, other=0), mask=inside)
    k1 = k + 1
    row = e // k1
    col = e - row * k1
    word = e < n * k1
    token = tl.load(tokens_ptr + row, mask=word & (col == 0), other=0)
    draft = tl.load(drafts_ptr + row * k + col - 1, mask=word & (col > 0), other=0)
    tl.store(verify_ptr + e, tl.where(col == 0, token, tl.maximum(draft, 0)), mask=word)
    if RECORDS >= 1:
        if pid == 0:
            w = tl.arange(0, WORDS)
            tl.store(flat_ptr + 2 * nk + w, tl.load(rec0_ptr + w))
            if RECORDS >= 2:
                tl.store(flat_ptr + 2 * nk + WORDS + w, tl.load(rec1_ptr + w))


def pack_drafts(drafts: torch.Tensor, bits: torch.Tensor, tokens: torch.Tensor,
                records: Sequence[torch.Tensor], flat: torch.Tensor, verify: torch.Tensor, *,
                k: int) -> None:
    """The module docstring's contract, enqueued (no host sync), its operands checked first
    (`KernelInputError` naming the operand)."""
    nk, dev = drafts.shape[0], drafts.device
    check(k >= 1 and nk % k == 0 and drafts.dim() == 1,
          lambda: f"{describe('drafts', drafts)}: expected [n * k] with k = {k}")
    n = nk // k
    check_operand("drafts", drafts, (nk,), (torch.int32,), dev)
    check_operand("bits", bits, (nk,), (torch.int32,), dev)
    check_operand("tokens", tokens, (n,), (torch.int32,), dev)
    check(len(records) <= MAX_RECORDS, lambda: f"{len(records)} fault records: at most {MAX_RECORDS}")
    words = records[0].shape[0] if records else 1
    for i, rec in enumerate(records):
        check_operand(f"records[{i}]", rec, (words,), (torch.int32,), dev)
    need = 2 * nk + len(records) * words
    check(flat.dim() == 1 and flat.shape[0] >= need and flat.dtype is torch.int32
          and flat.is_contiguous() and flat.device == dev,
          lambda: f"{describe('flat', flat)}: expected int32 [>= {need}] contiguous on {dev}")
    check(verify.dim() == 1 and verify.shape[0] >= n * (k + 1) and verify.dtype is torch.int32
          and verify.is_contiguous() and verify.device == dev,
          lambda: f"{describe('verify', verify)}: expected int32 [>= {n * (k + 1)}] "
                  f"contiguous on {dev}")
    check(words & (words - 1) == 0, lambda: f"fault records of {words} words: a power of two")
    launch_pack_drafts(drafts, bits, tokens, records, flat, verify, n=n, k=k)


def launch_pack_drafts(drafts: torch.Tensor, bits: torch.Tensor, tokens: torch.Tensor,
                       records: Sequence[torch.Tensor], flat: torch.Tensor,
                       verify: torch.Tensor, *, n: int, k: int) -> None:
    """`pack_drafts` without its checks: for a caller that checked these operands once
    (runners/proposer_device.py, a step's host time)."""
    if n == 0:
        return
    rec0 = records[0] if records else flat
    rec1 = records[1] if len(records) > 1 else rec0
    pack_drafts_kernel[(triton.cdiv(n * (k + 1), BLOCK),)](
        drafts, bits, tokens, rec0, rec1, flat, verify, n, k,
        RECORDS=len(records), WORDS=rec0.shape[0] if records else 1, BLOCK=BLOCK, num_warps=4,
    )
