"""The tiny dense MTP drafter the runner tests draft with (one layer, hidden 32, two query heads
over one KV head of 16 dims, fp32), and its chain compiled at a few widths, written once for the
runner tests (and the draft-vocabulary tests) that each spelled them out."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompiledDraft, compile_draft
from draft_circuit.runners.testing import random_mtp_weights


def tiny_config(vocab_size: int = 150) -> MtpConfig:
    return MtpConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                     num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512)


def tiny_chain(config: MtpConfig, kv: KvLayout, num_drafts: int, widths: Sequence[int], *, seed: int,
               **emit: Any) -> tuple[Circuit, dict[str, torch.Tensor], CompiledDraft]:
    """(chain, params, compiled): MtpHead(config)'s chain of `num_drafts` steps up to the widest of
    `widths` (`emit`: emit_draft_chain's options, e.g. embed_target), its random_mtp_weights(seed)
    bound, and the CPU plan for `widths`."""
    head = MtpHead(config)
    chain = emit_draft_chain(head, num_drafts, max_width=max(widths), kv=kv, **emit)
    params = head.bind(random_mtp_weights(config, seed=seed))
    return chain, params, compile_draft(chain, params, list(widths))
