"""YaRN RoPE in the MoE MTP head (issue 16 item 3, "for the GQA heads"): `MoeMtpHead` declares and
binds the dense head's frequency table (`rope.inv_freq`), so its attention runs `rope_freqs` over
YaRN's frequencies and attention factor. The oracle is transformers' Glm4MoeDecoderLayer (GQA
attention plus DeepSeek-style MoE: sigmoid routing with `e_score_correction_bias`, groups, a
shared expert) with rope_type yarn over whole heads (partial_rotary_factor 1.0, no biases, no q/k
norm: Llama's attention), on the same random weights, fp32, drafting at positions 2-3x past
original_max_position_embeddings. Our head loads the same checkpoint relabelled as a Llama-named
MoE MTP layer (the `llama` family accepts YaRN); program == eager bitwise at widths 1..4; the MoE
families whose target or head runs default RoPE only (GLM-4.5, Qwen3-Next) still refuse YaRN by
name, and a layer without the table still refuses it in rope_op.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.layers.checkpoint import read_config
from draft_circuit.circuit.layers.config import ConfigError
from draft_circuit.circuit.layers.families import UnsupportedConfigError, check_family
from draft_circuit.circuit.layers.heads import describe_head, load_head
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain, rope_op
from draft_circuit.circuit.layers.rope import INV_FREQ

transformers = pytest.importorskip("transformers")
from tests.layers.family_helpers import (assert_chain_matches, assert_checkpoint_program_matches_eager,  # noqa: E402
                                         draft_beside_transformers, eager_chain)
from tests.layers.hf_family_reference import family_checkpoint  # noqa: E402

ORIG, DRAFTS = 16, 3
KV = KvLayout(num_blocks=72, block_size=4, max_blocks_per_seq=16)  # 64 rows a sequence, 4 sequences
YARNS = {  # rope_parameters as transformers 5 writes them; the whole head rotates (YaRN's table)
    "plain": {"factor": 4.0},
    "betas_attention_factor": {"factor": 8.0, "beta_fast": 16, "beta_slow": 2, "attention_factor": 0.8},
}
MOE = dict(n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
           topk_group=1, routed_scaling_factor=2.5)  # top-2: GLM's top-1 normalisation never applies


def _rope(variant: str) -> dict:
    return {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": ORIG,
            "partial_rotary_factor": 1.0, **YARNS[variant]}


@pytest.fixture(scope="module", params=sorted(YARNS))
def roots(request, tmp_path_factory) -> tuple[Path, Path]:
    """(transformers' Glm4Moe checkpoint with YaRN: the oracle's, the same relabelled as a
    Llama-named MoE MTP layer: ours, read through the `llama` family)."""
    base = tmp_path_factory.mktemp(request.param)
    rope = _rope(request.param)
    glm = family_checkpoint(base / "glm", "Glm4Moe", seed=11, **MOE, max_position_embeddings=int(ORIG * rope["factor"]),
                            rope_parameters=rope)
    llama = base / "llama"
    shutil.copytree(glm, llama)
    d = json.loads((llama / "config.json").read_text())
    d.update(model_type="llama", architectures=["LlamaForCausalLM"], scoring_func="sigmoid")
    (llama / "config.json").write_text(json.dumps(d))
    return glm, llama


def _tables(prefix: int) -> torch.Tensor:
    """One sequence's 16 blocks in a random order (seeded by `prefix`); block 0 is scratch."""
    tables = torch.randperm(KV.max_blocks_per_seq, generator=torch.Generator().manual_seed(prefix)) + 1
    return tables.to(torch.int32)[None]


def test_the_llama_moe_head_reads_yarn_and_declares_the_table(roots) -> None:
    _, llama = roots
    c = read_config(llama)
    assert isinstance(c, MoeConfig) and c.rope_scaling is not None and c.rope_scaling.rope_type == "yarn"
    head, weights = load_head(llama, strict=True)
    assert type(head) is MoeMtpHead and describe_head(head).endswith(f"YaRN x{c.rope_scaling.factor:g} over {ORIG}")
    assert head.param_specs()[INV_FREQ] == ("float32", (c.head_dim // 2,))
    params = head.bind(weights)
    assert params.keys() == head.param_specs().keys()
    assert torch.equal(params[INV_FREQ], c.rope_scaling.inv_freq(c.head_dim))
    chain = emit_draft_chain(head, DRAFTS, max_width=2, kv=KV)
    for j in range(DRAFTS):
        for which in ("q", "k"):
            node = chain.node(f"s{j}.rope_{which}")
            assert node.op == "rope_freqs" and INV_FREQ in node.inputs
            assert node.attrs["attention_factor"] == c.rope_scaling.attention_factor
            assert node.attrs["pos_offset"] == j


@pytest.mark.parametrize("prefix", [20, 45])  # drafts at 20..22 and 45..47: past ORIG = 16
def test_eager_chain_equals_transformers_glm4_moe_layer_with_yarn(roots, prefix) -> None:
    glm, llama = roots
    head, weights = load_head(llama)
    token = 7
    out, k_rows, hf, hidden = draft_beside_transformers(head, weights, glm, seed=prefix, token=token, prefix=prefix,
                                                        num_drafts=DRAFTS, kv=KV, tables=_tables(prefix))
    assert_chain_matches(out, k_rows, hf, prefix)  # the K rows roped by rope_freqs
    # the check sees YaRN: the same head over default RoPE misses the oracle's keys
    plain = MoeMtpHead(dataclasses.replace(head.config, rope_scaling=None))
    _, plain_k = eager_chain(plain, plain.bind(weights), hf.keys, hf.values, token, hidden, prefix, DRAFTS, kv=KV,
                             tables=_tables(prefix))
    assert not torch.allclose(plain_k[prefix:], hf.keys[prefix:], atol=1e-3)


def test_program_equals_eager_bitwise_at_widths_1_to_4(roots) -> None:
    _, llama = roots
    assert_checkpoint_program_matches_eager(llama, range(1, 5), kv=KV, num_drafts=DRAFTS,
                                            position_shift=2 * ORIG)  # past the original length


def test_glm4_moe_still_refuses_yarn_by_name(roots) -> None:
    """GLM-4.5's engine target (examples/engine/glm_target.py) and its partial-rotary head run
    default RoPE only: its family rule names the field."""
    glm, _ = roots
    with pytest.raises(UnsupportedConfigError, match=r"'rope_parameters\.rope_type' = 'yarn' \(Glm4MoeForCausalLM"):
        read_config(glm)


@pytest.mark.parametrize("field", ["rope_parameters", "rope_scaling"])
def test_qwen3_next_still_refuses_yarn_by_name(field) -> None:
    """Qwen3NextMtpHead emits plain `rope` (partial rotary, 0.25): YaRN is refused by its rule."""
    d = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
         field: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}}
    with pytest.raises(UnsupportedConfigError, match=rf"'{field}\.rope_type' = 'yarn' \(Qwen3NextForCausalLM"):
        check_family(d)


def test_a_layer_without_the_table_refuses_yarn_by_name(roots) -> None:
    """rope_op's guard: a layer that declares no frequency table cannot run YaRN."""
    _, llama = roots
    c = read_config(llama)
    b = CircuitBuilder("bare", max_width=1)
    with pytest.raises(ConfigError, match=r"rope_scaling yarn: this layer \(bare\) declares no 'rope\.inv_freq' param"):
        rope_op(b, c, "q", "positions", {"pos_offset": 0})
