"""A token bitmask over the target vocabulary -> the mask over a subset of it, in one launch.

Contract: `remap_bitmask(bitmask, ids, out)`; bitmask int32 [n, W], ids int32 [S], out int32
[n, ceil(S/32)]: bit s of row r of out (word s >> 5, position s & 31; bit 31 is the sign bit) is
bit ids[s] of row r of bitmask, and the last word's bits past S are 0 -- the bits
ops.vocab.remap_bitmask_ref packs. An id outside [0, 32 W) reads nothing and gives 0 (the token
is not allowed); the reference refuses it (DraftIdError), and the ids a chain binds are checked
against the vocabulary when bound (circuit.layers.draft_vocab, eagle3.draft_targets), never here:
that would sync the host. One program per (row, block of output words): a row's bits never
depend on n.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import check, check_operand, describe, launch_kwargs, pdl_args

# output words a program packs (BLOCK_W * 32 subset ids gathered): S = 32,768 ids is 64 programs
# a row, enough to spread a one-row remap over the GPU
BLOCK_W = 16
LAUNCHES = 1


@triton.jit(do_not_specialize=["pdl_release"])
def remap_bitmask_kernel(
    mask_ptr, ids_ptr, out_ptr,
    stride_mask, stride_out,
    size, in_words, out_words, pdl_release,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    words = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)  # [BLOCK_W] output words
    lanes = tl.arange(0, 32)
    s = words[:, None] * 32 + lanes[None, :]  # [BLOCK_W, 32] subset positions
    in_subset = s < size
    ids = tl.load(ids_ptr + s, mask=in_subset, other=0)  # a param: no earlier launch writes it
    covered = in_subset & (ids >= 0) & ((ids >> 5) < in_words)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()  # the bitmask comes from an earlier launch (the input copy)
        if pdl_release != 0:  # early release (_common.pdl_args): the next launch may start now
            tl.extra.cuda.gdc_launch_dependents()
    word = tl.load(mask_ptr + row * stride_mask + (ids >> 5), mask=covered, other=0)
    bit = (word >> (ids & 31)) & 1  # arithmetic shift of the sign bit: & 1 keeps it exact
    # the 32 bits are disjoint, so their int32 sum is their or, bit 31 landing on the sign with
    # no overflow in any order
    packed = tl.sum(bit << lanes[None, :], axis=1)
    tl.store(out_ptr + row * stride_out + words, packed, mask=words < out_words)


def remap_bitmask(bitmask: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """out[r] = the bits ids[0..S) of bitmask[r], packed 32 a word; bitmask int32 [n, W], ids int32
    [S], out int32 [n, ceil(S/32)], rows unit-stride. No host sync."""
    check(bitmask.dim() == 2 and ids.dim() == 1,
          lambda: f"{describe('bitmask', bitmask)}, {describe('ids', ids)}: expected [n, words] and [S]")
    n, in_words, size, dev = bitmask.shape[0], bitmask.shape[1], ids.shape[0], bitmask.device
    out_words = triton.cdiv(size, 32)
    check_operand("bitmask", bitmask, (n, in_words), (torch.int32,), dev)
    check_operand("ids", ids, (size,), (torch.int32,), dev)
    check_operand("out", out, (n, out_words), (torch.int32,), dev)
    if n == 0 or size == 0:
        return
    pdl = launch_kwargs(bitmask)
    remap_bitmask_kernel[(n, triton.cdiv(out_words, BLOCK_W))](
        bitmask, ids, out, bitmask.stride(0), out.stride(0), size, in_words, out_words,
        BLOCK_W=BLOCK_W, **pdl_args(pdl, n), num_warps=4, **pdl,
    )
