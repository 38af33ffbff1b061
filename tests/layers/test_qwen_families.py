"""Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms) MTP heads in the DeepSeek-V3 naming: from a
checkpoint transformers' own Qwen2ForCausalLM / Qwen3ForCausalLM wrote (every tensor re-drawn),
the loader reads their real names, our eager draft chain equals the chain run with transformers'
Qwen2DecoderLayer / Qwen3DecoderLayer (fp32), and the compiled program equals eager bitwise on
CPU at widths 1..8 (and with the interpreted Triton kernels, closely)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from draft_circuit.circuit.layers.checkpoint import (MissingTensorError, UnsupportedConfigError,
                                                     UnsupportedTensorError, load_mtp_weights,
                                                     load_target_weights, read_config)
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.heads import describe_head, load_head
from draft_circuit.circuit.layers.mtp import MtpHead, emit_draft_chain

transformers = pytest.importorskip("transformers")
from tests.layers.family_helpers import (KV, PREFIX, assert_chain_matches,  # noqa: E402
                                         assert_checkpoint_program_matches_eager, draft_beside_transformers,
                                         interpreted_kernels_match_eager)
from tests.layers.hf_family_reference import L, family_checkpoint, set_config  # noqa: E402

FAMILIES = {"Qwen2": {"qkv_bias": True, "qk_norm": False}, "Qwen3": {"qkv_bias": False, "qk_norm": True}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, family_checkpoint(tmp_path_factory.mktemp(family) / family, family, seed=len(family))


def test_config_takes_the_familys_attention(checkpoint) -> None:
    family, root = checkpoint
    config = read_config(root)
    assert type(config) is MtpConfig and config.partial_rotary_factor == 1.0
    assert {k: getattr(config, k) for k in FAMILIES[family]} == FAMILIES[family]
    head, _ = load_head(root)
    assert type(head) is MtpHead and ("q/k/v bias" in describe_head(head)) == (family == "Qwen2")


def test_real_names_load_strict_and_bind(checkpoint) -> None:
    family, root = checkpoint
    stored = load_file(os.fspath(root / "model.safetensors"))
    config, weights = load_mtp_weights(root, strict=True)
    own = {"Qwen2": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
           "Qwen3": ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]}[family]
    for name in own:
        assert torch.equal(weights[name], stored[f"model.layers.{L}.{name}"])
    params = MtpHead(config).bind(weights)
    assert set(own) <= set(params)
    target = load_target_weights(root, strict=True)
    assert all(torch.equal(target[f"model.layers.0.{n}"], stored[f"model.layers.0.{n}"]) for n in own)
    ops = [(n.op, len(n.inputs)) for n in emit_draft_chain(MtpHead(config), 1, max_width=1, kv=KV).nodes]
    assert ops.count(("linear", 3)) == (3 if family == "Qwen2" else 0)
    assert ops.count(("head_rmsnorm", 2)) == (2 if family == "Qwen3" else 0)


def test_eager_chain_equals_transformers_decoder_layer(checkpoint) -> None:
    family, root = checkpoint
    head, weights = load_head(root)
    out, k_rows, hf, _ = draft_beside_transformers(head, weights, root, seed=5, token=11)
    # drafts, confidences, hidden, and the drafter's own KV rows: q/k norm, bias and RoPE as
    # transformers caches them
    assert_chain_matches(out, k_rows, hf, PREFIX)


def test_program_equals_eager_bitwise_at_widths_1_to_8(checkpoint) -> None:
    _, root = checkpoint
    assert_checkpoint_program_matches_eager(root, range(1, 9))


def test_interpreted_kernels_match_eager(checkpoint) -> None:
    family, root = checkpoint
    kernels = interpreted_kernels_match_eager(root)
    assert ("rope_kv_write", "triton_rope_kv_write") in kernels
    assert (("head_rmsnorm", "triton_head_rmsnorm") in kernels) == (family == "Qwen3")


# ---- what is still refused ----
@pytest.mark.parametrize("family, field, value", [("Qwen2", "use_sliding_window", True),
                                                  ("Qwen3", "use_sliding_window", True),
                                                  ("Qwen3", "attention_bias", True)])
def test_fields_the_head_does_not_implement_are_refused(tmp_path, family, field, value) -> None:
    root = family_checkpoint(tmp_path / family, family)
    set_config(root, **{field: value})
    with pytest.raises(UnsupportedConfigError, match=rf"config\.json: config field '{field}' = {value}.*{family}ForCausalLM"):
        read_config(root)


def test_a_missing_q_norm_is_named(tmp_path) -> None:
    from safetensors.torch import save_file
    root = family_checkpoint(tmp_path / "q3", "Qwen3")
    file = root / "model.safetensors"
    tensors = load_file(os.fspath(file))
    del tensors[f"model.layers.{L}.self_attn.k_norm.weight"]
    save_file(tensors, os.fspath(file), metadata={"format": "pt"})
    with pytest.raises(MissingTensorError, match=rf"'self_attn\.k_norm\.weight'.*model\.layers\.{L}\.self_attn\.k_norm"):
        load_mtp_weights(root)


def test_qwen3_norms_on_a_qwen2_label_are_refused_by_name(tmp_path) -> None:
    """A Qwen3 checkpoint relabelled Qwen2 carries norms the Qwen2 head does not run (and lacks
    the biases it does): refused by the tensors' names, never drafted wrong."""
    root = family_checkpoint(tmp_path / "q3", "Qwen3")
    set_config(root, model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    with pytest.raises((UnsupportedTensorError, MissingTensorError), match=r"q_proj\.bias|q_norm"):
        load_mtp_weights(root)
