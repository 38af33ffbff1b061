"""Planning a dense MTP chain at a real checkpoint's shapes without its weights (meta tensors,
planned for CUDA on any machine): which kernels a plan binds and how many GPU launches a step
it counts, for the tests of shape-chosen bindings (tests/kernels/test_linear_fused_splitk.py,
tests/ops/test_lm_head_prenorm.py)."""
from __future__ import annotations

import torch

from draft_circuit.circuit.layers.mtp import KvLayout, MtpConfig, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import compile_draft


def plan_kernels(op_prefix: str, *, vocab: int, hidden: int, inter: int, heads: int, kv_heads: int,
                 head_dim: int, widths: tuple[int, ...] = (1, 8)) -> dict[int, tuple[set[str], float]]:
    """{width: (kernels bound to the ops named op_prefix*, GPU launches a step)} of a 3-step bf16
    chain over those shapes."""
    cfg = MtpConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                    rms_norm_eps=1e-5, rope_theta=500000.0, num_hidden_layers=1,
                    tie_word_embeddings=False, max_position_embeddings=8192)
    head = MtpHead(cfg, "bfloat16")
    params = {k: torch.empty(s, dtype=torch.bfloat16, device="meta")
              for k, (_, s) in head.param_specs().items()}
    chain = emit_draft_chain(head, 3, max_width=max(widths), kv=KvLayout(60, 8, 5))
    compiled = compile_draft(chain, params, list(widths), device="cuda")
    return {w: ({x.kernel for x in compiled.programs[w].launches if x.op.startswith(op_prefix)},
                compiled.report().width(w).gpu_launches_per_step) for w in widths}
