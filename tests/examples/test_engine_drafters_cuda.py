"""On the GPU (`pytest -m cuda`): the drafters this engine now wires (issues 16 and 18) leave its
output target-only greedy decoding's on CUDA: an EAGLE-3 drafter over a Llama target (taps on the
device, with and without a draft vocabulary, fp32 and bf16), DeepSeek-V3's real layout (MLA + MoE
target, its MTP layer) and a YaRN Llama, each with the drafter compiled (--forward circuit) or
the eager oracle, the target eager or compiled."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_circuit.runners.testing import cuda
from examples.engine import Engine, EngineConfig, load_checkpoint
from tests.examples.helpers import random_requests

SETTINGS = dict(device="cuda", num_drafts=3, max_batch=3, kv_blocks=96, block_size=8, widths=(1, 2, 4),
                max_rows=64)


def _same_as_greedy(ck, requests, dtype=torch.float32, **extra) -> None:
    ck = dataclasses.replace(ck, eos_token_id=None)
    for target_forward in ("eager", "circuit"):
        common = dict(SETTINGS, target_forward=target_forward, dtype=dtype)
        greedy = Engine(ck, EngineConfig(speculate=False, **common)).generate(requests).outputs
        for forward in ("circuit", "eager"):
            engine = Engine(ck, EngineConfig(forward=forward, **common, **extra))
            result = engine.generate(requests)
            assert result.outputs == greedy, (target_forward, forward)
            assert result.stats.drafted > 0 and engine.pool.num_used == 0


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("subset", [False, True])
def test_eagle3_drafter_on_gpu(tmp_path, dtype, subset):
    from tests.examples.test_engine_eagle3 import DRAFTER, NAMED, TARGET, _subset
    from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
    from draft_circuit.circuit.layers.eagle3_checkpoint import write_random_eagle3_checkpoint
    target = write_random_checkpoint(tmp_path / "target", TARGET, seed=11)
    requests = random_requests(TARGET.vocab_size, 5, seed=21, max_prompt=20, max_new=(6, 16))
    for i, cfg in enumerate((DRAFTER, NAMED)):
        drafter = write_random_eagle3_checkpoint(tmp_path / f"d{i}", cfg, seed=12 + i, include_embed=False)
        ck = load_checkpoint(target, draft_path=drafter)
        _same_as_greedy(ck, requests, dtype, **({"draft_vocab": _subset(ck, 64)} if subset else {}))


@cuda
def test_deepseek_v3_layout_on_gpu(tmp_path):
    pytest.importorskip("transformers")
    from tests.layers.test_deepseek_checkpoint import real_layout
    ck = load_checkpoint(real_layout(tmp_path / "v3"))
    _same_as_greedy(ck, random_requests(ck.config.vocab_size, 4, seed=3, max_prompt=12, max_new=(8, 14)))


@cuda
def test_yarn_llama_on_gpu(tmp_path):
    from tests.layers.test_yarn_gqa import YARN_SMALL
    from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
    ck = load_checkpoint(write_random_checkpoint(tmp_path / "yarn", YARN_SMALL, seed=9))
    # positions to ~60: past original_max_position_embeddings (16)
    _same_as_greedy(ck, random_requests(YARN_SMALL.vocab_size, 4, seed=5, min_prompt=10, max_prompt=24,
                                        max_new=(30, 36)))
