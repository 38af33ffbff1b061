"""Kernel bindings end to end: the whole chain planned with Triton kernels (run by the
interpreter on CPU) against the eager oracle, with bitmask, confidence stop and embed target."""
import math

import pytest
import torch

from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights

CFG = MtpConfig(vocab_size=133, hidden_size=40, intermediate_size=72, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=60, block_size=8, max_blocks_per_seq=5)
K = 3


@pytest.mark.parametrize("width", [1, 4])
def test_triton_chain_matches_eager(width):
    head = MtpHead(CFG)
    chain = emit_draft_chain(head, K, max_width=4, kv=KV, bitmask=True, embed_target=True,
                             confidence_stop=True)
    params = head.bind(random_mtp_weights(CFG, seed=9))
    compiled = compile_draft(chain, params, [width], options=CompileOptions(interpret_kernels=True))
    kernels = {x.kernel for x in compiled.programs[width].launches}
    assert {"triton_rope_kv_write", "triton_decode_attention", "triton_linear",
            "triton_add_rmsnorm", "triton_linear_argmax_logprob"} <= kernels
    batch = random_draft_batch(CFG, KV, width, seed=width, num_drafts=K, bitmask=True)
    batch.inputs["bitmask"][:, 0] |= 1  # token 0 allowed: no all-masked row here
    batch.inputs["log_tau"] = torch.full((width,), math.log(0.004))
    want_states = {**batch.clone_states(), "embed_target": torch.zeros(4, CFG.hidden_size)}
    got_states = {k: v.clone() for k, v in want_states.items()}
    want = EagerRunner(chain, params, want_states).run(batch.inputs)
    got = ProgramRunner(compiled, got_states).run(batch.inputs)
    assert torch.equal(got["drafts"], want["drafts"])
    torch.testing.assert_close(got["confidences"], want["confidences"], atol=1e-5, rtol=1e-5)
    for k in want_states:
        torch.testing.assert_close(got_states[k], want_states[k], atol=1e-5, rtol=1e-5)
