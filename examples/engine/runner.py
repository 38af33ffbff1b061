"""Mechanism: turn sequences' new tokens into target rows, run the target, hand back each
sequence's greedy tokens and hiddens.

A sequence contributing tokens x_0..x_m (at positions num_cached..num_cached+m) gives m+1 rows
sharing its block table, row i with live_rows num_cached + i: it writes KV row num_cached + i
and attends to every row before it and itself. Prefill (num_cached 0, the prompt), verify
([last token, drafts...]) and plain decode (the last token) are all this one call; a verify
whose tokens are already on the device (the proposer's drafts) is `verify_on_device`.

A row whose logits hold no finite value (argmax_logprob's token -1: NaN/Inf in the target's
weights or state) raises `NonFiniteLogitsError` naming the request and step (FAULTS 27): the -1
never reaches a sequence, the drafter or the output.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from examples.engine.model import TargetModel, TargetRows
from examples.engine.sequence import Sequence

SCRATCH_BLOCK = 0  # reserved in the target pool: what a table's unused tail points at


class NonFiniteLogitsError(RuntimeError):
    """A target row's logits were all non-finite (NaN/Inf): no greedy token exists."""


@dataclass
class RowsOut:
    """One sequence's slice of a target pass."""

    tokens: list[int]       # the greedy token after each row
    hiddens: torch.Tensor   # [rows, H], final-norm hiddens (on the target's device)


class TargetRunner:
    def __init__(self, model: TargetModel) -> None:
        self.model = model

    def run(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> list[RowsOut]:
        """One logical pass over every sequence's new tokens (split into passes of at most
        max_rows rows, in row order, so a later chunk sees the KV an earlier one wrote)."""
        counts = [len(t) for t in new_tokens]
        total = sum(counts)
        positions, row_tables = self._rows(seqs, counts)
        flat_tokens = np.fromiter(itertools.chain.from_iterable(new_tokens), np.int32, total)
        tokens: list[int] = []
        hiddens = []
        step = self.model.max_rows
        for start in range(0, total, step):
            end = min(start + step, total)
            pos = torch.from_numpy(positions[start:end])
            rows = TargetRows(tokens=torch.from_numpy(flat_tokens[start:end]), positions=pos,
                              block_tables=torch.from_numpy(row_tables[start:end]), live_rows=pos)
            t, h = self.model.forward(rows)
            tokens += t
            hiddens.append(h)
        hidden = torch.cat(hiddens) if len(hiddens) > 1 else hiddens[0]
        out, offset = [], 0
        for seq, toks in zip(seqs, new_tokens):
            _check_finite(seq, tokens[offset:offset + len(toks)])
            out.append(RowsOut(tokens[offset:offset + len(toks)], hidden[offset:offset + len(toks)]))
            offset += len(toks)
        return out

    def _rows(self, seqs: list[Sequence], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's RoPE position (its live rows too) and block table for sequence i's
        counts[i] rows from its num_cached on, as numpy arrays (a sequence's table made once,
        repeated over its rows; the target stages them through numpy views, no Python list a
        row). Refuses a sequence whose rows would exceed the rows reserved for it."""
        tables = np.empty((len(seqs), self.model.kv.max_blocks_per_seq), dtype=np.int32)
        positions = np.empty(sum(counts), dtype=np.int32)
        at = 0
        for i, (seq, c) in enumerate(zip(seqs, counts)):
            base = seq.num_cached
            if base + c > seq.blocks.capacity_rows:
                raise RuntimeError(f"sequence {seq.id}: {base + c} rows exceed the "
                                   f"{seq.blocks.capacity_rows} reserved for it")
            tables[i] = seq.blocks.table_row(SCRATCH_BLOCK)
            positions[at:at + c] = np.arange(base, base + c, dtype=np.int32)
            at += c
        return positions, np.repeat(tables, counts, axis=0)

    def verify_on_device(self, seqs: list[Sequence], tokens: torch.Tensor,
                         num_drafts: int) -> list[RowsOut]:
        """The target pass over every sequence's k + 1 rows [last token, k drafts], its tokens
        a device tensor (the proposer's verify input, row i's at i*(k+1)..): the rows `run`
        would build for the same tokens (row j of a sequence at position and live rows
        num_cached + j), with only positions and tables from the host. A row whose logits are
        all non-finite raises as there (FAULTS 27)."""
        k1 = num_drafts + 1
        positions, row_tables = self._rows(seqs, [k1] * len(seqs))
        pos = torch.from_numpy(positions)
        greedy, hidden = self.model.forward(
            TargetRows(tokens=tokens, positions=pos, block_tables=torch.from_numpy(row_tables),
                       live_rows=pos))
        outs = []
        for i, s in enumerate(seqs):
            toks = greedy[i * k1:(i + 1) * k1]
            _check_finite(s, toks)
            outs.append(RowsOut(toks, hidden[i * k1:(i + 1) * k1]))
        return outs


def _check_finite(seq: Sequence, tokens: list[int]) -> None:
    """The first row of `seq` whose greedy token is -1 (only a row with no finite logit gives
    it: the target has no mask), named by request and step (the generated token it would be)."""
    if -1 in tokens:
        i = tokens.index(-1)
        position = seq.num_cached + i
        step = position + 2 - seq.num_prompt  # 1: the token after the prompt's last
        at = f"decode step {step} (the request's generated token {step})" if step >= 1 else \
            "prefill"
        raise NonFiniteLogitsError(
            f"request {seq.id}: the target's logits at position {position}, {at}, are all "
            f"non-finite (NaN/Inf), so no token can be chosen; check the target checkpoint's "
            f"weights for NaN/Inf")
