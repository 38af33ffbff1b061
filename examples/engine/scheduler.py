"""Policy: which requests run. FIFO admission while a batch slot is free and the target KV pool
can reserve the request's worst case; a finished sequence gives its blocks back at once, so the
next waiting request joins the running batch (continuous batching) and the width changes.

Reserving the worst case up front (prompt + max_new_tokens + num_drafts rows) means a running
sequence never runs out of KV mid-generation, so there is no preemption to get wrong.
"""
from __future__ import annotations

from collections import deque

from examples.engine.sequence import Request, Sequence
from draft_circuit.runners.kv_cache import BlockPool, PaddedBlocks


def worst_rows(request: Request, num_drafts: int) -> int:
    """Target KV rows a request can touch: its last verify writes num_drafts rows past the
    last token it keeps."""
    return len(request.prompt) + request.max_new_tokens + num_drafts


class Scheduler:
    def __init__(self, pool: BlockPool, block_size: int, max_blocks_per_seq: int, *,
                 max_batch: int, num_drafts: int, pad_block: int) -> None:
        self.pool, self.block_size, self.max_blocks = pool, block_size, max_blocks_per_seq
        self.pad_block = pad_block  # a reserved block of `pool`: what a table's tail points at
        self.max_batch, self.num_drafts = max_batch, num_drafts
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._next_id = 0

    def blocks_for(self, request: Request) -> int:
        return -(-worst_rows(request, self.num_drafts) // self.block_size)

    def add(self, request: Request) -> Sequence:
        # the table keeps its padded row as an array: the target stages it with one copy a step
        seq = Sequence(self._next_id, request, PaddedBlocks(self.pool, self.block_size,
                                                            self.max_blocks, self.pad_block))
        self._next_id += 1
        self.waiting.append(seq)
        return seq

    def can_admit(self) -> bool:
        """Whether `admit` would move a sequence now: one waits, a slot is free and its blocks
        are (FIFO: a request that does not fit yet holds back the ones behind it). Reads only
        this scheduler and its pool, so an engine that changes neither between two steps knows
        at the end of one whether the next admits anything."""
        return bool(self.waiting) and len(self.running) < self.max_batch \
            and self.blocks_for(self.waiting[0].request) <= self.pool.num_free

    def admit(self) -> list[Sequence]:
        """Move waiting sequences to running while `can_admit`."""
        admitted = []
        while self.can_admit():
            seq = self.waiting[0]
            seq.blocks.ensure_rows(worst_rows(seq.request, self.num_drafts))
            self.running.append(self.waiting.popleft())
            admitted.append(seq)
        return admitted

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.blocks.free()

    def restart_ids(self) -> None:
        """Number the next request 0 again (after `Engine.warm_up`: the ids a user's error
        messages name are their own requests' order); only when nothing is queued or running."""
        if self.has_work:
            raise RuntimeError("sequence ids restart only when no sequence is queued or running")
        self._next_id = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
