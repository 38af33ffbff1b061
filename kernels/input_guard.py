"""The runner input guard: one launch, first in a draft chain's program, that checks each row's
token, live_rows and block ids against the static bounds and makes a bad row inert, with no
host sync (issue 19 item 1, FAULTS 20 / 25).

Contract (ops/input_guard.py holds the torch reference; both must agree bit for bit):
  a row's token is bad when outside [0, vocab) (vocab 0: unchecked);
  an active row's live_rows is bad when outside [0, capacity - steps] (capacity =
  max_blocks * block_size: the chain writes rows live .. live + steps - 1);
  an active row's block ids are bad when an entry it reads or writes (0 .. (live + steps - 1) //
  block_size) is outside [0, num_blocks).
  A row to fix is a bad row, or an inactive row whose live_rows or used entries are out of range
  (it drafts nothing, but a kernel that reads through its table would leave the pool). A fixed
  row's guarded copies are token 0, live 0, active 0 and every table entry the scratch block;
  every other row's copies equal its inputs.
  The fault record (int32[8], sticky until the host clears it) gets, on the first faulted run:
  [0] the fault code (1 token, 2 live_rows, 3 block id), [1] the row, [2] the value, [3] the table
  entry (-1 unless a block id), [4] the run's width n, [5] the bad rows of that run; and [6]
  counts the faulted runs. The first fault of a run is the lowest row with a bad token, else the
  lowest active row with a bad live_rows or block id (the CPU entry check's order).

One program over every row (n is at most the runner's max width): no atomics, and "first" is
deterministic. A table that fits one tile (n x M <= 8192, padded) is loaded once, with every
load issued up front, so the launch costs about one memory round trip; a wider one is read in
column chunks, twice.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import check, check_operand, describe, pdl_supported

FAULT_WORDS = 8
COL_CHUNK = 64  # table columns per step of the two passes over a table too big for one tile
ONE_TILE = 8192  # rows x columns (padded to powers of two) held in registers at once
#: the fewest rows a program's tile holds: widths 1..16 share one compile (BLOCK_N is a constexpr),
#: and a masked row costs the one program nothing it waits on; not where the padded rows would
#: push a table that fits one tile (ONE_CHUNK) past it (tables of over ONE_TILE / 16 blocks)
MIN_BLOCK_N = 16


# n unspecialised: BLOCK_N already splits the widths; n == 1 or a multiple of 16 need no compile
@triton.jit(do_not_specialize=["n"])
def input_guard_kernel(
    tokens_ptr, tables_ptr, live_ptr, active_ptr, faults_ptr,
    g_tokens_ptr, g_tables_ptr, g_live_ptr, g_active_ptr,
    n, max_blocks, stride_tables, stride_g_tables,
    vocab, num_blocks, block_size, steps, scratch,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # the whole table in one tile: loaded once, every load issued at once
    TRIGGER: tl.constexpr,    # sm90+: let the next (PDL-launched) kernel launch now
):
    if TRIGGER:
        # The next launch may start while this one runs: every kernel waits (gdc_wait) before
        # it reads what an earlier launch wrote, and that wait is for this grid's completion and
        # its writes. This launch itself is not PDL-launched: it reads the inputs at once.
        tl.extra.cuda.gdc_launch_dependents()
    rows = tl.arange(0, BLOCK_N)
    rmask = rows < n
    flag_before = tl.load(faults_ptr)
    runs_before = tl.load(faults_ptr + 6)
    tok = tl.load(tokens_ptr + rows, mask=rmask, other=0)
    live = tl.load(live_ptr + rows, mask=rmask, other=0)
    act_in = tl.load(active_ptr + rows, mask=rmask, other=0)
    act = act_in != 0
    big = 2147483647
    tok_bad = rmask & (vocab > 0) & ((tok < 0) | (tok >= vocab))
    live_oob = rmask & ((live < 0) | (live > max_blocks * block_size - steps))
    # entries a row reads or writes; an out-of-range live uses none (it is fixed anyway)
    used = tl.where(live_oob, 0, (live + steps - 1) // block_size + 1)

    # pass 1: the first out-of-pool entry each row uses (big: none)
    if ONE_CHUNK:
        cols1 = tl.arange(0, BLOCK_M)
        m1 = rmask[:, None] & (cols1[None, :] < max_blocks)
        tab1 = tl.load(tables_ptr + rows[:, None] * stride_tables + cols1[None, :], mask=m1, other=0)
        oob1 = m1 & (cols1[None, :] < used[:, None]) & ((tab1 < 0) | (tab1 >= num_blocks))
        first_col = tl.min(tl.where(oob1, cols1[None, :], big), axis=1)
    else:
        first_col = tl.full((BLOCK_N,), big, tl.int32)
        for c0 in range(0, max_blocks, BLOCK_M):
            cols = c0 + tl.arange(0, BLOCK_M)
            m2 = rmask[:, None] & (cols[None, :] < max_blocks)
            tab = tl.load(tables_ptr + rows[:, None] * stride_tables + cols[None, :], mask=m2,
                          other=0)
            oob = m2 & (cols[None, :] < used[:, None]) & ((tab < 0) | (tab >= num_blocks))
            first_col = tl.minimum(first_col, tl.min(tl.where(oob, cols[None, :], big), axis=1))
    blk_oob = first_col < big
    flagged = act & (live_oob | blk_oob)
    bad = tok_bad | flagged
    fix = bad | live_oob | blk_oob

    # pass 2: the guarded copies
    tl.store(g_tokens_ptr + rows, tl.where(fix, 0, tok), mask=rmask)
    tl.store(g_live_ptr + rows, tl.where(fix, 0, live), mask=rmask)
    tl.store(g_active_ptr + rows, tl.where(fix, 0, act_in), mask=rmask)
    if ONE_CHUNK:
        tl.store(g_tables_ptr + rows[:, None] * stride_g_tables + cols1[None, :],
                 tl.where(fix[:, None], scratch, tab1), mask=m1)
    else:
        for c0 in range(0, max_blocks, BLOCK_M):
            cols = c0 + tl.arange(0, BLOCK_M)
            m2 = rmask[:, None] & (cols[None, :] < max_blocks)
            tab = tl.load(tables_ptr + rows[:, None] * stride_tables + cols[None, :], mask=m2,
                          other=0)
            tl.store(g_tables_ptr + rows[:, None] * stride_g_tables + cols[None, :],
                     tl.where(fix[:, None], scratch, tab), mask=m2)

    # the record: the lowest bad-token row, else the lowest flagged row
    tok_row = tl.min(tl.where(tok_bad, rows, big), axis=0)
    other_row = tl.min(tl.where(flagged, rows, big), axis=0)
    any_bad = (tok_row < big) | (other_row < big)
    row = tl.where(tok_row < big, tok_row, other_row)
    at = rows == row
    r_tok = tl.sum(tl.where(at, tok, 0), axis=0)
    r_live = tl.sum(tl.where(at, live, 0), axis=0)
    r_live_oob = tl.sum(tl.where(at & live_oob, 1, 0), axis=0) > 0
    r_col = tl.sum(tl.where(at, first_col, 0), axis=0)
    is_tok = tok_row < big
    code = tl.where(is_tok, 1, tl.where(r_live_oob, 2, 3))
    safe_col = tl.where(is_tok | r_live_oob, 0, r_col)
    if ONE_CHUNK:  # from the tile in registers: no dependent load
        r_blk = tl.sum(tl.sum(tl.where(at[:, None] & (cols1[None, :] == safe_col), tab1, 0),
                              axis=1), axis=0)
    else:
        safe_row = tl.where(any_bad, row, 0)
        r_blk = tl.load(tables_ptr + safe_row * stride_tables + safe_col,
                        mask=any_bad & (code == 3), other=0)
    value = tl.where(code == 1, r_tok, tl.where(code == 2, r_live, r_blk))
    entry = tl.where(code == 3, r_col, -1)
    n_bad = tl.sum(bad.to(tl.int32), axis=0)
    first = any_bad & (flag_before == 0)
    tl.store(faults_ptr + 0, code, mask=first)
    tl.store(faults_ptr + 1, row, mask=first)
    tl.store(faults_ptr + 2, value, mask=first)
    tl.store(faults_ptr + 3, entry, mask=first)
    tl.store(faults_ptr + 4, n, mask=first)
    tl.store(faults_ptr + 5, n_bad, mask=first)
    tl.store(faults_ptr + 6, runs_before + 1, mask=any_bad)


def tile(n: int, m: int) -> tuple[int, int, bool]:
    """(BLOCK_N, BLOCK_M, ONE_CHUNK) for n rows of m table columns: the rows and columns padded
    to powers of two, the rows to at least MIN_BLOCK_N where that keeps a table that fits one
    tile in one (a padded row never turns the one-tile path into the chunked one); BLOCK_M
    COL_CHUNK where the table does not fit one tile."""
    block_n, block_m = triton.next_power_of_2(n), triton.next_power_of_2(max(m, 1))
    one = block_n * block_m <= ONE_TILE
    if max(block_n, MIN_BLOCK_N) * block_m <= ONE_TILE or not one:
        block_n = max(block_n, MIN_BLOCK_N)
    return block_n, block_m if one else COL_CHUNK, one


def input_guard(tokens: torch.Tensor, block_tables: torch.Tensor, live_rows: torch.Tensor,
                active: torch.Tensor, faults: torch.Tensor, g_tokens: torch.Tensor,
                g_tables: torch.Tensor, g_live: torch.Tensor, g_active: torch.Tensor, *,
                vocab: int, num_blocks: int, block_size: int, steps: int, scratch: int) -> None:
    """Guarded copies of the four inputs into g_*, and the fault record updated (module
    docstring). tokens, live_rows, active [n] int32; block_tables [n, M] int32; faults int32[8]."""
    check(block_tables.dim() == 2, lambda: f"{describe('block_tables', block_tables)}: expected [n, M]")
    n, m = block_tables.shape
    dev, i32 = tokens.device, (torch.int32,)
    for name, t in (("tokens", tokens), ("live_rows", live_rows), ("active", active),
                    ("g_tokens", g_tokens), ("g_live", g_live), ("g_active", g_active)):
        check_operand(name, t, (n,), i32, dev)
    check_operand("block_tables", block_tables, (n, m), i32, dev)
    check_operand("g_tables", g_tables, (n, m), i32, dev)
    check_operand("faults", faults, (FAULT_WORDS,), i32, dev)
    check(0 <= scratch < num_blocks and block_size > 0 and steps >= 1,
          lambda: f"scratch {scratch} must be a block of the pool [0, {num_blocks}); "
                  f"block_size {block_size} and steps {steps} must be >= 1")
    if n == 0:
        return
    block_n, block_m, one = tile(n, m)
    input_guard_kernel[(1,)](
        tokens, block_tables, live_rows, active, faults, g_tokens, g_tables, g_live, g_active,
        n, m, block_tables.stride(0), g_tables.stride(0),
        vocab, num_blocks, block_size, steps, scratch,
        BLOCK_N=block_n, BLOCK_M=block_m, ONE_CHUNK=one,
        TRIGGER=pdl_supported(tokens),
        num_warps=4 if block_n * min(block_m, COL_CHUNK) <= 4096 else 8,
    )
