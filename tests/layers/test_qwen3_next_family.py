"""Qwen3-Next MTP (`qwen3_next`) as a drafter: from a checkpoint transformers' own
Qwen3NextForCausalLM(config).save_pretrained wrote (every tensor re-drawn) plus the `mtp.*` layer
under vLLM's / SGLang's names, the loader reads it by name (and refuses a missing or an extra
`mtp.*` tensor by name); our eager chain equals the chain run with transformers'
Qwen3NextDecoderLayer (full-attention type, its MoE block) and Qwen3NextRMSNorm (1 + weight) at a
fresh sequence's first position and after a cached prefix (fp32), and a prefill's rows (the
KV-only program over one sequence's positions) write the K / V transformers' layer caches for the
same positions in one call; program == eager bitwise at
widths 1..8; the interpreted kernels agree; `circuit plan --checkpoint` reports the head.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.cli import main
from draft_circuit.circuit.layers.checkpoint import (ConfigError, MissingMtpLayerError, MissingTensorError,
                                                     NonFiniteTensorError, TensorDtypeError,
                                                     UnsupportedArchitectureError, UnsupportedConfigError,
                                                     UnexpectedTensorError, UnsupportedTensorError, load_mtp_weights,
                                                     load_target_weights, read_config)
from draft_circuit.circuit.layers.heads import describe_head, load_head
from draft_circuit.circuit.layers.mtp import emit_draft_chain
from draft_circuit.circuit.layers.qwen3_next import (GATE, QUERY, ZERO_CENTRED_NORMS, Qwen3NextMtpConfig,
                                                     Qwen3NextMtpHead, qwen3_next_mtp_shapes)
from draft_circuit.circuit.planner import kv_only_circuit
from draft_circuit.runners.eager import EagerRunner

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf  # noqa: E402

from tests.layers.hf_family_reference import HfChain, moe_state, randomize, set_config  # noqa: E402
from tests.layers.family_helpers import (DRAFTS, KV, PREFIX, SCATTERED, assert_chain_matches,  # noqa: E402
                                         assert_checkpoint_program_matches_eager, eager_chain,
                                         interpreted_kernels_match_eager)

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, layer_types=["linear_attention", "full_attention"],
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)
FULL = 1  # the full-attention (and MoE) layer of TINY, whose class the MTP layer is
VARIANTS = {"top2": {}, "top1_partial_half": dict(num_experts_per_tok=1, partial_rotary_factor=0.5),
            "top3_unnormed": dict(num_experts_per_tok=3, norm_topk_prob=False)}


def qwen3_next_checkpoint(root: Path, seed: int = 0, **fields) -> Path:
    """transformers' own Qwen3-Next checkpoint (it saves no `mtp.*`), plus the MTP layer by its real
    names: `mtp.layers.0.*` a copy of the full-attention layer's tensor names, `mtp.fc`, the two
    pre-fc norms and `mtp.norm`; then every tensor re-drawn (zero-centred norms near 1, so the
    gain 1 + weight is near 2 and a head that read `weight` as the gain would be far off)."""
    config = transformers.Qwen3NextConfig(**{**TINY, **fields})
    torch.manual_seed(0)
    transformers.Qwen3NextForCausalLM(config).save_pretrained(root)
    file = root / "model.safetensors"
    tensors = load_file(os.fspath(file))
    h, layer = TINY["hidden_size"], f"model.layers.{FULL}."
    mtp = {f"mtp.layers.0.{k.removeprefix(layer)}": v.clone() for k, v in tensors.items() if k.startswith(layer)}
    mtp.update({f"mtp.{n}.weight": torch.zeros(h) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    mtp["mtp.fc.weight"] = torch.zeros(h, 2 * h)
    save_file({**tensors, **mtp}, os.fspath(file), metadata={"format": "pt"})
    set_config(root, num_nextn_predict_layers=1)
    randomize(root, seed)
    return root


def hf_chain(root: Path, w: dict[str, torch.Tensor], prefix: torch.Tensor, token: int, hidden: torch.Tensor,
             num_drafts: int) -> HfChain:
    """vLLM's Qwen3NextMultiTokenPredictor.forward with transformers' classes: fc over
    [pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)], Qwen3NextDecoderLayer (full
    attention) at position T + j over a DynamicCache holding the prefix, y = norm(out), the draft
    argmax(lm_head(y)), y handed on (the last one is HfChain.hidden)."""
    config = transformers.AutoConfig.from_pretrained(root)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    layer = hf.Qwen3NextDecoderLayer(config, layer_idx=FULL).eval()
    assert layer.block_type == "full_attention" and isinstance(layer.mlp, hf.Qwen3NextSparseMoeBlock)
    own = {k.removeprefix("layers.0."): t for k, t in w.items() if k.startswith("layers.0.")}
    layer.load_state_dict(moe_state(layer, own), strict=True)
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = hf.Qwen3NextRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norms[name].load_state_dict({"weight": w[f"{name}.weight"]})
    rotary = hf.Qwen3NextRotaryEmbedding(config)
    cache = transformers.DynamicCache(config=config)

    def run(x: torch.Tensor, pos: int) -> torch.Tensor:
        x, ids = x.view(1, 1, -1), torch.tensor([[pos]])
        return layer(x, attention_mask=None, position_ids=ids, cache=cache, use_cache=True,
                     position_embeddings=rotary(x, ids)).view(-1)

    drafts, confs = [], []
    with torch.no_grad():
        for t in range(prefix.shape[0]):
            run(prefix[t], t)
        for j in range(num_drafts):
            e = w["embed_tokens.weight"][token]
            x = F.linear(torch.cat([norms["pre_fc_norm_embedding"](e), norms["pre_fc_norm_hidden"](hidden)]),
                         w["fc.weight"])
            hidden = norms["norm"](run(x, prefix.shape[0] + j))
            logits = F.linear(hidden, w["lm_head.weight"])
            token = int(logits.argmax())
            drafts.append(token)
            confs.append(float(logits.log_softmax(-1)[token]))
    kv = cache.layers[FULL]
    return HfChain(drafts, confs, hidden, kv.keys[0].transpose(0, 1), kv.values[0].transpose(0, 1))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    return name, qwen3_next_checkpoint(tmp_path_factory.mktemp(name) / "q3n", seed=3, **VARIANTS[name])


def test_config_reads_the_qwen3_next_fields(checkpoint) -> None:
    name, root = checkpoint
    c = read_config(root)
    fields = {**TINY, **VARIANTS[name]}
    assert isinstance(c, Qwen3NextMtpConfig) and c.qk_norm and not c.qkv_bias
    assert c.rotary_dim == int(8 * fields.get("partial_rotary_factor", 0.25))
    assert (c.num_experts, c.num_experts_per_tok, c.shared_expert_intermediate_size) == \
        (4, fields["num_experts_per_tok"], 24)
    assert c.norm_topk_prob == fields.get("norm_topk_prob", True)
    head, _ = load_head(root, "bfloat16")
    assert type(head) is Qwen3NextMtpHead
    assert describe_head(head).startswith("Qwen3NextMtpHead: gated attention, 4 experts")
    assert head.batch_refusal(4) is None


def test_real_names_load_strict_and_bind(checkpoint) -> None:
    _, root = checkpoint
    stored = load_file(os.fspath(root / "model.safetensors"))
    config, w = load_mtp_weights(root, strict=True)
    assert set(w) == set(qwen3_next_mtp_shapes(config))
    for name in ("fc.weight", "pre_fc_norm_hidden.weight", "layers.0.self_attn.q_proj.weight",
                 "layers.0.mlp.shared_expert_gate.weight", "layers.0.mlp.experts.3.down_proj.weight", "norm.weight"):
        assert torch.equal(w[name], stored[f"mtp.{name}"]), name
    assert torch.equal(w["embed_tokens.weight"], stored["model.embed_tokens.weight"])
    assert torch.equal(w["lm_head.weight"], stored["lm_head.weight"])
    params = Qwen3NextMtpHead(config).bind(w)
    for name in ZERO_CENTRED_NORMS:  # as stored: the zero-centred norm ops add the 1
        assert torch.equal(params[name], stored[f"mtp.{name}"]), name
    # q_proj's rows per head: head_dim query rows, then head_dim gate rows
    q = stored["mtp.layers.0.self_attn.q_proj.weight"].view(4, 2, 8, 32)
    assert torch.equal(params[QUERY][8:16], q[1, 0]) and torch.equal(params[GATE][8:16], q[1, 1])


@pytest.mark.parametrize("prefix", [0, PREFIX], ids=["first_position", "after_prefix"])
def test_eager_chain_equals_transformers_decoder_layer(checkpoint, prefix) -> None:
    _, root = checkpoint
    head, weights = load_head(root)
    g = torch.Generator().manual_seed(11 + prefix)
    h = head.config.hidden_size
    rows, hidden, token = torch.randn(prefix, h, generator=g), torch.randn(h, generator=g), 7
    ref = hf_chain(root, weights, rows, token, hidden, DRAFTS)
    # the drafter KV starts as transformers' cache of the prefix (its own layer's K and V rows)
    out, k_rows = eager_chain(head, head.bind(weights), ref.keys, ref.values, token, hidden, prefix, DRAFTS)
    # drafts and confidences (1e-5); the drafts' own K rows (1e-5): q/k norm (1 + weight) and partial
    # rotary as transformers caches them; the hidden after DRAFTS chained steps within 5e-5: fp32
    # rounding that differs with the CPU's BLAS path (1.9e-5 at an element of 0.08 on an AMD EPYC,
    # under 1e-5 on CI's machine), not a layout error
    assert_chain_matches(out, k_rows, ref, prefix, hidden_atol=5e-5)


def test_prefill_rows_write_transformers_kv(checkpoint) -> None:
    """A prefill (the drafter's catch-up over a prompt: the KV-only program of the one-step chain,
    one row per position of one sequence) writes, row for row, the K and V transformers' layer
    caches when it runs the same positions as one prefill call."""
    _, root = checkpoint
    head, weights = load_head(root)
    c, rows = head.config, 5
    g = torch.Generator().manual_seed(21)
    tokens, hidden = torch.randint(0, c.vocab_size, (rows,), generator=g), torch.randn(rows, c.hidden_size, generator=g)
    config = transformers.AutoConfig.from_pretrained(root)
    config._attn_implementation, config._experts_implementation = "eager", "eager"
    layer = hf.Qwen3NextDecoderLayer(config, layer_idx=FULL).eval()
    own = {k.removeprefix("layers.0."): t for k, t in weights.items() if k.startswith("layers.0.")}
    layer.load_state_dict(moe_state(layer, own), strict=True)
    norm = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        norm[name] = hf.Qwen3NextRMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        norm[name].load_state_dict({"weight": weights[f"{name}.weight"]})
    cache = transformers.DynamicCache(config=config)
    with torch.no_grad():
        x = F.linear(torch.cat([norm["pre_fc_norm_embedding"](weights["embed_tokens.weight"][tokens]),
                                norm["pre_fc_norm_hidden"](hidden)], -1), weights["fc.weight"]).view(1, rows, -1)
        ids = torch.arange(rows).view(1, -1)
        layer(x, attention_mask=None, position_ids=ids, cache=cache, use_cache=True,
              position_embeddings=hf.Qwen3NextRotaryEmbedding(config)(x, ids))
    want_k, want_v = (t[0].transpose(0, 1) for t in (cache.layers[FULL].keys, cache.layers[FULL].values))
    program = kv_only_circuit(emit_draft_chain(head, 1, max_width=8, kv=KV))
    shape = (KV.num_blocks, KV.block_size, c.num_key_value_heads, c.head_dim)
    states = {"k_cache": torch.zeros(shape), "v_cache": torch.zeros(shape)}
    table = SCATTERED.expand(rows, -1).contiguous()
    inputs = {"tokens": tokens.int(), "hidden": hidden, "positions": torch.arange(rows, dtype=torch.int32),
              "block_tables": table, "live_rows": torch.arange(rows, dtype=torch.int32),
              "active": torch.ones(rows, dtype=torch.int32)}
    inputs = {k: v for k, v in inputs.items() if any(x.name == k for x in program.values)}
    params = {k: t for k, t in head.bind(weights).items() if any(x.name == k for x in program.values)}
    EagerRunner(program, params, states).run(inputs)
    r = torch.arange(rows)
    blocks, slots = table[0, r // KV.block_size].long(), r % KV.block_size
    torch.testing.assert_close(states["k_cache"][blocks, slots], want_k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states["v_cache"][blocks, slots], want_v, atol=1e-5, rtol=1e-5)


def test_program_equals_eager_bitwise_at_widths_1_to_8(checkpoint) -> None:
    _, root = checkpoint
    assert_checkpoint_program_matches_eager(root, range(1, 9))


def test_interpreted_kernels_match_eager(checkpoint) -> None:
    _, root = checkpoint
    kernels = interpreted_kernels_match_eager(root)
    assert {("sigmoid_mul", "triton_sigmoid_mul"), ("zero_centred_head_rmsnorm", "triton_zero_centred_head_rmsnorm"),
            ("zero_centred_rmsnorm", "triton_zero_centred_rmsnorm"), ("rope_kv_write", "triton_rope_kv_write"),
            ("moe_experts", "triton_moe_grouped")} <= kernels


def test_plan_checkpoint_reports_the_qwen3_next_head(checkpoint, tmp_path, capsys) -> None:
    _, root = checkpoint
    out = tmp_path / "plan.json"
    assert main(["plan", "--checkpoint", str(root), "--widths", "1,4", "--num-drafts", "2", "--device", "cpu",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["notes"]["head"].startswith("Qwen3NextMtpHead: gated attention")
    assert report["notes"]["qwen3_next"]["hidden_handed_on"] == "after mtp.norm"
    ops = {n["op"] for n in report["nodes"]}
    assert {"sigmoid_mul", "moe_route", "moe_experts", "zero_centred_rmsnorm", "zero_centred_head_rmsnorm"} <= ops
    # the routed experts, the shared expert and its gate are all in the bytes moved
    assert all(w["bytes_moved"] > 0 for w in report["widths"])


# ---- what is refused, by name ----
def _one(tmp_path: Path) -> Path:
    return qwen3_next_checkpoint(tmp_path / "q3n", seed=1)


def _edit(root: Path, drop: tuple[str, ...] = (), add: dict[str, torch.Tensor] | None = None) -> None:
    file = root / "model.safetensors"
    tensors = {k: v for k, v in load_file(os.fspath(file)).items() if k not in drop}
    save_file({**tensors, **(add or {})}, os.fspath(file), metadata={"format": "pt"})


@pytest.mark.parametrize("name", ["mtp.pre_fc_norm_hidden.weight", "mtp.layers.0.self_attn.q_norm.weight",
                                  "mtp.layers.0.mlp.shared_expert_gate.weight", "lm_head.weight"])
def test_a_missing_tensor_is_named(tmp_path, name) -> None:
    root = _one(tmp_path)
    _edit(root, drop=(name,))
    with pytest.raises(MissingTensorError, match=f"'{re.escape(name.removeprefix('mtp.'))}'.*{re.escape(name)}"):
        load_mtp_weights(root)


def test_a_checkpoint_without_its_mtp_layer_is_named(tmp_path) -> None:
    root = _one(tmp_path)
    _edit(root, drop=tuple(k for k in load_file(os.fspath(root / "model.safetensors")) if k.startswith("mtp.")))
    with pytest.raises(MissingMtpLayerError, match=r"'mtp\.fc\.weight' is in none of"):
        load_head(root)


@pytest.mark.parametrize("name, shape", [("mtp.fc.bias", (32,)), ("mtp.layers.0.self_attn.o_proj.bias", (32,)),
                                         ("mtp.embed_tokens.weight", (64, 32)), ("mtp.layers.1.fc.weight", (32, 64)),
                                         ("mtp.layers.0.self_attn.q_proj.weight_scale_inv", (1, 1))])
def test_an_extra_mtp_tensor_is_refused_by_name(tmp_path, name, shape) -> None:
    root = _one(tmp_path)
    _edit(root, add={name: torch.ones(shape)})
    with pytest.raises(UnsupportedTensorError, match=f"'{re.escape(name)}'.*Qwen3NextForCausalLM"):
        load_mtp_weights(root)


@pytest.mark.parametrize("bad, error", [(torch.full((32, 64), float("nan")), NonFiniteTensorError),
                                        (torch.ones(32, 64, dtype=torch.int32), TensorDtypeError)])
def test_non_finite_or_integer_weights_are_refused_by_name(tmp_path, bad, error) -> None:
    root = _one(tmp_path)
    _edit(root, add={"mtp.fc.weight": bad})
    with pytest.raises(error, match=r"'mtp\.fc\.weight'"):
        load_mtp_weights(root)


def test_tensors_of_other_layers_are_ignored_and_strict_refuses_strangers(tmp_path) -> None:
    root = _one(tmp_path)
    _edit(root, add={"model.layers.0.linear_attn.extra.weight": torch.ones(3), "vision.proj.weight": torch.ones(2)})
    load_mtp_weights(root)  # the target's layers and unrelated tensors are not the drafter's
    with pytest.raises(UnexpectedTensorError, match=r"'vision\.proj\.weight'"):
        load_mtp_weights(root, strict=True)


@pytest.mark.parametrize("fields, error, match", [
    ({"attention_bias": True}, UnsupportedConfigError, r"'attention_bias' = True \(Qwen3NextForCausalLM"),
    ({"decoder_sparse_step": 2}, UnsupportedConfigError, r"'decoder_sparse_step' = 2"),
    ({"mlp_only_layers": [0]}, UnsupportedConfigError, r"'mlp_only_layers' = \[0\]"),
    ({"hidden_act": "gelu"}, UnsupportedConfigError, r"'hidden_act' = 'gelu'"),
    ({"mtp_use_dedicated_embeddings": True}, UnsupportedConfigError, r"'mtp_use_dedicated_embeddings' = True"),
    ({"num_nextn_predict_layers": 2}, ConfigError, r"'num_nextn_predict_layers' = 2: the Qwen3-Next head runs one"),
    ({"mtp_num_hidden_layers": 3}, ConfigError, r"aliases disagree"),
    ({"num_experts": None}, ConfigError, r"'num_experts' is required"),
    ({"partial_rotary_factor": 0.5}, ConfigError, r"aliases disagree: rope_parameters\.partial_rotary_factor=0\.25"),
])
def test_bad_qwen3_next_fields_are_named(tmp_path, fields, error, match) -> None:
    root = _one(tmp_path)
    set_config(root, **fields)
    with pytest.raises(error, match=rf"config\.json: .*{match}"):
        read_config(root)


def test_qwen3_next_is_refused_as_a_target(tmp_path) -> None:
    root = _one(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match=r"Qwen3NextForCausalLM.*cannot be the target: its linear-attention"):
        load_target_weights(root)
