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


def input_guard_ref(tokens: torch.Tensor, tables: torch.Tensor, live: torch.Tensor,
                    active: torch.Tensor, faults: torch.Tensor,
                    a: GuardAttrs) -> tuple[torch.Tensor, ...]:
    """The guarded copies and the updated record (kernels/input_guard.py's contract); no host
    reads, so it is capturable too."""
    n, m = tables.shape
    big = torch.iinfo(torch.int32).max
    act = active != 0
    tok_bad = (tokens < 0) | (tokens >= a.vocab) if a.vocab > 0 else torch.zeros_like(act)
    live_oob = (live < 0) | (live > m * a.block_size - a.steps)
    used = torch.where(live_oob, 0, torch.div(live + a.steps - 1, a.block_size,
                                              rounding_mode="floor") + 1)
    cols = torch.arange(m, device=tables.device, dtype=torch.int32)
    oob = (cols[None, :] < used[:, None]) & ((tables < 0) | (tables >= a.num_blocks))
    first_col = torch.where(oob, cols[None, :], big).amin(1) if m else \
        torch.full_like(tokens, big)
    blk_oob = first_col < big
    flagged = act & (live_oob | blk_oob)
    bad = tok_bad | flagged
    fix = bad | live_oob | blk_oob
    zero = torch.zeros_like(tokens)
    g_tables = torch.where(fix[:, None], torch.full_like(tables, a.scratch_block), tables)
    guarded = (torch.where(fix, zero, tokens), g_tables, torch.where(fix, zero, live),
               torch.where(fix, zero, active))

    if n == 0:
        return (*guarded, faults)
    dev = tokens.device
    rows = torch.arange(n, device=dev, dtype=torch.int32)
    tok_row = torch.where(tok_bad, rows, big).amin()
    other_row = torch.where(flagged, rows, big).amin()
    is_tok = tok_row < big
    any_bad = is_tok | (other_row < big)
    row = torch.where(is_tok, tok_row, other_row)
    at = rows == row
    r_live_oob = (at & live_oob).any()
    r_col = torch.where(at, first_col, 0).sum()
    code = torch.where(is_tok, 1, torch.where(r_live_oob, 2, 3))
    r_blk = torch.where(at[:, None] & (cols[None, :] == r_col), tables, 0).sum()
    value = torch.where(code == 1, torch.where(at, tokens, 0).sum(),
                        torch.where(code == 2, torch.where(at, live, 0).sum(), r_blk))
    entry = torch.where(code == 3, r_col, -1)
    words = (code, row, value, entry, torch.tensor(n, device=dev), bad.sum(), faults[6], faults[7])
    record = torch.stack([w.to(torch.int32) for w in words])
    new = torch.where(any_bad & (faults[0] == 0), record, faults)
    new[6] = faults[6] + any_bad.to(torch.int32)
    faults.copy_(new)
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
