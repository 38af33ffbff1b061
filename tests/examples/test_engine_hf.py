"""The engine against Hugging Face transformers: on random checkpoints in the Llama +
DeepSeek-V3-MTP layout (MTP at model.layers.{L}, or exported at layer 0 in its own directory),
speculative decoding's ids equal `LlamaForCausalLM.generate` greedy ids for the target alone
(fp32, CPU). transformers is a test-only extra."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from examples.engine import Engine, EngineConfig, load_checkpoint
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from tests.examples.greedy_reference import assert_same_greedy, generate_greedy
from tests.examples.helpers import SMALL, random_requests

transformers = pytest.importorskip("transformers")

TIED = dataclasses.replace(SMALL, tie_word_embeddings=True, num_hidden_layers=3, head_dim=20,
                           num_attention_heads=4, num_key_value_heads=1, rope_theta=10000.0)


def hf_greedy(path, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """HF's greedy ids and, per generated token, the gap between its top two logits."""
    return generate_greedy(_hf_model(str(path)), prompt, max_new, attention_mask=False)


_MODELS: dict = {}


def _hf_model(path: str):
    if path not in _MODELS:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        _MODELS[path] = transformers.LlamaForCausalLM.from_pretrained(
            path, torch_dtype=torch.float32, attn_implementation="eager").eval()
    return _MODELS[path]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    together = write_random_checkpoint(root / "together", SMALL, seed=7)
    target = write_random_checkpoint(root / "target", dataclasses.replace(TIED, num_nextn_predict_layers=0),
                                     seed=8)  # the target alone: its MTP layer is elsewhere
    draft = write_random_checkpoint(root / "draft", TIED, seed=9, include_target=False,
                                    mtp_at_layer0=True)
    return {"together": (together, None), "exported": (target, draft)}


@pytest.mark.parametrize("layout", ["together", "exported"])
def test_engine_equals_transformers_generate(checkpoints, layout):
    path, draft = checkpoints[layout]
    config = load_checkpoint(path, with_mtp=False).config
    requests = random_requests(config.vocab_size, 4, seed=21, max_prompt=20, max_new=(6, 14))
    engine = Engine(load_checkpoint(path, draft_path=draft),
                    EngineConfig(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3))
    outputs = engine.generate(requests).outputs
    for r, ours in zip(requests, outputs):
        theirs, gaps = hf_greedy(path, r.prompt, r.max_new_tokens)
        assert_same_greedy(ours, theirs, gaps)
