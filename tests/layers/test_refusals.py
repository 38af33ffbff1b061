"""What cannot run is refused by default (FAULT 31), for the dense and the MoE head: tensors inside
a module the head runs that it does not implement, config fields that change the math, integer
or non-finite weights, non-finite rope_theta / rms_norm_eps; each error names the tensor or field,
the architecture and the file. Tensors of other layers and modules still load; a shard index
never leads outside the checkpoint directory."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.layers.checkpoint import (
    CorruptFileError, MissingTensorError, NonFiniteTensorError, TensorDtypeError, UnexpectedTensorError, UnsupportedArchitectureError,
    UnsupportedConfigError, UnsupportedTensorError, load_mtp_weights, load_target_weights, read_config)
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG, ConfigError
from draft_circuit.circuit.layers.moe import MoeConfig

MOE = MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)
HEADS = {"dense": DEFAULT_CONFIG, "moe": MOE}
ARCH = "LlamaForCausalLM (model_type 'llama')"


@pytest.fixture(params=["dense", "moe"])
def head(request) -> str:
    return request.param


def checkpoint(tmp_path: Path, kind: str, **kwargs) -> Path:
    return write_random_checkpoint(tmp_path / kind, HEADS[kind], seed=3, **kwargs)


def add_tensors(root: Path, tensors: dict[str, torch.Tensor], file: str = "extra.safetensors") -> Path:
    save_file(tensors, os.fspath(root / file))
    return root / file


def edit_config(root: Path, **fields) -> Path:
    d = json.loads((root / "config.json").read_text())
    d.update(fields)
    d = {k: v for k, v in d.items() if v is not ...}
    (root / "config.json").write_text(json.dumps(d))  # allow_nan: Infinity / NaN as JSON tokens
    return root / "config.json"


def replace_tensor(root: Path, key: str, t: torch.Tensor) -> None:
    file = root / "model.safetensors"
    tensors = load_file(os.fspath(file))
    assert key in tensors, key
    tensors[key] = t
    save_file(tensors, os.fspath(file))


def mtp(kind: str, name: str) -> str:
    return f"model.layers.{HEADS[kind].num_hidden_layers}.{name}"


# ---- tensors the head does not implement --------------------------------------------------------

def _layer_extras(kind: str) -> list[tuple[str, tuple[int, ...], str]]:
    c = HEADS[kind]
    q, kv, h = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size
    extras = [("self_attn.q_proj.bias", (q,), "self_attn"), ("self_attn.k_proj.bias", (kv,), "self_attn"),
              ("self_attn.v_proj.bias", (kv,), "self_attn"), ("self_attn.o_proj.bias", (h,), "self_attn"),
              ("self_attn.q_norm.weight", (c.head_dim,), "self_attn"),
              ("self_attn.k_norm.weight", (c.head_dim,), "self_attn"),
              ("eh_proj.bias", (h,), "eh_proj"), ("enorm.bias", (h,), "enorm"),
              ("shared_head.norm.bias", (h,), "shared_head")]
    if kind == "dense":
        extras += [("mlp.down_proj.bias", (h,), "mlp"), ("mlp.gate.weight", (8, h), "mlp")]
    else:
        extras += [("mlp.experts.0.down_proj.bias", (h,), "mlp"),
                   ("mlp.experts.4.gate_proj.weight", (16, h), "mlp"),  # an expert past n_routed_experts
                   ("mlp.shared_experts.up_proj.bias", (16,), "mlp")]
    return extras


@pytest.mark.parametrize("head, name, shape, module", [
    (kind, *extra) for kind in HEADS for extra in _layer_extras(kind)], ids=lambda v: str(v))
def test_unimplemented_mtp_tensor_is_refused_by_name(tmp_path: Path, head: str, name: str,
                                                     shape: tuple[int, ...], module: str) -> None:
    root = checkpoint(tmp_path, head)
    file = add_tensors(root, {mtp(head, name): torch.zeros(shape)})
    key = mtp(head, name)
    pattern = rf"{re.escape(key)}.*module '{re.escape(mtp(head, module))}'.*{re.escape(str(file))}"
    with pytest.raises(UnsupportedTensorError, match=pattern) as e:
        load_mtp_weights(root)
    assert ARCH in str(e.value)
    load_target_weights(root)  # the MTP layer is no target layer


def test_target_bias_and_head_bias_are_refused(tmp_path: Path, head: str) -> None:
    root = checkpoint(tmp_path, head)
    c = HEADS[head]
    add_tensors(root, {"model.layers.1.self_attn.q_proj.bias": torch.zeros(c.num_attention_heads * c.head_dim)})
    with pytest.raises(UnsupportedTensorError, match=r"model\.layers\.1\.self_attn\.q_proj\.bias.*module "
                                                     r"'model\.layers\.1\.self_attn'.*LlamaForCausalLM"):
        load_target_weights(root)
    load_mtp_weights(root)  # a target layer is not the MTP layer's business
    root = checkpoint(tmp_path / "h", head, mtp_shares_head=True)  # the MTP layer uses lm_head
    add_tensors(root, {"lm_head.bias": torch.zeros(c.vocab_size)})
    for load in (load_mtp_weights, load_target_weights):
        with pytest.raises(UnsupportedTensorError, match=r"'lm_head\.bias' in module 'lm_head'"):
            load(root)


def test_tensors_of_other_layers_and_modules_still_load(tmp_path: Path, head: str) -> None:
    root = checkpoint(tmp_path, head)
    c = HEADS[head]
    L = c.num_hidden_layers
    add_tensors(root, {
        f"model.layers.{L + 1}.self_attn.q_proj.bias": torch.zeros(4),   # a second MTP layer
        f"model.layers.{L + 1}.self_attn.q_norm.weight": torch.zeros(4),
        mtp(head, "self_attn.rotary_emb.inv_freq"): torch.ones(c.head_dim // 2),  # RoPE's buffer
        mtp(head, "some_adapter.weight"): torch.zeros(2, 2),             # a module the head never runs
        "model.vision_tower.proj.bias": torch.zeros(3),
    })
    _, weights = load_mtp_weights(root)
    assert weights.keys() == load_mtp_weights(checkpoint(tmp_path / "clean", head))[1].keys()
    load_target_weights(root)
    with pytest.raises(UnexpectedTensorError, match="some_adapter"):  # strict: also unknown tensors
        load_mtp_weights(root, strict=True)


def test_exported_draft_with_bias_is_refused(tmp_path: Path, head: str) -> None:
    root = checkpoint(tmp_path, head, mtp_at_layer0=True, include_target=False)
    add_tensors(root, {"model.layers.0.self_attn.k_proj.bias": torch.zeros(HEADS[head].num_key_value_heads
                                                                             * HEADS[head].head_dim)})
    with pytest.raises(UnsupportedTensorError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        load_mtp_weights(root)


def test_explicit_config_still_refuses_tensors(tmp_path: Path, head: str) -> None:
    root = checkpoint(tmp_path, head)
    add_tensors(root, {mtp(head, "self_attn.q_norm.weight"): torch.ones(HEADS[head].head_dim)})
    (root / "config.json").unlink()
    with pytest.raises(UnsupportedTensorError, match=r"q_norm.*no readable config\.json"):
        load_mtp_weights(root, HEADS[head])


# ---- config fields that change the math ---------------------------------------------------------

@pytest.mark.parametrize("fields, pattern", [
    ({"hidden_act": "gelu"}, r"'hidden_act' = 'gelu'.*silu"),
    ({"attention_bias": True}, r"'attention_bias' = True"),
    ({"attention_bias": 1}, r"'attention_bias' = 1"),
    ({"mlp_bias": True}, r"'mlp_bias' = True"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0}},  # yarn runs
     r"'rope_parameters\.rope_type' = 'llama3'"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"'rope_scaling\.type' = 'linear'"),
])
def test_math_changing_field_is_refused(tmp_path: Path, head: str, fields: dict, pattern: str) -> None:
    file = edit_config(checkpoint(tmp_path, head), **fields)
    with pytest.raises(UnsupportedConfigError, match=rf"{re.escape(str(file))}.*{pattern}") as e:
        read_config(file.parent)
    assert ARCH in str(e.value)
    with pytest.raises(UnsupportedConfigError):
        load_mtp_weights(file.parent)
    with pytest.raises(UnsupportedConfigError):
        load_target_weights(file.parent)


def test_defaults_and_harmless_fields_pass(tmp_path: Path, head: str) -> None:
    root = checkpoint(tmp_path, head)
    edit_config(root, hidden_act=..., attention_bias=False, mlp_bias=False, pretraining_tp=1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                partial_rotary_factor=0.5)  # LlamaRotaryEmbedding never reads it
    assert read_config(root) == HEADS[head]


@pytest.mark.parametrize("fields, pattern", [
    ({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}, r"MistralForCausalLM.*not in the family table"),
    ({"architectures": ["Qwen2ForCausalLM"]}, r"Qwen2ForCausalLM \(model_type 'llama'\).*disagree"),
    ({"model_type": ..., "architectures": ...}, r"neither 'model_type' nor 'architectures'"),
])
def test_architecture_not_runnable_is_refused(tmp_path: Path, head: str, fields: dict, pattern: str) -> None:
    file = edit_config(checkpoint(tmp_path, head), **fields)
    with pytest.raises(UnsupportedArchitectureError, match=rf"{re.escape(str(file))}.*{pattern}"):
        read_config(file.parent)


def test_a_checkpoint_labelled_qwen3_next_lacks_what_its_mtp_layer_needs(tmp_path: Path, head: str) -> None:
    """Qwen3-Next's MTP layer is its own MoE layout (tests/layers/test_qwen3_next_family.py): a
    DeepSeek-named checkpoint relabelled so is refused by the field its config lacks."""
    file = edit_config(checkpoint(tmp_path, head), model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"])
    with pytest.raises(ConfigError, match=rf"{re.escape(str(file))}: config field 'num_experts' is required"):
        read_config(file.parent)


@pytest.mark.parametrize("family, missing", [("qwen2", r"self_attn\.q_proj\.bias"), ("qwen3", r"self_attn\.q_norm\.weight")])
def test_a_llama_checkpoint_labelled_qwen_lacks_what_the_family_runs(tmp_path: Path, head: str, family: str,
                                                                   missing: str) -> None:
    """The family's head runs q/k/v biases (Qwen2) or q/k norms (Qwen3): a checkpoint without them
    is refused by the tensor it lacks, never drafted without it."""
    root = edit_config(checkpoint(tmp_path, head), model_type=family,
                       architectures=[f"{family.capitalize()}ForCausalLM"]).parent
    with pytest.raises(MissingTensorError, match=rf"'{missing}'"):
        load_mtp_weights(root)
    with pytest.raises(MissingTensorError, match=rf"'model\.layers\.0\.{missing}'"):
        load_target_weights(root)


@pytest.mark.parametrize("field, value", [
    ("rope_theta", math.inf), ("rope_theta", math.nan), ("rope_theta", -1.0), ("rope_theta", 10**400),
    ("rms_norm_eps", math.inf), ("rms_norm_eps", 0.0), ("rms_norm_eps", math.nan),
])
def test_non_finite_or_non_positive_rope_theta_and_eps(tmp_path: Path, head: str, field: str, value) -> None:
    file = edit_config(checkpoint(tmp_path, head), **{field: value})
    if field == "rope_theta":  # the alias must agree, or the disagreement is reported instead
        edit_config(file.parent, rope_parameters={"rope_type": "default", "rope_theta": value})
    with pytest.raises(ConfigError, match=rf"{re.escape(str(file))}.*'{field}'.*positive finite"):
        read_config(file.parent)


# ---- stored dtypes and values -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.uint8, torch.int8, torch.float8_e5m2])
def test_integer_bool_and_unsupported_weights_are_refused(tmp_path: Path, head: str, dtype) -> None:
    root = checkpoint(tmp_path, head)
    key = mtp(head, "self_attn.k_proj.weight")
    c = HEADS[head]
    replace_tensor(root, key, torch.ones(c.num_key_value_heads * c.head_dim, c.hidden_size).to(dtype))
    with pytest.raises(TensorDtypeError, match=rf"model\.safetensors.*{re.escape(key)}.*stored as"):
        load_mtp_weights(root)
    key = "model.layers.0.input_layernorm.weight"
    replace_tensor(root, key, torch.ones(c.hidden_size).to(dtype))
    with pytest.raises(TensorDtypeError, match=re.escape(key)):
        load_target_weights(root)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_weights_are_refused(tmp_path: Path, head: str, bad: float) -> None:
    root = checkpoint(tmp_path, head)
    key = mtp(head, "mlp.experts.1.up_proj.weight" if head == "moe" else "mlp.up_proj.weight")
    t = load_file(os.fspath(root / "model.safetensors"))[key].clone()
    t[3, 2] = bad
    replace_tensor(root, key, t)
    with pytest.raises(NonFiniteTensorError, match=rf"model\.safetensors.*{re.escape(key)}.*1 NaN or Inf"):
        load_mtp_weights(root)
    key = "model.norm.weight"
    replace_tensor(root, key, torch.full((HEADS[head].hidden_size,), bad))
    with pytest.raises(NonFiniteTensorError, match=re.escape(key)):
        load_target_weights(root)


def test_nan_in_fp8_experts_is_refused(tmp_path: Path) -> None:
    cfg = dataclasses.replace(MOE, moe_intermediate_size=128)
    root = write_random_checkpoint(tmp_path / "fp8", cfg, fp8_experts=True)
    key = mtp("moe", "mlp.experts.2.down_proj.weight")
    t = load_file(os.fspath(root / "model.safetensors"))[key].clone()
    assert t.dtype == torch.float8_e4m3fn
    t.view(torch.uint8)[0, 0] = 0x7F  # e4m3fn's NaN
    replace_tensor(root, key, t)
    for keep in (False, True):
        with pytest.raises(NonFiniteTensorError, match=re.escape(key)):
            load_mtp_weights(root, cfg, keep_fp8=keep)


def test_weight_past_float16_range_is_refused_after_conversion(tmp_path: Path, head: str) -> None:
    root = checkpoint(tmp_path, head)
    key = mtp(head, "hnorm.weight")
    replace_tensor(root, key, torch.full((HEADS[head].hidden_size,), 1e6))
    assert load_mtp_weights(root, dtype=torch.bfloat16)[1]["hnorm.weight"].isfinite().all()
    with pytest.raises(NonFiniteTensorError, match=rf"{re.escape(key)}.*after conversion to float16"):
        load_mtp_weights(root, dtype=torch.float16)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS",
                                   "link.safetensors"])
def test_shard_index_never_leads_outside_the_directory(tmp_path: Path, entry: str) -> None:
    root = write_random_checkpoint(tmp_path / "c", DEFAULT_CONFIG, shards=2)
    outside = tmp_path / "outside.safetensors"
    shard = sorted(root.glob("*.safetensors"))[0]
    outside.write_bytes(shard.read_bytes())
    (root / "sub").mkdir()
    (root / "link.safetensors").symlink_to(outside)  # the HF hub cache's layout: a link to blobs/
    index = json.loads((root / "model.safetensors.index.json").read_text())
    keys = [k for k, v in index["weight_map"].items() if v == shard.name]
    index["weight_map"].update(dict.fromkeys(keys, os.fspath(outside) if entry == "ABS" else entry))
    key = keys[0]
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    shard.unlink()
    if entry == "link.safetensors":
        load_target_weights(root)  # a symlinked shard named inside the directory is followed
        return
    with pytest.raises(CorruptFileError, match=rf"{re.escape(key)}.*outside the checkpoint directory"):
        load_target_weights(root)
