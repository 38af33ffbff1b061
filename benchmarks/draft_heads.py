"""The draft-chain benchmark's heads beyond the plain MTP layer: an MTP head over a reduced draft
vocabulary (`DRAFT_VOCABS`: config name -> subset size; FR-Spec's 32,768 ids for the 8B chain)
and the EAGLE-3 drafter at its published 8B shapes (`EAGLE3_8B`, yuhuili/EAGLE3-LLaMA3.1-Instruct-8B:
hidden 4096, intermediate 14336, 32/8 heads of 128, vocabulary 128256, draft vocabulary 32000).
Their heads, random weights and the weight bytes a chain must read (benchmarks/draft_chain.py).

Which ids a subset holds does not change its cost, so a seeded random list stands in for a
corpus-built one (circuit/layers/draft_vocab.py builds real ones).
"""
from __future__ import annotations

import math

import torch

from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES, MtpConfig
from draft_circuit.circuit.layers.draft_vocab import DraftVocab
from draft_circuit.circuit.layers.eagle3 import Eagle3Config, Eagle3Head, eagle3_checkpoint_shapes
from draft_circuit.circuit.layers.mtp import MtpHead

EAGLE3_8B = Eagle3Config(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rms_norm_eps=1e-5, rope_theta=500000.0, num_hidden_layers=1,
                         tie_word_embeddings=False, max_position_embeddings=2048,
                         draft_vocab_size=32000, target_hidden_size=4096)
DRY_EAGLE3 = Eagle3Config(vocab_size=384, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                          num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                          draft_vocab_size=100, target_hidden_size=48)
DRAFT_VOCABS = {"8b_vocab32k": 32768, "tiny_vocab": 96}  # config name -> reduced vocabulary size
FULL_VOCAB_PEER = {"8b_vocab32k": "8b", "tiny_vocab": "tiny"}  # the same head over every id


def is_eagle3(config: MtpConfig) -> bool:
    return isinstance(config, Eagle3Config)


def head_bytes(config: MtpConfig, dtype_bytes: int, draft_vocab: int | None) -> tuple[int, int]:
    """(bytes every step reads in full, bytes the chain reads once): all weights but the embedding
    table (its gathered rows count with the activations), the lm-head over its draft rows; for
    EAGLE-3, `fc` is read once (step 0) and the rest every step."""
    if is_eagle3(config):
        shapes = eagle3_checkpoint_shapes(config)  # lm_head: draft_vocab_size rows already
        once = math.prod(shapes.pop("fc.weight")) * dtype_bytes
        rows = draft_vocab or config.draft_vocab_size
        shapes["lm_head.weight"] = (rows, config.hidden_size)
    else:
        shapes, once = dict(MTP_PARAM_SHAPES(config)), 0
        if draft_vocab:
            shapes["shared_head.head.weight"] = (draft_vocab, config.hidden_size)
    step = sum(math.prod(s) for name, s in shapes.items() if name != "embed_tokens.weight") * dtype_bytes
    return step, once


def hidden_in(config: MtpConfig) -> int:
    """The width of the chain's `hidden` input: 3 tapped target hiddens for EAGLE-3."""
    return 3 * config.target_hidden_size if isinstance(config, Eagle3Config) else config.hidden_size


def make_head(config: MtpConfig, dtype_name: str) -> MtpHead:
    return Eagle3Head(config, dtype_name) if isinstance(config, Eagle3Config) else MtpHead(config, dtype_name)


def random_eagle3_weights(config: Eagle3Config, device: torch.device, dtype: torch.dtype,
                          seed: int) -> dict[str, torch.Tensor]:
    """Stored-name weights scaled as the MTP ones (norms near 1, projections 1/sqrt(fan-in)) and
    a d2t of ascending random target ids."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in eagle3_checkpoint_shapes(config).items():
        t = torch.randn(shape, generator=g, device=device, dtype=dtype)
        if len(shape) == 1:
            t.mul_(0.1).add_(1.0)
        elif "embed" not in name:
            t.mul_(1.0 / math.sqrt(shape[-1]))
        out[name] = t
    targets = torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))
    targets = targets[:config.draft_vocab_size].sort().values
    out["d2t"] = (targets - torch.arange(config.draft_vocab_size)).to(device)
    return out


def subset_vocab(vocab_size: int, size: int, seed: int) -> DraftVocab:
    ids = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))[:size]
    return DraftVocab(tuple(ids.tolist()), vocab_size, f"random {size} of {vocab_size}")
