"""Checkpoints transformers itself writes (`XxxForCausalLM(config).save_pretrained`: genuine config
fields and tensor names) plus an MTP layer in the DeepSeek-V3 names: Llama loads exactly what was
stored; Qwen2 (q/k/v biases) and Qwen3 (q_norm / k_norm) load by their family
(tests/layers/test_qwen_families.py), and relabelled as Llama they are refused by tensor name
instead of drafting wrong (issue 17's first finding)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.layers.checkpoint import (UnsupportedConfigError,
                                                     UnsupportedTensorError, load_mtp_weights,
                                                     load_target_weights, read_config)
from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES, TARGET_PARAM_SHAPES

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
L = SMALL["num_hidden_layers"]


def hf_checkpoint(root: Path, family: str, **fields) -> Path:
    """transformers' own checkpoint of `family`, plus an MTP layer at model.layers.{L}: a copy of
    the last decoder layer (so it carries the family's biases / norms under their real names)
    with the DeepSeek-V3 MTP tensors beside it; embedding and head are the target's."""
    config = getattr(transformers, f"{family}Config")(**SMALL, **fields)
    torch.manual_seed(0)
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(root)
    file = root / "model.safetensors"
    tensors = load_file(os.fspath(file))
    h = SMALL["hidden_size"]
    last = f"model.layers.{L - 1}."
    mtp = {f"model.layers.{L}.{k.removeprefix(last)}": v.clone() for k, v in tensors.items() if k.startswith(last)}
    mtp.update({f"model.layers.{L}.enorm.weight": torch.ones(h), f"model.layers.{L}.hnorm.weight": torch.ones(h),
                f"model.layers.{L}.eh_proj.weight": torch.randn(h, 2 * h) / h,
                f"model.layers.{L}.shared_head.norm.weight": torch.ones(h)})
    save_file({**tensors, **mtp}, os.fspath(file), metadata={"format": "pt"})
    d = json.loads((root / "config.json").read_text())
    d["num_nextn_predict_layers"] = 1
    (root / "config.json").write_text(json.dumps(d))
    return root


def relabel_as_llama(root: Path) -> None:
    d = json.loads((root / "config.json").read_text())
    d.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (root / "config.json").write_text(json.dumps(d))


def test_transformers_llama_checkpoint_loads_what_it_stored(tmp_path: Path) -> None:
    root = hf_checkpoint(tmp_path / "llama", "Llama")
    config = read_config(root)
    stored = load_file(os.fspath(root / "model.safetensors"))
    target = load_target_weights(root)
    assert target.keys() == TARGET_PARAM_SHAPES(config).keys()
    assert all(torch.equal(t, stored[k]) for k, t in target.items())
    _, w = load_mtp_weights(root, strict=True)
    assert w.keys() == MTP_PARAM_SHAPES(config).keys()
    assert torch.equal(w["self_attn.q_proj.weight"], stored[f"model.layers.{L}.self_attn.q_proj.weight"])
    assert torch.equal(w["shared_head.head.weight"], stored["lm_head.weight"])  # the fallback


def test_transformers_llama_with_biases_is_refused_by_field(tmp_path: Path) -> None:
    root = hf_checkpoint(tmp_path / "llama", "Llama", attention_bias=True)
    with pytest.raises(UnsupportedConfigError, match=r"config\.json.*'attention_bias' = True.*LlamaForCausalLM"):
        load_target_weights(root)
    d = json.loads((root / "config.json").read_text())
    d["attention_bias"] = False  # the flag lies: the stored biases still refuse, by name
    (root / "config.json").write_text(json.dumps(d))
    with pytest.raises(UnsupportedTensorError, match=r"'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        load_target_weights(root)
    with pytest.raises(UnsupportedTensorError, match=rf"'model\.layers\.{L}\.self_attn\.k_proj\.bias'"):
        load_mtp_weights(root)


@pytest.mark.parametrize("family, tensors", [
    ("Qwen2", ("self_attn.k_proj.bias", "self_attn.q_proj.bias", "self_attn.v_proj.bias")),
    ("Qwen3", ("self_attn.k_norm.weight", "self_attn.q_norm.weight")),
])
def test_qwen_checkpoints_load_by_family_and_are_refused_by_tensor_as_llama(tmp_path: Path, family: str,
                                                                           tensors: tuple[str, ...]) -> None:
    root = hf_checkpoint(tmp_path / family, family)
    _, weights = load_mtp_weights(root, strict=True)  # its own family runs them
    assert {t for t in tensors} <= set(weights)
    relabel_as_llama(root)  # "a Qwen checkpoint labelled Llama": its own tensors refuse it
    read_config(root)
    with pytest.raises(UnsupportedTensorError) as e:
        load_mtp_weights(root)
    for t in tensors:
        assert f"'model.layers.{L}.{t}' in module 'model.layers.{L}.self_attn'" in str(e.value)
    with pytest.raises(UnsupportedTensorError) as e:
        load_target_weights(root)
    for layer in range(L):
        assert all(f"'model.layers.{layer}.{t}'" in str(e.value) for t in tensors)
