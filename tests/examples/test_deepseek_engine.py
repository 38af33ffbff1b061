"""The engine's DeepSeek-V3 target (MLA + MoE from the layer library) against transformers on a
tiny random checkpoint written in DeepSeek-V3's exact layout (save_pretrained plus the MTP layer
under its real names), fp32, CPU: the target alone (eager and circuit) is token-exact with
DeepseekV3ForCausalLM.generate greedy, at positions past original_max_position_embeddings, and
speculative decoding through the engine's own path (load_checkpoint reads the DeepSeek-V3
layout, Engine builds the target with target_for and the head with heads.head_for) and
DeepseekMtpHead (both drafter forwards) gives the same ids.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_circuit.circuit.layers.checkpoint import read_config
from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead
from draft_circuit.circuit.layers.deepseek_checkpoint import load_deepseek_target_weights
from draft_circuit.circuit.layers.mtp import KvLayout
from examples.engine import Engine, EngineConfig, load_checkpoint
from examples.engine.deepseek_target import DeepseekTargetModel, target_for
from examples.engine.sequence import Request
from tests.examples.greedy_reference import PROMPTS, assert_same_greedy, assert_target_alone_matches, generate_greedy
from tests.layers.test_deepseek_checkpoint import real_layout

transformers = pytest.importorskip("transformers")
NEW = 14  # prompts + new tokens reach position 23; original_max_position_embeddings is 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return real_layout(tmp_path_factory.mktemp("v3") / "ckpt")


def hf_greedy(root, prompt):
    model = transformers.DeepseekV3ForCausalLM.from_pretrained(str(root), torch_dtype=torch.float32,
                                                               attn_implementation="eager").eval()
    return generate_greedy(model, prompt, NEW, attention_mask=False)


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_target_alone_equals_transformers_generate(checkpoint, forward):
    config = read_config(checkpoint)
    kv = KvLayout(num_blocks=32, block_size=4, max_blocks_per_seq=8)
    target = target_for(config, load_deepseek_target_weights(checkpoint), kv, max_rows=16, forward=forward)
    assert isinstance(target, DeepseekTargetModel)
    assert_target_alone_matches(target, PROMPTS, NEW, lambda prompt: hf_greedy(checkpoint, prompt))


@pytest.mark.parametrize("drafter, target", [("eager", "eager"), ("circuit", "eager"), ("circuit", "circuit")])
def test_speculative_decoding_equals_transformers_generate(checkpoint, drafter, target):
    # transformers' config names an eos id; the reference generates past it (eos_token_id=None)
    ckpt = dataclasses.replace(load_checkpoint(checkpoint), eos_token_id=None)
    engine = Engine(ckpt, EngineConfig(forward=drafter, target_forward=target, num_drafts=3, max_batch=3,
                                       kv_blocks=64, block_size=4, widths=(1, 2, 4), max_rows=64))
    assert isinstance(engine.target.model, DeepseekTargetModel)
    assert isinstance(engine.proposer.head, DeepseekMtpHead)
    result = engine.generate([Request(p, NEW) for p in PROMPTS])
    assert result.stats.drafted > 0
    for prompt, ours in zip(PROMPTS, result.outputs):
        theirs, gaps = hf_greedy(checkpoint, prompt)
        assert_same_greedy(ours, theirs, gaps)


def test_an_fp8_checkpoint_runs_fp8_and_speculation_equals_target_only(tmp_path):
    """DeepSeek-V3's released form (projections and experts fp8 e4m3 beside 128x128 scales): the
    engine keeps them fp8 in the target and the MTP head, and speculating changes no id."""
    from tests.examples.helpers import random_requests
    root = real_layout(tmp_path / "fp8", fp8=True, moe_intermediate_size=128, hidden_size=128)
    ck = dataclasses.replace(load_checkpoint(root), eos_token_id=None)
    assert any(w.dtype == torch.float8_e4m3fn for w in ck.target.values())
    requests = random_requests(ck.config.vocab_size, 3, seed=1, max_prompt=10, max_new=(6, 10))
    settings = dict(num_drafts=3, max_batch=3, kv_blocks=64, block_size=4, widths=(1, 2, 4), max_rows=64)
    greedy = Engine(ck, EngineConfig(speculate=False, **settings)).generate(requests).outputs
    for forward in ("eager", "circuit"):
        engine = Engine(ck, EngineConfig(forward=forward, **settings))
        head = engine.proposer.head
        assert isinstance(head, DeepseekMtpHead) and head.fp8_experts and head.fp8_dense
        assert any(n.op == "linear_fp8" for n in engine.target.model.circuit.nodes)
        assert engine.generate(requests).outputs == greedy, forward
