"""DeepSeek-V3's real layout loads (issue 16 step 4): transformers' own DeepseekV3ForCausalLM
checkpoint (save_pretrained: genuine config fields, experts one by one) plus the MTP layer at
model.layers.{num_hidden_layers} under its real names (enorm, hnorm, eh_proj, its MoE decoder
block, shared_head.norm; embed_tokens / shared_head.head own or shared). The config reads by its
real names (transformers 5's and the hub's), target and MTP tensors load bit for bit, the head the
checkpoint describes drafts what a head bound from transformers' own tensors drafts; fp8 e4m3
projections beside `weight_scale_inv` stay fp8; what the head cannot run is refused by name."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.layers.checkpoint import (ConfigError, UnsupportedConfigError, UnsupportedTensorError,
                                                     load_mtp_weights, load_target_weights, read_config)
from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead, mtp_checkpoint_shapes
from draft_circuit.circuit.layers.deepseek_checkpoint import (FP8_STORED, target_checkpoint_shapes,
                                                              write_deepseek_checkpoint)
from draft_circuit.circuit.layers.families import check_family
from draft_circuit.circuit.layers.heads import describe_head, load_head
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import SCALE, quantize_blocks
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import random_draft_batch

from tests.layers.deepseek_fixtures import checkpoint_tensors, hf_model, our_config

pytest.importorskip("transformers")
KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=8)
L = 2  # TINY's num_hidden_layers: the MTP layer's index


def real_layout(root: Path, *, own_embed_and_head: bool = False, fp8: bool = False, seed: int = 0,
                **overrides) -> Path:
    """transformers' checkpoint, then the MTP layer (a copy of layer 1's MoE block plus the MTP
    tensors) appended under model.layers.{L}; fp8: every FP8_STORED weight fp8 e4m3 with its
    `weight_scale_inv`, and the config's quantization_config, as DeepSeek ships V3 and R1."""
    model = hf_model(seed, **overrides)
    model.save_pretrained(root)
    file = root / "model.safetensors"
    tensors = load_file(os.fspath(file))
    g = torch.Generator().manual_seed(seed + 7)
    h = model.config.hidden_size
    mtp = {f"model.layers.{L}.{k.removeprefix('model.layers.1.')}": v.clone()
           for k, v in tensors.items() if k.startswith("model.layers.1.")}
    mtp.update({f"model.layers.{L}.enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                f"model.layers.{L}.hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                f"model.layers.{L}.eh_proj.weight": torch.randn(h, 2 * h, generator=g) / 8,
                f"model.layers.{L}.shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g)})
    if own_embed_and_head:
        mtp[f"model.layers.{L}.embed_tokens.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape, generator=g)
        mtp[f"model.layers.{L}.shared_head.head.weight"] = torch.randn(tensors["lm_head.weight"].shape, generator=g) / 6
    tensors.update(mtp)
    if fp8:
        for k in [k for k in tensors if k.endswith(FP8_STORED) and "eh_proj" not in k]:
            tensors[k], tensors[k + SCALE] = quantize_blocks(tensors[k])
    save_file(tensors, os.fspath(file), metadata={"format": "pt"})
    if fp8:
        d = json.loads((root / "config.json").read_text())
        d["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                    "weight_block_size": [128, 128]}
        (root / "config.json").write_text(json.dumps(d))
    return root


def drafts(head, params, seed: int = 1) -> torch.Tensor:
    chain = emit_draft_chain(head, 3, max_width=4, kv=KV)
    b = random_draft_batch(head.config, KV, 4, seed=seed, num_drafts=3)
    k_shape, v_shape = head.cache_shapes(KV)
    g = torch.Generator().manual_seed(seed)
    states = {"k_cache": torch.randn(k_shape, generator=g), "v_cache": torch.randn(v_shape, generator=g)}
    return EagerRunner(chain, params, states).run(b.inputs)["drafts"]


@pytest.mark.parametrize("own", [False, True], ids=["shared_embed_head", "own_embed_head"])
def test_transformers_checkpoint_with_mtp_layer_loads_what_it_stored_and_drafts(tmp_path: Path, own: bool):
    root = real_layout(tmp_path / "v3", own_embed_and_head=own)
    stored = load_file(os.fspath(root / "model.safetensors"))
    config = read_config(root)
    assert isinstance(config, MlaConfig) and config == our_config(hf_model())
    target = load_target_weights(root, strict=True)
    assert target.keys() == target_checkpoint_shapes(config).keys()
    assert all(torch.equal(t, stored[k]) for k, t in target.items())
    _, w = load_mtp_weights(root, strict=True)
    assert w.keys() == mtp_checkpoint_shapes(config).keys()
    source = {"embed_tokens.weight": f"model.layers.{L}.embed_tokens.weight" if own else "model.embed_tokens.weight",
              "shared_head.head.weight": f"model.layers.{L}.shared_head.head.weight" if own else "lm_head.weight"}
    for k, t in w.items():
        assert torch.equal(t, stored[source.get(k, f"model.layers.{L}.{k}")]), k
    head, weights = load_head(root)
    assert isinstance(head, DeepseekMtpHead) and not head.fp8_dense
    assert describe_head(head).startswith("DeepseekMtpHead: MLA (kv_lora_rank 16, rope 8, yarn)")
    # the loader's names are transformers' tensors: a head bound from the state dict drafts the same
    direct = {k.removeprefix(f"model.layers.{L}."): v for k, v in stored.items() if k.startswith(f"model.layers.{L}.")}
    direct.setdefault("embed_tokens.weight", checkpoint_tensors(hf_model())["model.embed_tokens.weight"])
    direct.setdefault("shared_head.head.weight", stored["lm_head.weight"])
    got = drafts(head, head.bind(weights))
    assert torch.equal(got, drafts(DeepseekMtpHead(config), DeepseekMtpHead(config).bind(direct)))
    assert ((got >= 0) & (got < config.vocab_size)).all()


def test_fp8_checkpoint_keeps_projections_and_experts_fp8(tmp_path: Path):
    root = real_layout(tmp_path / "v3fp8", fp8=True, moe_intermediate_size=128)  # experts stack per 128 block
    head, weights = load_head(root)
    assert isinstance(head, DeepseekMtpHead) and head.fp8_dense and head.fp8_experts
    params = head.bind(weights)
    assert params["self_attn.o_proj.weight"].dtype == torch.float8_e4m3fn
    assert params["mlp.experts.down_proj.weight"].dtype == torch.float8_e4m3fn
    # fp8 kept == the same checkpoint dequantised at load (eager, fp32, bitwise)
    _, real = load_mtp_weights(root)
    plain = DeepseekMtpHead(head.config)
    assert torch.equal(drafts(head, params), drafts(plain, plain.bind(real)))
    target = load_target_weights(root)
    assert target["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.float32  # dequantised


def test_hub_config_reads_like_transformers_config(tmp_path: Path):
    """DeepSeek-V3's hub config.json: rope_scaling with `type`, rope_theta beside it, the fields
    the hub config carries that transformers 5 does not name (topk_method, scoring_func, ...)."""
    root = real_layout(tmp_path / "v3")
    d = json.loads((root / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d.update(rope_theta=rope.pop("rope_theta"), rope_scaling={"type": rope.pop("rope_type"), **rope},
             topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1, aux_loss_alpha=0.001,
             seq_aux=True, num_nextn_predict_layers=1)
    d.pop("head_dim")
    (root / "config.json").write_text(json.dumps(d))
    config = read_config(root)
    assert config.rope == our_config(hf_model()).rope and config.softmax_scale == our_config(hf_model()).softmax_scale


@pytest.mark.parametrize("fields, pattern", [
    ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, r"'rope_parameters\.rope_type' = 'longrope'"),
    ({"topk_method": "greedy"}, r"'topk_method' = 'greedy'"),
    ({"ep_size": 2}, r"'ep_size' = 2"),
    ({"attention_bias": True}, r"'attention_bias' = True"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]}},
     r"'quantization_config\.weight_block_size' = \[64, 64\]"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, r"activation_scheme"),
])
def test_math_changing_fields_are_refused_by_name(tmp_path: Path, fields: dict, pattern: str):
    root = real_layout(tmp_path / "v3")
    d = {**json.loads((root / "config.json").read_text()), **fields}
    (root / "config.json").write_text(json.dumps(d))
    with pytest.raises(UnsupportedConfigError, match=pattern):
        read_config(root)


def test_missing_mla_fields_and_unimplemented_tensors_are_refused(tmp_path: Path):
    root = real_layout(tmp_path / "v3")
    d = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({k: v for k, v in d.items() if k != "kv_lora_rank"}))
    with pytest.raises(ConfigError, match="'kv_lora_rank' is required for MLA"):
        read_config(root)
    (root / "config.json").write_text(json.dumps(d))
    extra = {f"model.layers.{L}.self_attn.q_proj.weight": torch.zeros(72, 32),
             "model.layers.0.self_attn.kv_a_proj_with_mqa.bias": torch.zeros(24)}
    save_file(extra, os.fspath(root / "extra.safetensors"))
    with pytest.raises(UnsupportedTensorError, match=rf"model\.layers\.{L}\.self_attn\.q_proj\.weight"):
        load_mtp_weights(root)
    with pytest.raises(UnsupportedTensorError, match=r"kv_a_proj_with_mqa\.bias"):
        load_target_weights(root)


def test_transformers_deepseek_config_passes_the_family_table():
    d = json.loads(hf_model().config.to_json_string())
    assert check_family(d, "ckpt/config.json").model_type == "deepseek_v3"


@pytest.mark.parametrize("fp8", [False, True])
def test_written_random_checkpoint_round_trips(tmp_path: Path, fp8: bool):
    c = our_config(hf_model())
    root = write_deepseek_checkpoint(tmp_path / "w", c, seed=3, fp8=fp8, shards=3)
    assert read_config(root) == c
    target = load_target_weights(root, strict=True)
    assert target.keys() == target_checkpoint_shapes(c).keys()
    head, weights = load_head(root, strict=True)
    assert isinstance(head, DeepseekMtpHead) and head.fp8_dense == fp8
    assert drafts(head, head.bind(weights)).shape == (4, 3)
