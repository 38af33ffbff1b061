"""`--draft-vocab N` on the byte-level embedded default (issue 18): N ids counted over its own
training text (the standard library's sources, held-out files excluded), most frequent first;
drafting over half the bytes leaves the output target-only greedy decoding's, and every draft is
a subset id."""
from __future__ import annotations

import torch

from examples.engine import Engine, EngineConfig, load_checkpoint
from examples.engine.checkpoints import default_prompts, draft_vocab_for, encode_prompts
from examples.engine.sequence import Request


def test_half_the_bytes_from_the_training_text_keep_the_output():
    ck = load_checkpoint(None)
    vocab = draft_vocab_for("128", ck)
    assert vocab.size == 128 and vocab.ids[0] == ord(" ")  # Python source: spaces first
    assert {ord(c) for c in "abcdefghijklmnopqrstuvwxyz():=_"} <= set(vocab.ids)
    requests = [Request(p, 16) for p in encode_prompts(default_prompts(ck), ck)[:4]]
    full = Engine(ck, EngineConfig(forward="eager", max_batch=4)).generate(requests)
    engine = Engine(ck, EngineConfig(forward="eager", max_batch=4, draft_vocab=vocab))
    half = engine.generate(requests)
    assert half.outputs == full.outputs and half.stats.drafted > 0
    state = engine.proposer.alloc_state()
    h = torch.randn(1, ck.config.hidden_size)
    drafts = engine.proposer.propose_batch([ord("d")], h, [3], 4, [state])
    assert drafts is not None and all(t in set(vocab.ids) for t in drafts[0])
