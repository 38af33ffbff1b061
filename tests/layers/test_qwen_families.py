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
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch

transformers = pytest.importorskip("transformers")
from tests.layers.hf_family_reference import L, family_checkpoint, hf_draft_chain, set_config  # noqa: E402

KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=4)
FAMILIES = {"Qwen2": {"qkv_bias": True, "qk_norm": False}, "Qwen3": {"qkv_bias": False, "qk_norm": True}}
PREFIX, DRAFTS = 6, 3


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    family = request.param
    return family, family_checkpoint(tmp_path_factory.mktemp(family) / family, family, seed=len(family))


def eager_chain(head: MtpHead, params: dict[str, torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
                token: int, hidden: torch.Tensor, prefix: int, num_drafts: int) -> tuple[dict, torch.Tensor]:
    """One sequence whose drafter KV holds `prefix` rows (HF's keys / values), drafting from
    `token` at position `prefix`; returns the outputs and the K pool as rows."""
    c = head.config
    shape = (KV.num_blocks, KV.block_size, c.num_key_value_heads, c.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    tables = torch.tensor([[3, 1, 4, 2]], dtype=torch.int32)  # scattered blocks, 0 is scratch
    rows = torch.arange(prefix + num_drafts)
    blocks, slots = tables[0, rows // KV.block_size].long(), rows % KV.block_size
    k_cache[blocks[:prefix], slots[:prefix]] = keys[:prefix]
    v_cache[blocks[:prefix], slots[:prefix]] = values[:prefix]
    inputs = {"tokens": torch.tensor([token], dtype=torch.int32), "hidden": hidden.view(1, -1),
              "positions": torch.tensor([prefix], dtype=torch.int32), "block_tables": tables,
              "live_rows": torch.tensor([prefix], dtype=torch.int32), "active": torch.ones(1, dtype=torch.int32)}
    states = {"k_cache": k_cache, "v_cache": v_cache}
    out = EagerRunner(emit_draft_chain(head, num_drafts, max_width=1, kv=KV), params, states).run(inputs)
    return out, states["k_cache"][blocks, slots]


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
    g = torch.Generator().manual_seed(5)
    h = head.config.hidden_size
    prefix, hidden, token = torch.randn(PREFIX, h, generator=g), torch.randn(h, generator=g), 11
    hf = hf_draft_chain(root, weights, prefix, token, hidden, DRAFTS)
    out, k_rows = eager_chain(head, head.bind(weights), hf.keys, hf.values, token, hidden, PREFIX, DRAFTS)
    assert out["drafts"][0].tolist() == hf.drafts
    torch.testing.assert_close(out["confidences"][0], torch.tensor(hf.confidences), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["hidden_out"][0], hf.hidden, atol=1e-5, rtol=1e-5)
    # the drafter's own KV rows: q/k norm, bias and RoPE as transformers caches them
    torch.testing.assert_close(k_rows[PREFIX:], hf.keys[PREFIX:], atol=1e-5, rtol=1e-5)


def test_program_equals_eager_bitwise_at_widths_1_to_8(checkpoint) -> None:
    _, root = checkpoint
    head, weights = load_head(root)
    params = head.bind(weights)
    chain = emit_draft_chain(head, DRAFTS, max_width=8, kv=KV)
    compiled = compile_draft(chain, params, list(range(1, 9)))
    for w in range(1, 9):
        b = random_draft_batch(head.config, KV, w, seed=w, num_drafts=DRAFTS)
        want_states, got_states = b.clone_states(), b.clone_states()
        want = EagerRunner(chain, params, want_states).run(b.inputs)
        got = ProgramRunner(compiled, got_states).run(b.inputs)
        for k in want:
            assert torch.equal(got[k], want[k]), (w, k)
        for k in want_states:
            assert torch.equal(got_states[k], want_states[k]), (w, k)


def test_interpreted_kernels_match_eager(checkpoint) -> None:
    family, root = checkpoint
    head, weights = load_head(root)
    params = head.bind(weights)
    chain = emit_draft_chain(head, DRAFTS, max_width=4, kv=KV)
    compiled = compile_draft(chain, params, [3], options=CompileOptions(interpret_kernels=True))
    kernels = {(x.op, x.kernel) for x in compiled.programs[3].launches}
    assert ("rope_kv_write", "triton_rope_kv_write") in kernels
    assert (("head_rmsnorm", "triton_head_rmsnorm") in kernels) == (family == "Qwen3")
    b = random_draft_batch(head.config, KV, 3, seed=9, num_drafts=DRAFTS)
    want = EagerRunner(chain, params, b.clone_states()).run(b.inputs)
    got = ProgramRunner(compiled, b.clone_states()).run(b.inputs)
    assert torch.equal(got["drafts"], want["drafts"])
    torch.testing.assert_close(got["hidden_out"], want["hidden_out"], atol=1e-4, rtol=1e-4)


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
