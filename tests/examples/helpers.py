"""Helpers the engine's tests share: a small random config in the Llama + DeepSeek-V3 MTP
layout, random requests of varied lengths, one-call generation, and a target whose first verify
ends in a row with no finite logit."""
from __future__ import annotations

import dataclasses

import torch

from examples.engine import Engine, EngineConfig, Request, load_checkpoint
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG

# GQA (6 query heads over 2 kv heads), head_dim 24 (not a power of two), non-default rope_theta
SMALL = dataclasses.replace(DEFAULT_CONFIG, hidden_size=96, intermediate_size=160,
                            num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                            rope_theta=50000.0, num_hidden_layers=2)


def random_requests(vocab: int, count: int, seed: int, *, max_prompt: int = 30,
                    min_prompt: int = 1, max_new: tuple[int, int] = (4, 24)) -> list[Request]:
    """Prompts of varied lengths and varied max_new_tokens, so sequences finish at different
    steps and the batch width changes from step to step."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(min_prompt, max_prompt + 1, (1,), generator=g))
        new = int(torch.randint(max_new[0], max_new[1] + 1, (1,), generator=g))
        out.append(Request(torch.randint(0, vocab, (length,), generator=g).tolist(), new))
    return out


def generate(path, requests, **config) -> tuple[list[list[int]], Engine]:
    engine = Engine(load_checkpoint(path, with_mtp=config.get("speculate", True)), EngineConfig(**config))
    return engine.generate(requests).outputs, engine


def nan_at_first_verify(engine: Engine, monkeypatch, row: int = -1) -> list[int]:
    """Patch the engine's target so its second pass (the first verify, after the prefill)
    returns -1 (no finite logit) for its row `row` (default the last); returns the list of each
    pass's row count. (`launch` is the pass; `forward`, which the host path calls, reads what
    it returns.)"""
    launch, calls = engine.target.model.launch, []

    def later_nan(rows):
        tokens, hidden = launch(rows)
        calls.append(len(tokens))
        if len(calls) == 2:  # the first verify: that row has no finite logit
            tokens = tokens.clone()
            tokens[row] = -1
        return tokens, hidden
    monkeypatch.setattr(engine.target.model, "launch", later_nan)
    return calls
