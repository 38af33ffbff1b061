"""YaRN RoPE for the GQA layers (issue 16 item 3 for the GQA heads): `MtpConfig.rope_scaling` read
from a Llama config.json (rope_parameters or rope_scaling of type yarn), the dense MTP head's
chain and the engine's Llama target run `rope_freqs` over YaRN's frequencies and attention
factor, equal to transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb at positions far past
original_max_position_embeddings; end to end, the engine on a YaRN Llama checkpoint is token-exact
with LlamaForCausalLM.generate (target alone and speculating, both drafter forwards). Any other
scaling type stays refused by name, and so is YaRN with partial rotary. The MoE head's YaRN:
tests/layers/test_moe_yarn.py."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_circuit.circuit.layers.checkpoint import read_config
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.config import ConfigError, MtpConfig
from draft_circuit.circuit.layers.mtp import MtpHead, emit_draft_chain
from draft_circuit.circuit.layers.rope import INV_FREQ, RopeScaling
from draft_circuit.ops.rope_freqs import rope_freqs_ref
from draft_circuit.runners.testing import assert_program_matches_eager, random_draft_batch
from examples.engine import Engine, EngineConfig, load_checkpoint
from examples.engine.sequence import Request
from tests.examples.helpers import SMALL

transformers = pytest.importorskip("transformers")

ORIG = 16  # original_max_position_embeddings: the tests run to positions 3-4x past it
YARNS = {
    "plain": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    "betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIG,
              "beta_fast": 16, "beta_slow": 2},
    "attention_factor": {"rope_type": "yarn", "factor": 2.5, "original_max_position_embeddings": ORIG,
                         "attention_factor": 0.8, "truncate": False},
}
YARN_SMALL = dataclasses.replace(SMALL, max_position_embeddings=128, rope_scaling=RopeScaling(
    rope_type="yarn", theta=SMALL.rope_theta, factor=4.0, original_max_position_embeddings=ORIG))


def hf_llama_config(rope: dict) -> dict:
    d = {**SMALL.to_hf(), "max_position_embeddings": 128}
    del d["rope_scaling"]
    return {**d, "rope_parameters": {**rope, "rope_theta": SMALL.rope_theta}}


@pytest.mark.parametrize("variant", sorted(YARNS))
@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_rope_freqs_equals_transformers_llama_yarn_past_the_original_length(variant, field):
    d = hf_llama_config(YARNS[variant])
    if field == "rope_scaling":  # the older name (hub configs): same object, theta at the top level
        d["rope_scaling"] = {k: v for k, v in d.pop("rope_parameters").items() if k != "rope_theta"}
    ours = MtpConfig.from_hf(d)
    assert ours.rope_scaling is not None and ours.rope_scaling.rope_type == "yarn"
    hf = transformers.LlamaConfig(**hf_llama_config(YARNS[variant]))
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(hf)
    n, heads, kv, dim = 70, SMALL.num_attention_heads, SMALL.num_key_value_heads, SMALL.head_dim
    pos = torch.arange(n)  # 0..69: past ORIG = 16 by 4x
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, heads, n, dim, generator=g), torch.randn(1, kv, n, dim, generator=g)
    cos, sin = rotary(q, pos[None])
    want_q, want_k = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    r = ours.rope_scaling
    got_q = rope_freqs_ref(q[0].transpose(0, 1).reshape(n, -1), pos.int(), r.inv_freq(dim), dim, r.attention_factor)
    got_k = rope_freqs_ref(k[0].transpose(0, 1).reshape(n, -1), pos.int(), r.inv_freq(dim), dim, r.attention_factor)
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1).reshape(n, -1), atol=2e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1).reshape(n, -1), atol=2e-6, rtol=1e-6)


def test_the_dense_head_chain_runs_rope_freqs_and_programs_equal_eager():
    head = MtpHead(YARN_SMALL)
    specs = head.param_specs()
    assert specs[INV_FREQ] == ("float32", (SMALL.head_dim // 2,))
    from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES
    g = torch.Generator().manual_seed(4)
    weights = {k: (1 + 0.1 * torch.randn(s, generator=g)) if len(s) == 1 else torch.randn(s, generator=g) / s[-1] ** 0.5
               for k, s in MTP_PARAM_SHAPES(YARN_SMALL).items()}
    params = head.bind(weights)
    assert torch.equal(params[INV_FREQ], YARN_SMALL.rope_scaling.inv_freq(SMALL.head_dim))
    from draft_circuit.circuit.layers.mtp import KvLayout
    kv = KvLayout(num_blocks=40, block_size=8, max_blocks_per_seq=8)
    chain = emit_draft_chain(head, 3, max_width=4, kv=kv)
    ropes = {n.op for n in chain.nodes if n.name.endswith(("rope_q", "rope_k"))}
    assert ropes == {"rope_freqs"}
    assert chain.node("s1.rope_q").attrs["attention_factor"] == YARN_SMALL.rope_scaling.attention_factor
    shape = head.cache_shapes(kv)[0]

    def batch_for(w: int) -> tuple[dict, dict]:
        batch = random_draft_batch(YARN_SMALL, kv, w, seed=w, num_drafts=3)
        batch.inputs["positions"] += 40  # past ORIG
        return batch.inputs, {"k_cache": torch.randn(shape, generator=g), "v_cache": torch.randn(shape, generator=g)}

    assert_program_matches_eager(chain, params, (1, 2, 4), batch_for)


@pytest.fixture(scope="module")
def yarn_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("yarn") / "ck", YARN_SMALL, seed=9)


def test_the_checkpoint_reads_back_with_its_yarn(yarn_checkpoint):
    from draft_circuit.circuit.layers.heads import describe_head, load_head
    assert read_config(yarn_checkpoint) == YARN_SMALL
    head, weights = load_head(yarn_checkpoint)
    assert describe_head(head) == "MtpHead: dense SwiGLU MLP, float32, YaRN x4 over 16"
    assert INV_FREQ in head.bind(weights)


@pytest.mark.parametrize("speculate, forward", [(False, "eager"), (True, "eager"), (True, "circuit")])
def test_engine_on_a_yarn_llama_is_token_exact_with_transformers_generate(yarn_checkpoint, speculate, forward):
    from tests.examples.greedy_reference import assert_same_greedy
    from tests.examples.test_engine_hf import hf_greedy
    prompts, new = [[5, 9, 2, 33, 17, 8, 41, 3, 12, 60, 7, 1], [7, 1, 44], [2, 2, 50, 61, 19]], 40  # to position 51
    ck = dataclasses.replace(load_checkpoint(yarn_checkpoint, with_mtp=speculate), eos_token_id=None)
    engine = Engine(ck, EngineConfig(speculate=speculate, forward=forward, num_drafts=3, max_batch=3,
                                     kv_blocks=64, block_size=8, widths=(1, 2, 4), max_rows=64))
    result = engine.generate([Request(p, new) for p in prompts])
    for prompt, ours in zip(prompts, result.outputs):
        theirs, gaps = hf_greedy(yarn_checkpoint, prompt, new)
        assert_same_greedy(ours, theirs, gaps)
    assert not speculate or result.stats.drafted > 0


@pytest.mark.parametrize("rope, message", [
    ({"rope_type": "linear", "factor": 2.0}, r"'rope_parameters.rope_type' = 'linear'"),
    ({"rope_type": "dynamic", "factor": 2.0}, r"'rope_parameters.rope_type' = 'dynamic'"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1, "high_freq_factor": 4,
      "original_max_position_embeddings": ORIG}, r"'rope_parameters.rope_type' = 'llama3'"),
])
def test_other_scaling_types_stay_refused_by_name(tmp_path, rope, message):
    import json
    (tmp_path / "config.json").write_text(json.dumps(hf_llama_config(rope)))
    with pytest.raises(ConfigError, match=message):
        read_config(tmp_path)


def test_yarn_with_partial_rotary_is_refused():
    with pytest.raises(ConfigError, match="partial_rotary_factor.*YaRN runs over whole heads"):
        dataclasses.replace(YARN_SMALL, partial_rotary_factor=0.5)
