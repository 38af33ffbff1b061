"""The engine with a Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms) target and MTP drafter, on a
checkpoint transformers' own Qwen2ForCausalLM / Qwen3ForCausalLM wrote (every tensor re-drawn, an
MTP layer in the DeepSeek-V3 names at model.layers.{L}): speculative decoding's ids equal
transformers' greedy `generate` for the target alone, with both drafter forwards (fp32, CPU); the
target alone too. (GLM-4.5's MoE target: tests/examples/test_engine_glm.py.)"""
from __future__ import annotations

import pytest

from examples.engine import Engine, EngineConfig, load_checkpoint
from tests.examples.helpers import random_requests
from tests.examples.greedy_reference import assert_same_greedy, auto_greedy

transformers = pytest.importorskip("transformers")
from tests.layers.hf_family_reference import family_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=["Qwen2", "Qwen3"])
def checkpoint(request, tmp_path_factory):
    family = request.param
    return family_checkpoint(tmp_path_factory.mktemp(family) / family, family, seed=2)


@pytest.mark.parametrize("forward, speculate", [("circuit", True), ("eager", True), ("eager", False)])
def test_engine_equals_transformers_generate(checkpoint, forward, speculate):
    ckpt = load_checkpoint(checkpoint, with_mtp=speculate)
    requests = random_requests(ckpt.config.vocab_size, 3, seed=4, max_prompt=16, max_new=(5, 10))
    config = EngineConfig(forward=forward, speculate=speculate, num_drafts=3, widths=(1, 2, 4), max_batch=3)
    outputs = Engine(ckpt, config).generate(requests).outputs
    for r, ours in zip(requests, outputs):
        theirs, gaps = auto_greedy(checkpoint, r.prompt, r.max_new_tokens)
        assert_same_greedy(ours, theirs, gaps)

