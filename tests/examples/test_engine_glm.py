"""The engine with a GLM-4.5 target (examples/engine/glm_target.py: dense first layers, then MoE
layers with the fp32 sigmoid router, its correction bias, group-limited top-k, routed and shared
experts; partial rotary, q/k/v biases, q/k norms) on a checkpoint transformers' own
Glm4MoeForCausalLM wrote (every tensor re-drawn, the MTP layer in its DeepSeek-V3 names at
model.layers.{L}): the target alone (eager and circuit) is token-exact with transformers' greedy
`generate`, and so is speculative decoding with the MoE MTP head (both drafter forwards, both
target forwards, through the engine's own path: load_checkpoint admits Glm4MoeForCausalLM and
load_target_weights reads its MoE layers, Engine builds the target with glm_target.target_for).
Refusals of the loader are named."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.layers.checkpoint import (ConfigError, MissingTensorError, UnexpectedTensorError,
                                                     UnsupportedTensorError, load_target_weights, read_config)
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead
from draft_circuit.circuit.layers.mtp import KvLayout
from examples.engine import Engine, EngineConfig, load_checkpoint
from examples.engine.glm_target import GlmTargetModel, target_for
from tests.examples.helpers import random_requests
from tests.examples.greedy_reference import PROMPTS, assert_same_greedy, assert_target_alone_matches, auto_greedy

transformers = pytest.importorskip("transformers")
from tests.layers.hf_family_reference import L, family_checkpoint, set_config  # noqa: E402

GLM = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, n_shared_experts=1,
           attention_bias=True, use_qk_norm=True, n_group=2, topk_group=1, routed_scaling_factor=2.5,
           first_k_dense_replace=1)
VARIANTS = {"dense_then_moe": GLM, "all_moe_top1": dict(GLM, first_k_dense_replace=0, num_experts_per_tok=1,
                                                        n_group=1, use_qk_norm=False)}
KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=8)
NEW = 12


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return family_checkpoint(tmp_path_factory.mktemp(request.param) / "glm", "Glm4Moe", seed=5,
                             **VARIANTS[request.param])


def hf_greedy(path, prompt: list[int], max_new: int) -> tuple[list[int], list[float]]:
    """transformers' greedy ids and top-2 gaps, its MoE experts run eagerly."""
    return auto_greedy(path, prompt, max_new, experts_implementation="eager")


def test_target_weights_load_by_their_names(checkpoint):
    config = read_config(checkpoint)
    stored = load_file(os.fspath(checkpoint / "model.safetensors"))
    w = load_target_weights(checkpoint, strict=True)
    dense = json.loads((checkpoint / "config.json").read_text())["first_k_dense_replace"]
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        assert (p + "mlp.gate.weight" in w) == (layer >= dense) == (p + "mlp.gate_proj.weight" not in w)
        assert torch.equal(w[p + "self_attn.q_proj.bias"], stored[p + "self_attn.q_proj.bias"])
    moe = f"model.layers.{config.num_hidden_layers - 1}."
    assert w[moe + "mlp.gate.weight"].dtype == torch.float32
    assert torch.equal(w[moe + "mlp.experts.3.down_proj.weight"], stored[moe + "mlp.experts.3.down_proj.weight"])
    assert not any(k.startswith(f"model.layers.{L}.") for k in w)  # the MTP layer is the drafter's


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_target_alone_equals_transformers_generate(checkpoint, forward):
    config = read_config(checkpoint)
    target = target_for(config, load_target_weights(checkpoint), KV, max_rows=32, forward=forward)
    assert isinstance(target, GlmTargetModel) and isinstance(config, MoeConfig)
    assert_target_alone_matches(target, PROMPTS, NEW, lambda prompt: hf_greedy(checkpoint, prompt, NEW))


@pytest.mark.parametrize("drafter, target", [("eager", "eager"), ("circuit", "eager"), ("circuit", "circuit")])
def test_speculative_decoding_equals_transformers_generate(checkpoint, drafter, target):
    ckpt = load_checkpoint(checkpoint)
    requests = random_requests(ckpt.config.vocab_size, 3, seed=4, max_prompt=16, max_new=(5, 10))
    engine = Engine(ckpt, EngineConfig(forward=drafter, target_forward=target, num_drafts=3, widths=(1, 2, 4),
                                       max_batch=3, kv_blocks=64, block_size=4, max_rows=64))
    assert isinstance(engine.target.model, GlmTargetModel) and isinstance(engine.proposer.head, MoeMtpHead)
    result = engine.generate(requests)
    for r, ours in zip(requests, result.outputs):
        theirs, gaps = hf_greedy(checkpoint, r.prompt, r.max_new_tokens)
        assert_same_greedy(ours, theirs, gaps)
    assert result.stats.drafted > 0  # it speculated (random weights: few drafts are accepted)


# ---- refusals, by name ----
def _glm(tmp_path):
    return family_checkpoint(tmp_path / "glm", "Glm4Moe", seed=1, **GLM)


def _edit(root, drop=(), add=None):
    file = root / "model.safetensors"
    tensors = {k: v for k, v in load_file(os.fspath(file)).items() if k not in drop}
    save_file({**tensors, **(add or {})}, os.fspath(file), metadata={"format": "pt"})


def test_a_missing_expert_is_named(tmp_path):
    root = _glm(tmp_path)
    _edit(root, drop=("model.layers.1.mlp.experts.2.up_proj.weight",))
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.1\.mlp\.experts\.2\.up_proj\.weight'"):
        load_target_weights(root)


@pytest.mark.parametrize("name, shape", [("model.layers.1.mlp.gate_proj.weight", (48, 32)),  # dense under MoE
                                         ("model.layers.0.mlp.gate.weight", (4, 32)),       # router under dense
                                         ("model.layers.0.self_attn.o_proj.bias", (32,))])
def test_a_tensor_the_layer_does_not_run_is_refused(tmp_path, name, shape):
    root = _glm(tmp_path)
    _edit(root, add={name: torch.ones(shape)})
    with pytest.raises(UnsupportedTensorError, match=rf"'{name.replace('.', chr(92) + '.')}'.*Glm4MoeForCausalLM"):
        load_target_weights(root)


def test_first_k_dense_replace_is_read_and_checked(tmp_path):
    root = _glm(tmp_path)
    set_config(root, first_k_dense_replace=0)  # layer 0 would be MoE: its router is in no file
    with pytest.raises(MissingTensorError, match=r"'model\.layers\.0\.mlp\.gate\.weight'"):
        load_target_weights(root)
    set_config(root, first_k_dense_replace=-1)
    with pytest.raises(ConfigError, match=r"'first_k_dense_replace' = -1"):
        load_target_weights(root)


def test_strict_refuses_strangers_and_ignores_the_mtp_layer(tmp_path):
    root = _glm(tmp_path)
    _edit(root, add={"vision.proj.weight": torch.ones(2)})
    load_target_weights(root)
    with pytest.raises(UnexpectedTensorError, match=r"'vision\.proj\.weight'"):
        load_target_weights(root, strict=True)
