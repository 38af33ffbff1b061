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
from typing import Callable, Sequence as Sequence_

import numpy as np
import torch

from draft_circuit.runners.device import HostCopy
from draft_circuit.runners.proposer_chunks import consecutive
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


@dataclass
class PassOut:
    """A target pass over several sequences: sequence i's greedy token after each of its rows,
    and the pass's drafter hiddens [rows, H] (on the target's device, the caller's to keep),
    sequence i's rows from starts[i] on. Kept whole: a view a sequence is host dispatch (on
    CUDA a few us each, in the step's bubble), so a step slices only the rows it uses."""

    tokens: list[list[int]]
    hidden: torch.Tensor
    starts: list[int]

    def rows_out(self, i: int) -> RowsOut:
        """Sequence i's slice (its hiddens a view of the pass's)."""
        at = self.starts[i]
        return RowsOut(self.tokens[i], self.hidden[at:at + len(self.tokens[i])])


class TargetRunner:
    def __init__(self, model: TargetModel) -> None:
        self.model = model

    def run(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> list[RowsOut]:
        """One logical pass over every sequence's new tokens (split into passes of at most
        max_rows rows, in row order, so a later chunk sees the KV an earlier one wrote)."""
        out = self.run_pass(seqs, new_tokens)
        return [out.rows_out(i) for i in range(len(seqs))]

    def run_pass(self, seqs: list[Sequence], new_tokens: list[list[int]]) -> PassOut:
        """`run`, its hiddens left as the pass's one tensor (`PassOut`): no view a sequence."""
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
        per_seq, starts, offset = [], [], 0
        for seq, c in zip(seqs, counts):
            _check_finite(seq, tokens[offset:offset + c])
            per_seq.append(tokens[offset:offset + c])
            starts.append(offset)
            offset += c
        return PassOut(per_seq, hidden, starts)

    def _rows(self, seqs: list[Sequence], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's RoPE position (its live rows too) and block table for sequence i's
        counts[i] rows from its num_cached on, as numpy arrays: a sequence's padded table row
        copied once (`PaddedBlocks.row`, kept by its table) and repeated over its rows, the
        positions one array expression (per-step host work: ~2 us a sequence, no list a row).
        Refuses a sequence whose rows would exceed the rows reserved for it."""
        tables = np.empty((len(seqs), self.model.kv.max_blocks_per_seq), dtype=np.int32)
        bases: list[int] = []
        for i, (seq, c) in enumerate(zip(seqs, counts)):
            blocks = seq.blocks
            base = blocks.num_rows  # num_cached
            if base + c > blocks.capacity_rows:
                raise RuntimeError(f"sequence {seq.id}: {base + c} rows exceed the "
                                   f"{blocks.capacity_rows} reserved for it")
            tables[i] = blocks.row
            bases.append(base)
        per_seq = np.asarray(counts, dtype=np.int64)  # sequence i's rows: bases[i] on
        return consecutive(bases, per_seq).astype(np.int32), np.repeat(tables, per_seq, axis=0)

    def verify_on_device(self, seqs: list[Sequence], tokens: torch.Tensor,
                         num_drafts: int) -> PassOut:
        """The target pass over every sequence's k + 1 rows [last token, k drafts], its tokens
        a device tensor (the proposer's verify input, row i's at i*(k+1)..): the rows `run`
        would build for the same tokens (row j of a sequence at position and live rows
        num_cached + j), with only positions and tables from the host. A row whose logits are
        all non-finite raises as there (FAULTS 27). Per sequence only its greedy tokens (a list
        slice); its hiddens stay rows of the pass's one tensor (no view a sequence: on CUDA
        each is host dispatch in the step's bubble)."""
        return self.read_verify(self.launch_verify(seqs, tokens, num_drafts))

    def launch_verify(self, seqs: list[Sequence], tokens: torch.Tensor, num_drafts: int,
                      prefill: Sequence_[Sequence] = ()) -> Launched:
        """`verify_on_device` with nothing read yet: the pass enqueued, its greedy tokens'
        copy to pinned host memory enqueued right behind it (an event after), so work the host
        enqueues next (the draft side, `MtpProposer.step_ahead`) runs on the GPU while the
        host waits only for the verify (`read_verify`). `prefill`: admitted sequences whose
        prompts ride in the same pass after the verify rows (`_merged_tokens`), as `run_pass`
        merges them on the host path; the pass must fit max_rows (the engine merges only then)."""
        k1 = num_drafts + 1
        counts = [k1] * len(seqs) + [len(s.request.prompt) for s in prefill]
        rows = [*seqs, *prefill] if prefill else seqs  # (no copy on a plain step)
        positions, row_tables = self._rows(rows, counts)
        if prefill:
            tokens = self._merged_tokens(tokens, prefill, sum(counts))
        pos = torch.from_numpy(positions)
        greedy, hidden = self.model.launch(
            TargetRows(tokens=tokens, positions=pos, block_tables=torch.from_numpy(row_tables),
                       live_rows=pos))
        return Launched(rows, k1, greedy, hidden, self._copy_out.enqueue(greedy),
                        counts if prefill else None)

    def _merged_tokens(self, verify: torch.Tensor, prefill: Sequence_[Sequence],
                       total: int) -> torch.Tensor:
        """A merged pass's tokens on the device: the proposer's verify input (a device-to-device
        copy, behind the chain that wrote it on this stream), then the admitted prompts (one
        host-to-device copy from a pinned buffer), in one buffer made once at max_rows. Both
        buffers are free to rewrite: the last pass was read (a sync) before this one launches
        (`TokensToHost`)."""
        rows = self.model.max_rows
        if total > rows:
            raise RuntimeError(f"a merged verify + prefill pass of {total} rows exceeds the "
                               f"target's {rows} (the engine merges only what fits)")
        got = self.__dict__.get("_merge_buffers")
        if got is None:
            device = verify.device
            dev = torch.zeros(rows, dtype=torch.int32, device=device)
            host = torch.zeros(rows, dtype=torch.int32, pin_memory=device.type == "cuda") \
                if device.type != "cpu" else dev
            got = self.__dict__["_merge_buffers"] = (dev, host)
        dev, host = got
        p = verify.shape[0]
        prompts = np.fromiter(itertools.chain.from_iterable(s.request.prompt for s in prefill),
                              np.int32, total - p)
        dev[:p].copy_(verify)
        host[p:total].copy_(torch.from_numpy(prompts))
        if host is not dev:
            dev[p:total].copy_(host[p:total], non_blocking=True)
        return dev[:total]

    def read_verify(self, launched: Launched) -> PassOut:
        """The launched verify's `PassOut` (waits for its greedy tokens' copy; -1 raises), its
        merged prompts' rows (`launch_verify`'s prefill) after the verify rows."""
        greedy, k1, seqs = launched.read(), launched.k1, launched.seqs
        if launched.counts is not None:  # a merged prefill: rows a sequence vary
            starts = list(itertools.accumulate(launched.counts[:-1], initial=0))
            per_seq = [greedy[a:a + c] for a, c in zip(starts, launched.counts)]
            if -1 in greedy:
                for seq, tokens in zip(seqs, per_seq):
                    _check_finite(seq, tokens)
            return PassOut(per_seq, launched.hidden, starts)
        if -1 in greedy:  # one scan of the pass; the sequence and row named as `run` names them
            i = greedy.index(-1) // k1
            _check_finite(seqs[i], greedy[i * k1:(i + 1) * k1])
        return PassOut([greedy[i:i + k1] for i in range(0, len(greedy), k1)], launched.hidden,
                       list(range(0, len(greedy), k1)))

    @property
    def _copy_out(self) -> TokensToHost:
        got = self.__dict__.get("_tokens_to_host")
        if got is None:
            got = self.__dict__["_tokens_to_host"] = TokensToHost(self.model.max_rows,
                                                                  self.model.device)
        return got


class TokensToHost:
    """Greedy tokens copied to pinned host memory behind their pass (CUDA: one non_blocking
    copy and an event; CPU: read when asked). One launched pass at a time: the next enqueue
    reuses the buffer, so a host reads each before launching the next."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(max_rows, dtype=torch.int32, pin_memory=True) if self.cuda \
            else None
        self.copied = HostCopy(device) if self.cuda else None
        self.unread = False  # a copy enqueued and not read yet

    def enqueue(self, greedy: torch.Tensor) -> Callable[[], list[int]]:
        """Enqueue the copy of `greedy` (int32 [n], on the device); returns its read."""
        if self.host is None:
            return greedy.tolist
        if self.unread:  # its buffer, and the target staging's mirror, are not free yet
            raise RuntimeError("a target pass was launched before the last one was read "
                               "(TargetRunner.read_verify): its greedy tokens would be overwritten")
        n = greedy.shape[0]
        host = self.host[:n]
        assert self.copied is not None
        self.copied.copy(host, greedy)
        self.unread = True

        def read() -> list[int]:
            assert self.copied is not None
            self.copied.wait()
            self.unread = False
            return host.tolist()
        return read


@dataclass
class Launched:
    """A verify launched and not read: its sequences (a merged prefill's after the verified
    ones), rows a sequence, the greedy tokens on the device (the runner's buffer: valid until
    the next pass), the hiddens, and the read."""

    seqs: list[Sequence]
    k1: int
    greedy: torch.Tensor
    hidden: torch.Tensor
    read: Callable[[], list[int]]
    counts: list[int] | None = None  # rows a sequence, with a merged prefill (else k1 each)


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
