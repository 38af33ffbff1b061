"""The dummy requests `Engine.warm_up` generates for and forgets, so that the first real request
does not pay the process's one-time work: CUDA's lazily loaded kernel modules (torch's and
Triton's launched outside the graphs), pinned buffers made at first use, the first launch of each
kind of pass. On the H100 a fresh quick-start engine's first generate took ~7 ms more than its
second; its first prefill, catch-up, propose and verify each ran 0.7-2.7 ms over their later
calls (benchmarks/engine_warm.py; benchmarks/RESULTS.md, eleventh session). Serving engines do
the same at startup.

The requests cover what a run meets: one more than a batch (an admission beside a running
batch), finishing at different steps (every batch width down to one), the first prompt longer
than the drafter's widest program (a split catch-up). Each shrinks (prompt halved, then fewer new
tokens) until a batch of it passes `check_requests` (the pool, the length limit); one that never
does is left out. After the warm-up nothing is held: every KV block and drafter state is freed,
the statistics and sequence ids start from zero, and the next generate's output is a fresh
engine's (tests/examples/test_engine_warm_up.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from examples.engine.sequence import Request

if TYPE_CHECKING:
    from examples.engine.engine import Engine


def dummy_requests(engine: "Engine") -> list[Request]:
    """The warm-up's requests for `engine` (empty where not even one token fits)."""
    vocab, batch = engine.checkpoint.config.vocab_size, engine.config.max_batch
    # the first prompt's catch-up splits past the drafter's widest program; target-only, a
    # prompt over two KV blocks
    widest = (engine.proposer.max_width if engine.proposer is not None
              else 2 * engine.config.block_size)
    usable = engine.pool.num_blocks - engine.pool.num_reserved

    def fits(r: Request) -> bool:  # a batch of it fits the pool and the length limit
        return (len(r.prompt) + r.max_new_tokens <= engine.max_seq_len
                and batch * engine.scheduler.blocks_for(r) <= usable)

    requests = []
    for i in range(batch + 1):
        # >= 2 new tokens: every request decodes at least once after its prefill
        new, length = 2 + 2 * i, widest + 3 if i == 0 else 2 + i
        while length > 1 and not fits(Request([0] * length, new)):
            length //= 2
        while new > 2 and not fits(Request([0] * length, new)):
            new -= 1
        if fits(Request([0] * length, new)):
            requests.append(Request([(7 * j + 3 * i + 1) % vocab for j in range(length)], new))
    return requests
