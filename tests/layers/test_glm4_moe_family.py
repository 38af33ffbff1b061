"""GLM-4.5 MoE MTP (`glm4_moe`): from a checkpoint transformers' own Glm4MoeForCausalLM wrote (every
tensor re-drawn) with the MTP layer at model.layers.{num_hidden_layers} in the DeepSeek-V3 names,
the loader reads partial rotary (rope_parameters or top-level, 0.5 absent), attention_bias,
use_qk_norm, the fp32 gate, its correction bias, routed and shared experts; our eager chain equals
the chain run with transformers' Glm4MoeDecoderLayer and its MoE block (fp32), the router equals
Glm4MoeTopkRouter (normalised at top_k 1 too), and program == eager bitwise at widths 1..8.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draft_circuit.circuit.layers.checkpoint import ConfigError, load_mtp_weights, read_config
from draft_circuit.circuit.layers.heads import describe_head, load_head
from draft_circuit.circuit.layers.moe import GATE, MoeConfig, MoeMtpHead
from draft_circuit.ops.moe import MoeRouteAttrs, route_select

transformers = pytest.importorskip("transformers")
from tests.layers.hf_family_reference import L, family_checkpoint, set_config  # noqa: E402
from tests.layers.family_helpers import (PREFIX, assert_chain_matches,  # noqa: E402
                                         assert_checkpoint_program_matches_eager, draft_beside_transformers,
                                         interpreted_kernels_match_eager)

MOE = dict(n_routed_experts=4, moe_intermediate_size=16, n_shared_experts=1)
VARIANTS = {  # GLM-4.5 355B-like (bias, q/k norm, groups) and Air-like (bias only), top-1 routing
    "bias_qknorm_top2": dict(MOE, attention_bias=True, use_qk_norm=True, num_experts_per_tok=2, n_group=2,
                             topk_group=1, routed_scaling_factor=2.5),
    "bias_top1": dict(MOE, attention_bias=True, use_qk_norm=False, num_experts_per_tok=1,
                      routed_scaling_factor=1.5),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, family_checkpoint(tmp_path_factory.mktemp(name) / "glm", "Glm4Moe", seed=7, **VARIANTS[name])


def test_config_reads_the_glm_fields(checkpoint) -> None:
    name, root = checkpoint
    c = read_config(root)
    fields = VARIANTS[name]
    assert isinstance(c, MoeConfig) and c.partial_rotary_factor == 0.5 and c.rotary_dim == c.head_dim // 2
    assert (c.qkv_bias, c.qk_norm) == (fields["attention_bias"], fields["use_qk_norm"])
    assert c.scoring_func == "sigmoid" and c.fp32_gate and c.norm_top1 and c.n_shared_experts == 1
    assert c.num_experts_per_tok == fields["num_experts_per_tok"]
    head, _ = load_head(root, "bfloat16")
    assert type(head) is MoeMtpHead and "rotary 4 of 8 dims" in describe_head(head)
    assert head.param_specs()[GATE][0] == "float32"  # transformers keeps the router fp32
    assert head.batch_refusal(4) is None  # ... by definition, so batches are not refused for it


def test_real_names_load_strict(checkpoint) -> None:
    _, root = checkpoint
    stored = load_file(os.fspath(root / "model.safetensors"))
    _, w = load_mtp_weights(root, dtype=torch.bfloat16, strict=True)
    for name in ("self_attn.q_proj.bias", "mlp.gate.e_score_correction_bias", "mlp.experts.3.down_proj.weight",
                 "mlp.shared_experts.gate_proj.weight"):
        assert torch.equal(w[name].float(), stored[f"model.layers.{L}.{name}"].to(w[name].dtype).float())
    assert w[GATE].dtype == torch.float32 and torch.equal(w[GATE], stored[f"model.layers.{L}.{GATE}"])


def test_eager_chain_equals_transformers_decoder_layer(checkpoint) -> None:
    _, root = checkpoint
    head, weights = load_head(root)
    out, k_rows, hf, _ = draft_beside_transformers(head, weights, root, seed=3, token=5)
    assert_chain_matches(out, k_rows, hf, PREFIX)


@pytest.mark.parametrize("top_k, n_group, topk_group", [(1, 1, 1), (2, 2, 1), (3, 4, 2)])
def test_router_equals_glm4_moe_topk_router(top_k, n_group, topk_group) -> None:
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    config = transformers.Glm4MoeConfig(hidden_size=24, n_routed_experts=8, num_experts_per_tok=top_k, n_group=n_group,
                                        topk_group=topk_group, routed_scaling_factor=2.5)
    router = Glm4MoeTopkRouter(config)
    g = torch.Generator().manual_seed(top_k)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 24, generator=g))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=g))
        logits, want_w, want_ids = router(torch.randn(16, 24, generator=g))
    attrs = MoeRouteAttrs(top_k=top_k, n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
                          norm_top1=True)
    ids, weights = route_select(logits, router.e_score_correction_bias, attrs)
    order, want_order = ids.long().sort(-1), want_ids.sort(-1)  # transformers' topk is unsorted
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices),
                               atol=1e-7, rtol=1e-6)
    if top_k == 1:  # normalised: a lone expert weighs routed_scaling_factor, as transformers has it
        assert torch.allclose(weights, torch.full_like(weights, 2.5))
        plain = route_select(logits, router.e_score_correction_bias, attrs.model_copy(update={"norm_top1": False}))[1]
        assert not torch.allclose(plain, weights)  # DeepSeek-V3's rule keeps the raw score


def test_program_equals_eager_bitwise_at_widths_1_to_8(checkpoint) -> None:
    _, root = checkpoint
    assert_checkpoint_program_matches_eager(root, range(1, 9))


def test_interpreted_kernels_match_eager(checkpoint) -> None:
    _, root = checkpoint
    kernels = interpreted_kernels_match_eager(root)
    assert {("rope_kv_write", "triton_rope_kv_write"), ("moe_experts", "triton_moe_grouped")} <= kernels


# ---- where the rotary factor sits, and what is refused ----
def _glm(tmp_path: Path) -> Path:
    return family_checkpoint(tmp_path / "glm", "Glm4Moe", seed=1, **VARIANTS["bias_top1"])


def test_a_top_level_rotary_factor_is_read_as_transformers_reads_it(tmp_path) -> None:
    root = _glm(tmp_path)
    d = json.loads((root / "config.json").read_text())
    d["rope_parameters"].pop("partial_rotary_factor")
    d["partial_rotary_factor"] = 0.25  # older config.json files keep it top-level
    (root / "config.json").write_text(json.dumps(d))
    assert read_config(root).rotary_dim == 2
    head, weights = load_head(root)
    out, _, hf, _ = draft_beside_transformers(head, weights, root, seed=4, token=9)
    assert transformers.AutoConfig.from_pretrained(root).rope_parameters["partial_rotary_factor"] == 0.25
    torch.testing.assert_close(out["hidden_out"][0], hf.hidden, atol=1e-5, rtol=1e-5)
    d["rope_parameters"].pop("partial_rotary_factor", None)
    d.pop("partial_rotary_factor")  # absent everywhere: the class's 0.5
    (root / "config.json").write_text(json.dumps(d))
    assert read_config(root).rotary_dim == 4


@pytest.mark.parametrize("fields, match", [
    ({"partial_rotary_factor": 0.25}, r"aliases disagree: rope_parameters\.partial_rotary_factor=0\.5, partial_rotary_factor=0\.25"),
    ({"use_qk_norm": 1}, r"'use_qk_norm' = 1: must be a bool"),
    ({"first_k_dense_replace": 3}, r"'first_k_dense_replace' = 3 > 'num_hidden_layers' = 2"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.1}},
     r"'partial_rotary_factor' = 0\.1: rotates 0 of head_dim = 8"),
])
def test_bad_glm_fields_are_named(tmp_path, fields, match) -> None:
    root = _glm(tmp_path)
    set_config(root, **fields)
    with pytest.raises(ConfigError, match=rf"config\.json: .*{match}"):
        read_config(root)
