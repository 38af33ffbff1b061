"""`input_guard`: a draft chain's runner inputs checked by value on the device, with no host sync
(issue 19 item 1; FAULTS 20, 25). The runners run it first in every run (runners/input_guard.py):
it writes guarded copies of tokens, block_tables, live_rows and active, in which a bad row is
inert (token 0, live 0, active 0, every table entry the scratch block), and records the first
fault in a sticky int32[8] record the host reads at its next sync. The contract, word by word, is
kernels/input_guard.py's docstring; this module's reference is the oracle its Triton kernel
equals bit for bit. Not an op layers emit: the runners add it, so a plan's launches per draft
step do not count it (it is one launch per run).
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.bindings import TRITON, Applies, KernelBinding, Tensors, kernel
from draft_circuit.ops.registry import LAYOUT, Cost, OpDef, check, rank, register

FAULT_WORDS = 8
#: fault codes in word 0 of the record, and the input each names
FAULT_INPUTS: dict[int, str] = {1: "tokens", 2: "live_rows", 3: "block_tables"}


class GuardAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    vocab: int          # 0: tokens unchecked (a chain without the embedding table)
    num_blocks: int
    block_size: int
    steps: int          # KV rows the chain writes past live_rows
    scratch_block: int  # where a fixed row's table points

    def model_post_init(self, _: object) -> None:  # else the guard itself would leave the pool
        if not (self.vocab >= 0 and self.block_size >= 1 and self.steps >= 1
                and 0 <= self.scratch_block < self.num_blocks):
            raise ValueError(f"input_guard needs vocab >= 0, block_size and steps >= 1 and the "
                             f"scratch block in the pool [0, {self.num_blocks}); got {self}")


def _infer(ins: list[TensorSpec], a: GuardAttrs) -> list[TensorSpec]:
    tokens, tables, live, active, faults = ins
    rank(tables, 2, "block tables [n, max_blocks]")
    for s in (tokens, live, active):
        check(s.dtype == "int32" and s.shape == (tables.shape[0],),
              lambda: f"tokens, live_rows and active must be int32[{tables.shape[0]}], got {s}")
    check(tables.dtype == "int32", lambda: f"block tables must be int32, got {tables}")
    check(faults.dtype == "int32" and faults.shape == (FAULT_WORDS,),
          lambda: f"the fault record must be int32[{FAULT_WORDS}], got {faults}")
    return [tokens, tables, live, active, faults]


_THRESHOLDS: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}


def _thresholds(m: int, block_size: int, steps: int, device: torch.device) -> torch.Tensor:
    """[m] int64: entry c is one a row uses iff its live_rows >= c * block_size - steps + 1
    (c < (live + steps - 1) // block_size + 1), for an in-range live; cached by shape (issue 20)."""
    key = (m, block_size, steps, device)
    t = _THRESHOLDS.get(key)
    if t is None:
        t = torch.arange(m, device=device, dtype=torch.int64) * block_size - (steps - 1)
        if len(_THRESHOLDS) < 64:
            _THRESHOLDS[key] = t
    return t


_ROWS: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}


def _rows(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[n] int64 row ids and [n] int64 n (word 4 of every row's record), cached by shape."""
    key = (n, device)
    got = _ROWS.get(key)
    if got is None:
        got = (torch.arange(n, device=device), torch.full((n,), n, device=device))
        if len(_ROWS) < 64:
            _ROWS[key] = got
    return got


def input_guard_ref(tokens: torch.Tensor, tables: torch.Tensor, live: torch.Tensor,
                    active: torch.Tensor, faults: torch.Tensor,
                    a: GuardAttrs) -> tuple[torch.Tensor, ...]:
    """The guarded copies and the updated record (kernels/input_guard.py's contract); no host
    reads, so it is capturable too. Written in few torch ops (issue 20: on CPU each costs
    microseconds): "outside [lo, hi]" is clamp(lo, hi) != x, and a row's fault words are picked
    per row first, then at the faulting row by one max (whose index is the first maximum)."""
    n, m = tables.shape
    big = torch.iinfo(torch.int32).max
    act = active != 0
    tok_bad = tokens.clamp(0, min(a.vocab - 1, big)) != tokens if a.vocab > 0 else torch.zeros_like(act)
    cap = m * a.block_size - a.steps
    live_oob = live.clamp(0, min(cap, big)) != live if cap >= 0 else torch.ones_like(act)
    if m:
        # an out-of-range live uses no entry in the contract; here its entries are not masked
        # out, since a row whose live is out of range is fixed, and faulted as live_rows, whatever
        # its entries hold
        oob = (live.unsqueeze(1) >= _thresholds(m, a.block_size, a.steps, live.device)) & \
            (tables.clamp(0, min(a.num_blocks - 1, big)) != tables)
        blk_oob, first_col = oob.max(1)  # the first out-of-pool entry a row uses
    else:
        blk_oob, first_col = torch.zeros_like(act), torch.zeros_like(tokens, dtype=torch.int64)
    bad_live = live_oob | blk_oob
    flagged = act & bad_live
    bad = tok_bad | flagged
    fix = tok_bad | bad_live  # = bad | live_oob | blk_oob
    guarded = (tokens.masked_fill(fix, 0), tables.masked_fill(fix.unsqueeze(1), a.scratch_block),
               live.masked_fill(fix, 0), active.masked_fill(fix, 0))
    if n == 0:
        return (*guarded, faults)

    # each row's words 0..3 were it the faulting row: code, row, value, entry
    blk = tables.gather(1, first_col.unsqueeze(1)).view(-1) if m else torch.zeros_like(tokens)
    code = torch.where(tok_bad, 1, torch.where(live_oob, 2, 3))
    value = torch.where(tok_bad, tokens, torch.where(live_oob, live, blk))
    entry = torch.where(tok_bad | live_oob, -1, first_col)
    # the faulting row: the lowest with a bad token, else the lowest flagged one (any_bad: it exists)
    any_bad, row = torch.where(tok_bad.any(), tok_bad, flagged).max(0)
    rows, width = _rows(n, tokens.device)
    words = torch.cat([torch.stack([code, rows, value, entry, width], 1)[row.view(1)].view(-1),
                       bad.sum().view(1)])
    # the first faulted run writes words 0..5 (7 stays); every faulted run counts in word 6
    faults[:6] = torch.where(any_bad & (faults[0] == 0), words, faults[:6])
    faults[6:7].add_(any_bad)
    return (*guarded, faults)


_k_guard = kernel("input_guard", "input_guard")


def _launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    tokens, tables, live, active, faults = ins
    _k_guard()(tokens, tables, live, active, faults, outs[0], outs[1], outs[2], outs[3],
               vocab=a.vocab, num_blocks=a.num_blocks, block_size=a.block_size, steps=a.steps,
               scratch=a.scratch_block)


register(OpDef(
    name="input_guard", inputs=("tokens", "block_tables", "live_rows", "active", "faults"),
    outputs=("tokens", "block_tables", "live_rows", "active", "faults"), attrs=GuardAttrs,
    infer=_infer, reference=lambda t, a: input_guard_ref(t[0], t[1], t[2], t[3], t[4], a),
    mutates={4: 4},
    cost=lambda ins, outs, a, ctx, env: Cost(sum(s.nbytes(env) for s in ins[:4]),
                                              sum(s.nbytes(env) for s in outs[:4]), 0),
    tags=frozenset({LAYOUT}),
    kernels=(KernelBinding("triton_input_guard", _launch, Applies(TRITON)),),
))
