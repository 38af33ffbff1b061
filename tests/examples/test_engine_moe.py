"""The engine with an MoE draft layer (DeepSeek-V3 names): it drafts through MoeMtpHead and its
output is still the target's own greedy output, on both forwards."""
import dataclasses

import pytest

from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.moe import MoeConfig
from draft_circuit.circuit.layers.rope import RopeScaling
from helpers import generate, random_requests

CFG = MoeConfig(vocab_size=120, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("moe") / "ck", CFG, seed=3)


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_moe_draft_layer_keeps_the_output_exact(moe_checkpoint, forward):
    requests = random_requests(CFG.vocab_size, 4, seed=5)
    want, _ = generate(moe_checkpoint, requests, speculate=False, max_batch=2)
    got, engine = generate(moe_checkpoint, requests, forward=forward, num_drafts=3, max_batch=2,
                           widths=(1, 2))
    assert got == want
    assert type(engine.proposer.head).__name__ == "MoeMtpHead"


# YaRN over the target and its MoE MTP layer: positions run past original_max_position_embeddings
YARN = dataclasses.replace(CFG, max_position_embeddings=128, rope_scaling=RopeScaling(
    rope_type="yarn", theta=CFG.rope_theta, factor=4.0, original_max_position_embeddings=8))


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_yarn_moe_draft_layer_keeps_the_output_exact(tmp_path, forward):
    """The engine drafts with a YaRN MoE MTP layer (it refused one before the MoE head declared
    YaRN's frequency table) and its output is the target-only greedy output."""
    ck = write_random_checkpoint(tmp_path / "ck", YARN, seed=3)
    requests = random_requests(YARN.vocab_size, 4, seed=5)
    assert max(len(r.prompt) + r.max_new_tokens for r in requests) > 8  # past the original length
    want, _ = generate(ck, requests, speculate=False, max_batch=2)
    got, engine = generate(ck, requests, forward=forward, num_drafts=3, max_batch=2, widths=(1, 2))
    assert got == want
    head = engine.proposer.head
    assert type(head).__name__ == "MoeMtpHead" and head.config.rope_scaling.rope_type == "yarn"
    chain = engine.proposer.circuit_draft().circuit
    assert any(n.op == "rope_freqs" for n in chain.nodes)
