"""The checks a `generate` makes of its requests before anything runs: each names the request
and what was wrong (`EngineError`), and a batch the KV pool cannot hold says how many fit."""
from __future__ import annotations

from typing import Callable, Sequence

from examples.engine.checkpoints import EngineError
from examples.engine.sequence import Request
from draft_circuit.runners.kv_cache import BlockPool


def check_requests(requests: Sequence[Request], *, vocab: int, max_seq_len: int,
                   blocks_for: Callable[[Request], int], pool: BlockPool, max_batch: int,
                   block_size: int) -> None:
    """Refuse an empty list, an empty prompt, a token outside [0, vocab), max_new_tokens < 1, a
    request longer than max_seq_len, and a max_batch whose longest requests' KV blocks
    (`blocks_for`) the pool cannot hold together."""
    if not requests:
        raise EngineError("no requests to generate for")
    for i, r in enumerate(requests):
        if not r.prompt:
            raise EngineError(f"request {i}: the prompt is empty")
        bad = next((t for t in r.prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineError(f"request {i}: token {bad} is outside the vocabulary [0, {vocab})")
        if r.max_new_tokens < 1:
            raise EngineError(f"request {i}: max_new_tokens must be >= 1, got {r.max_new_tokens}")
        if len(r.prompt) + r.max_new_tokens > max_seq_len:
            raise EngineError(f"request {i}: {len(r.prompt)} prompt + {r.max_new_tokens} new "
                              f"tokens exceed the {max_seq_len}-token limit")
    need = max(blocks_for(r) for r in requests)
    usable = pool.num_blocks - pool.num_reserved
    if max_batch * need > usable:
        raise EngineError(
            f"--max-batch {max_batch} needs {max_batch} x {need} KV blocks (of {block_size} "
            f"rows, for the longest request), but the pool holds {usable}: at most "
            f"{usable // need} such sequences fit; lower --max-batch or raise --kv-blocks")
