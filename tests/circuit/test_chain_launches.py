"""The dense MTP chain's launches per draft step (issue 15 item 1) and the fused chain against the
unfused eager oracle: the default pipeline's program equals the eager run of the circuit as the
head emits it, bitwise on CPU fp32 at widths 1, 3 and 8 (bitmask, confidence stop and embed
target on, so every fusion's optional path runs); with the Triton kernels under the interpreter
the launch-saving kernels are chosen and the drafts agree."""
import math

import pytest
import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights

CFG = MtpConfig(vocab_size=133, hidden_size=40, intermediate_size=72, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=60, block_size=8, max_blocks_per_seq=5)
K, MAX_WIDTH = 3, 8
# per step: embedding, enorm, hnorm, eh_proj (+concat), input_layernorm, q/k/v, rope_kv_write,
# attention, o_proj, add_rmsnorm, gate_up+silu, down_proj, add_rmsnorm, lm-head argmax (+keep);
# the two stacks once per chain
LAUNCHES_PER_STEP, PER_CHAIN = 14, 2


def chain(**kw):
    return emit_draft_chain(MtpHead(CFG), K, max_width=MAX_WIDTH, kv=KV, **kw)


def test_launches_per_step():
    c = chain()
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=1))
    compiled = compile_draft(c, params, [1, MAX_WIDTH])
    for w in (1, MAX_WIDTH):
        assert len(compiled.programs[w].launches) == LAUNCHES_PER_STEP * K + PER_CHAIN


def _run(c, compiled, width, params, seed):
    batch = random_draft_batch(CFG, KV, width, seed=seed, num_drafts=K, bitmask=True)
    batch.inputs["bitmask"][:, 0] |= 1
    batch.inputs["log_tau"] = torch.full((width,), math.log(0.02))
    want_states = {**batch.clone_states(), "embed_target": torch.zeros(MAX_WIDTH, CFG.hidden_size)}
    got_states = {k: v.clone() for k, v in want_states.items()}
    want = EagerRunner(c, params, want_states).run(batch.inputs)
    got = ProgramRunner(compiled, got_states).run(batch.inputs)
    return got, want, got_states, want_states


@pytest.mark.parametrize("width", [1, 3, 8])
def test_fused_chain_equals_the_unfused_eager_chain(width):
    c = chain(bitmask=True, embed_target=True, confidence_stop=True)
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=width))
    compiled = compile_draft(c, params, [width])
    got, want, got_states, want_states = _run(c, compiled, width, params, seed=width)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for k in want_states:
        assert torch.equal(got_states[k], want_states[k]), k


@pytest.mark.parametrize("width", [1, 3])
def test_interpreted_kernels_of_the_fused_chain(width):
    c = chain(bitmask=True, embed_target=True, confidence_stop=True)
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=20 + width))
    compiled = compile_draft(c, params, [width], options=CompileOptions(interpret_kernels=True))
    kernels = {x.kernel for x in compiled.programs[width].launches}
    assert {"triton_linear_qkv", "triton_linear_concat", "triton_linear_argmax_keep"} <= kernels
    got, want, got_states, want_states = _run(c, compiled, width, params, seed=width)
    assert torch.equal(got["drafts"], want["drafts"])
    torch.testing.assert_close(got["confidences"], want["confidences"], atol=1e-5, rtol=1e-5)
    for k in want_states:
        torch.testing.assert_close(got_states[k], want_states[k], atol=1e-5, rtol=1e-5)
