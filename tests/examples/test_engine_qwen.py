"""The engine with a Qwen2 (q/k/v biases) or Qwen3 (per-head q/k norms) target and MTP drafter, on a
checkpoint transformers' own Qwen2ForCausalLM / Qwen3ForCausalLM wrote (every tensor re-drawn, an
MTP layer in the DeepSeek-V3 names at model.layers.{L}): speculative decoding's ids equal
transformers' greedy `generate` for the target alone, with both drafter forwards (fp32, CPU); the
target alone too. (GLM-4.5's MoE target: tests/examples/test_engine_glm.py.)"""
from __future__ import annotations

import pytest
import torch

from examples.engine import Engine, EngineConfig, load_checkpoint
from tests.examples.helpers import random_requests
from tests.examples.test_engine_hf import assert_same_greedy

transformers = pytest.importorskip("transformers")
from tests.layers.hf_family_reference import family_checkpoint  # noqa: E402


def hf_greedy(path, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy ids and, per generated token, the gap between its top two logits."""
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():  # an explicit mask: generate would otherwise mask prompt tokens equal to pad (0)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                             do_sample=False, output_scores=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    gaps = [float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores]
    return out.sequences[0, len(prompt):].tolist(), gaps


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
        theirs, gaps = hf_greedy(checkpoint, r.prompt, r.max_new_tokens)
        assert_same_greedy(ours, theirs, gaps)

