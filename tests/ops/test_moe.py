"""MoE ops, config and checkpoints (CPU): routing and experts against independent loop references
(ties, group limits, masked slots, fp8 blocks), shape errors, the cost estimate, the MoE chain
eager vs program bitwise at widths 1..8 (and with interpreted kernels), config and checkpoints."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.ir import TensorSpec
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.ops import moe as ops_moe
from draft_circuit.circuit.layers import checkpoint as ckpt
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.config import ConfigError
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead, MoeWeightError, quantize_blocks, random_moe_weights
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.ops.registry import CostContext, ShapeError, get_op
from draft_circuit.runners.testing import assert_program_matches_eager, random_draft_batch, run_side_by_side

CFG = MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
KV = KvLayout(num_blocks=48, block_size=8, max_blocks_per_seq=6)
K = 3


# ---- routing against a loop reference (float64, sorted by (-score, id): ties to the lowest id) ----
def loop_route(x, gate, bias, top_k, scoring="sigmoid", n_group=1, topk_group=1, norm=True, scale=1.0):
    ids, weights = [], []
    for row in x.double().tolist():
        logits = [sum(a * b for a, b in zip(row, g)) for g in gate.double().tolist()]
        if scoring == "sigmoid":
            scores = [1 / (1 + math.exp(-v)) for v in logits]
        else:
            top = max(logits)
            scores = [math.exp(v - top) / sum(math.exp(u - top) for u in logits) for v in logits]
        choice = [s + (float(bias[e]) if bias is not None else 0.0) for e, s in enumerate(scores)]
        size = len(scores) // n_group
        gscore = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        kept = sorted(range(n_group), key=lambda g: (-gscore[g], g))[:topk_group] if n_group > 1 else [0]
        pool = [e for e in range(len(scores)) if e // size in kept]
        chosen = sorted(pool, key=lambda e: (-choice[e], e))[:top_k]
        w = [scores[e] for e in chosen]
        if norm and top_k > 1:
            w = [v / sum(w) for v in w]
        ids.append(chosen)
        weights.append([v * scale for v in w])
    return ids, weights


def run_route(x, gate, bias=None, **attrs):
    op = get_op("moe_route")
    return op.reference([x, gate] + ([bias] if bias is not None else []), op.parse_attrs(attrs))


@pytest.mark.parametrize("case", [
    dict(top_k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5, bias=True),
    dict(top_k=2, n_group=1, topk_group=1, bias=True, norm_topk_prob=False),
    dict(top_k=4, scoring_func="softmax", bias=False),
    dict(top_k=1, scoring_func="softmax", bias=False, norm_topk_prob=True),
])
def test_route_matches_loop_reference(case):
    g = torch.Generator().manual_seed(3)
    x, gate = torch.randn(9, 20, generator=g), torch.randn(16, 20, generator=g) / 4
    bias = 0.3 * torch.randn(16, generator=g) if case.pop("bias") else None
    ids, w = run_route(x, gate, bias, **case)
    want_ids, want_w = loop_route(x, gate, bias, case["top_k"], case.get("scoring_func", "sigmoid"),
                                  case.get("n_group", 1), case.get("topk_group", 1),
                                  case.get("norm_topk_prob", True), case.get("routed_scaling_factor", 1.0))
    assert ids.dtype == torch.int32 and w.dtype == torch.float32
    assert ids.tolist() == want_ids
    torch.testing.assert_close(w.double(), torch.tensor(want_w, dtype=torch.float64), atol=1e-6, rtol=1e-5)


def test_group_limit_excludes_the_best_expert_of_a_weak_group():
    # x = e0, so logits are gate[:, 0] exactly; group 0 holds the best single expert but the
    # smallest top-2 sum, so group-limited routing must skip it
    x = torch.zeros(1, 4)
    x[0, 0] = 1
    gate = torch.zeros(8, 4)
    gate[:, 0] = torch.tensor([5.0, -5.0, 1.0, 1.0, 0.9, 0.9, 0.8, 0.8])
    ids, _ = run_route(x, gate, torch.zeros(8), top_k=2, n_group=4, topk_group=2)
    assert ids.tolist() == [[2, 3]]
    ids, _ = run_route(x, gate, torch.zeros(8), top_k=2)  # no group limit: expert 0 wins
    assert ids.tolist() == [[0, 2]]


def test_ties_go_to_the_lowest_expert_id():
    x = torch.zeros(2, 4)
    x[:, 0] = 1
    gate = torch.zeros(8, 4)
    gate[:, 0] = torch.tensor([0.0, 2.0, 1.0, 2.0, 1.0, 2.0, 0.0, 1.0])  # exact ties
    ids, w = run_route(x, gate, None, top_k=4, scoring_func="softmax", norm_topk_prob=False)
    assert ids.tolist() == [[1, 3, 5, 2]] * 2 and ids.tolist() == loop_route(x, gate, None, 4, "softmax", norm=False)[0]
    assert w[0, 0] == w[0, 1] == w[0, 2]
    # group ties: groups {0,1}, {2,3} score the same; the lower group is kept
    gate[:, 0] = torch.tensor([1.0, 0.5, 0.5, 1.0, -1.0, -1.0, -2.0, -2.0])
    ids, _ = run_route(x, gate, torch.zeros(8), top_k=2, n_group=4, topk_group=1)
    assert ids.tolist() == [[0, 1]] * 2


def test_route_bias_selects_but_weights_are_unbiased():
    x = torch.zeros(1, 4)
    x[0, 0] = 1
    gate = torch.zeros(4, 4)
    gate[:, 0] = torch.tensor([2.0, 1.0, 0.0, -1.0])
    ids, w = run_route(x, gate, torch.tensor([0.0, 0.0, 0.0, 10.0]), top_k=2, norm_topk_prob=False)
    assert ids.tolist() == [[3, 0]]
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[-1.0, 2.0]])))


@pytest.mark.parametrize("attrs,ins,match", [
    ({"top_k": 2, "scoring_func": "softmax"}, ["x", "gate", "bias"], "for sigmoid routing"),
    ({"top_k": 9}, ["x", "gate"], "top_k 9 exceeds"),
    ({"top_k": 2, "n_group": 3, "topk_group": 1}, ["x", "gate"], "must divide 8 experts"),
    ({"top_k": 2}, ["x16", "gate"], "gate_weight .* must be x's dtype"),
])
def test_route_shape_errors(attrs, ins, match):
    specs = {"x": TensorSpec(dtype="float32", shape=("n", 6)), "x16": TensorSpec(dtype="float32", shape=("n", 6)),
             "gate": TensorSpec(dtype="float32", shape=(8, 6)), "bias": TensorSpec(dtype="float32", shape=(8,))}
    if "x16" in ins:
        specs["gate"] = TensorSpec(dtype="float16", shape=(8, 6))
    op = get_op("moe_route")
    with pytest.raises(ShapeError, match=match):
        op.infer([specs[i] for i in ins], op.parse_attrs(attrs))


# ---- experts against a loop reference over unstacked experts ----
def loop_experts(x, ids, w, gates, ups, downs, shared=None):
    out = []
    for i in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(ids.shape[1]):
            e = int(ids[i, j])
            if 0 <= e < len(gates):
                h = torch.nn.functional.silu(gates[e].double() @ x[i].double()) * (ups[e].double() @ x[i].double())
                acc += float(w[i, j]) * (downs[e].double() @ h)
        if shared is not None:
            g, u, d = (t.double() for t in shared)
            acc += d @ (torch.nn.functional.silu(g @ x[i].double()) * (u @ x[i].double()))
        out.append(acc)
    return torch.stack(out)


def test_experts_match_loop_reference_with_masked_slots():
    g = torch.Generator().manual_seed(5)
    n, h, e, i, k, s = 6, 20, 5, 12, 3, 8
    x = torch.randn(n, h, generator=g)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).int()
    ids[2, 1], ids[4, 0] = -1, e  # masked slots add nothing
    w = torch.rand(n, k, generator=g)
    gates, ups = torch.randn(e, i, h, generator=g) / 4, torch.randn(e, i, h, generator=g) / 4
    downs = torch.randn(e, h, i, generator=g) / 3
    shared = (torch.randn(s, h, generator=g) / 4, torch.randn(s, h, generator=g) / 4, torch.randn(h, s, generator=g) / 3)
    got = ops_moe.experts_ref(x, ids, w, torch.cat([gates, ups], 1), downs,
                              (torch.cat(shared[:2]), shared[2]))
    torch.testing.assert_close(got.double(), loop_experts(x, ids, w, gates, ups, downs, shared), atol=1e-5, rtol=1e-5)


def test_fp8_experts_are_the_dense_experts_on_dequantised_weights():
    g = torch.Generator().manual_seed(6)
    x, e = torch.randn(3, 200, generator=g), 3
    gu, dn = torch.randn(e, 2 * 136, 200, generator=g) / 14, torch.randn(e, 200, 136, generator=g) / 12
    (qgu, sgu), (qdn, sdn) = quantize_blocks(gu), quantize_blocks(dn)
    assert sgu.shape == (e, 3, 2) and sdn.shape == (e, 2, 2) and qgu.dtype == torch.float8_e4m3fn
    real = ops_moe.dequantize_blocks(qgu, sgu)
    # e4m3: half an ulp of 3 mantissa bits, or of the subnormal step 2^-9 (times the block scale)
    assert ((real - gu).abs() <= gu.abs() * 2**-4 + ops_moe.expand_block_scales(sgu, gu.shape) * 2**-10).all()
    ids, w = torch.tensor([[0, 2], [1, 0], [2, 1]], dtype=torch.int32), torch.rand(3, 2, generator=g)
    fp8 = get_op("moe_experts_fp8").reference([x, ids, w, qgu, sgu, qdn, sdn], None)[0]
    dense = ops_moe.experts_ref(x, ids, w, real, ops_moe.dequantize_blocks(qdn, sdn))
    assert torch.equal(fp8, dense)


def test_experts_shape_errors_name_the_tensor():
    f = lambda *shape, dt="float32": TensorSpec(dtype=dt, shape=shape)  # noqa: E731
    base = [f("n", 6), f("n", 2, dt="int32"), f("n", 2), f(4, 10, 6), f(4, 6, 5)]
    op = get_op("moe_experts")
    with pytest.raises(ShapeError, match="w_down must be"):
        op.infer(base[:4] + [f(4, 6, 4)], None)
    with pytest.raises(ShapeError, match="shared_gate_up and shared_down"):
        op.infer(base + [f(8, 6)], None)
    fp8 = [*base[:3], f(4, 10, 6, dt="float8_e4m3fn"), f(4, 1, 2), f(4, 6, 5, dt="float8_e4m3fn"), f(4, 1, 1)]
    with pytest.raises(ShapeError, match="w_gate_up_scale_inv must be"):
        get_op("moe_experts_fp8").infer(fp8, None)


def test_cost_reads_the_expected_distinct_experts():
    f = lambda *shape, dt="bfloat16": TensorSpec(dtype=dt, shape=shape)  # noqa: E731
    ins = [f("n", 64), f("n", 6, dt="int32"), f("n", 6, dt="float32"), f(64, 2 * 32, 64), f(64, 64, 32)]
    op, per_expert = get_op("moe_experts"), 3 * 32 * 64 * 2
    reads = []
    for n in (1, 4, 64, 512):
        cost = op.cost_at(ins, [f(n, 64)], None, CostContext(width=n), {"n": n})
        weights = cost.bytes_read - n * (64 * 2 + 6 * 8)
        assert weights == round(64 * (1 - (1 - 6 / 64) ** n) * per_expert)
        reads.append(weights)
    assert reads[0] == 6 * per_expert and reads == sorted(reads) and reads[-1] <= 64 * per_expert


# ---- the MoE chain ----
@pytest.fixture(scope="module")
def chain():
    head = MoeMtpHead(CFG)
    return head, emit_draft_chain(head, K, max_width=8, kv=KV), head.bind(random_moe_weights(CFG, seed=1))


def test_moe_chain_program_equals_eager_bitwise_at_widths_1_to_8(chain):
    head, circuit, params = chain
    assert_program_matches_eager(circuit, params, range(1, 9),
                                 lambda w: random_draft_batch(CFG, KV, w, seed=w, num_drafts=K))


def test_moe_chain_with_interpreted_kernels_matches_eager(chain, monkeypatch):
    head, circuit, params = chain
    opts = CompileOptions(interpret_kernels=True)
    compiled = compile_draft(circuit, params, [3], options=opts)
    kernels = {x.op: x.kernel for x in compiled.programs[3].launches}
    assert kernels["moe_experts"] == "triton_moe_grouped" and kernels["moe_route"] == "triton_moe_route"
    b = random_draft_batch(CFG, KV, 3, seed=9, num_drafts=K)
    r = run_side_by_side(circuit, params, compiled, b.inputs, b.states())
    assert torch.equal(r.got["drafts"], r.want["drafts"])
    torch.testing.assert_close(r.got["hidden_out"], r.want["hidden_out"], atol=1e-4, rtol=1e-4)
    monkeypatch.setenv(ops_moe.KILL_SWITCH, "1")  # read at planning: the plan shows the reference
    killed = compile_draft(circuit, params, [3], options=opts)
    assert {x.kernel for x in killed.programs[3].launches if x.op == "moe_experts"} == {"reference"}


@pytest.mark.parametrize("variant", ["fp8", "softmax"])
def test_fp8_and_softmax_heads_bind_and_run(variant):
    cfg = CFG if variant == "fp8" else dataclasses.replace(CFG, scoring_func="softmax", n_group=1,
                                                           topk_group=1, n_shared_experts=0)
    head = MoeMtpHead(cfg, fp8_experts=variant == "fp8")
    params = head.bind(random_moe_weights(cfg, seed=1))  # fp8: dense weights quantised per block
    if variant == "fp8":
        assert params["mlp.experts.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
        assert params["mlp.experts.down_proj.weight_scale_inv"].shape == (8, 1, 1)
    else:
        assert "mlp.gate.e_score_correction_bias" not in params and "mlp.shared_experts.down_proj.weight" not in params
    circuit = emit_draft_chain(head, K, max_width=8, kv=KV)
    assert {n.op for n in circuit.nodes} >= {"moe_route", "moe_experts_fp8" if variant == "fp8" else "moe_experts"}
    b = random_draft_batch(cfg, KV, 4, seed=2, num_drafts=K)
    r = run_side_by_side(circuit, params, compile_draft(circuit, params, [4]), b.inputs, b.states())
    assert torch.equal(r.got["drafts"], r.want["drafts"]) and ((r.want["drafts"] >= 0) & (r.want["drafts"] < 97)).all()


# ---- config ----
def hf(**overrides):
    d = {**CFG.to_hf(), **overrides}
    return {k: v for k, v in d.items() if v is not ...}


def test_config_round_trip_and_families():
    assert MoeConfig.from_hf(json.loads(json.dumps(CFG.to_hf()))) == CFG
    glm = MoeConfig.from_hf(hf(model_type="glm4_moe", scoring_func=..., norm_topk_prob=...))
    assert glm.scoring_func == "sigmoid" and glm.norm_topk_prob
    qwen = MoeConfig.from_hf(hf(model_type="qwen3_moe", scoring_func=..., norm_topk_prob=...,
                                n_routed_experts=..., num_experts=8, n_group=..., topk_group=...))
    assert qwen.scoring_func == "softmax" and not qwen.norm_topk_prob and qwen.num_experts == 8


@pytest.mark.parametrize("overrides,match", [
    (dict(num_experts=16), "n_routed_experts=8.*num_experts=16"),
    (dict(moe_intermediate_size=...), "'moe_intermediate_size' is required"),
    (dict(expert_parallel_size=3), "'expert_parallel_size' = 3: must divide"),
    (dict(n_group=3), "'n_group' = 3"),
    (dict(num_experts_per_tok=5), "'num_experts_per_tok' = 5"),
    (dict(routing_dtype="float64"), "'routing_dtype'"),
    (dict(scoring_func="softmax"), "'n_group' = 4"),
])
def test_config_errors_name_the_field(overrides, match):
    with pytest.raises(ConfigError, match=match):
        MoeConfig.from_hf(hf(**overrides))


# ---- checkpoints ----
def test_moe_checkpoint_round_trip(tmp_path):
    write_random_checkpoint(tmp_path, CFG, seed=4)
    config = ckpt.read_config(tmp_path)
    assert config == CFG and isinstance(config, MoeConfig)
    _, weights = ckpt.load_mtp_weights(tmp_path, strict=True)
    files = load_file(str(tmp_path / "model.safetensors"))
    L = CFG.num_hidden_layers
    assert set(weights) == set(MoeMtpHead(CFG).param_shapes()) - {
        "mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight",
        "mlp.shared_experts.gate_up_proj.weight", "mlp.shared_experts.down_proj.weight"} | {
        f"mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")} | {
        f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")}
    for name, t in weights.items():
        assert torch.equal(t, files[f"model.layers.{L}.{name}"]), name
    assert files[f"model.layers.{L}.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    MoeMtpHead(CFG).bind(weights)


def test_fp8_checkpoint_keeps_or_dequantises(tmp_path):
    cfg = dataclasses.replace(CFG, moe_intermediate_size=128, n_shared_experts=0)
    write_random_checkpoint(tmp_path, cfg, seed=4, dtype=torch.bfloat16, fp8_experts=True)
    _, kept = ckpt.load_mtp_weights(tmp_path, dtype=torch.bfloat16, keep_fp8=True, strict=True)
    _, dense = ckpt.load_mtp_weights(tmp_path, dtype=torch.float32)
    name = "mlp.experts.3.up_proj.weight"
    assert kept[name].dtype == torch.float8_e4m3fn and kept[name + "_scale_inv"].shape == (1, 1)
    assert torch.equal(dense[name], ops_moe.dequantize_blocks(kept[name], kept[name + "_scale_inv"]))
    params = MoeMtpHead(cfg, "bfloat16", fp8_experts=True).bind(kept)
    assert torch.equal(params["mlp.experts.gate_up_proj.weight"][3, 128:].view(torch.uint8),
                       kept[name].view(torch.uint8))  # stored fp8 is kept bit for bit
    small = dataclasses.replace(cfg, moe_intermediate_size=24)
    weights = random_moe_weights(small)
    for k in [k for k in weights if "experts." in k]:
        weights[k], weights[k + "_scale_inv"] = quantize_blocks(weights[k])
    with pytest.raises(MoeWeightError, match="multiple of 128"):  # gate and up scales cannot stack
        MoeMtpHead(small, fp8_experts=True).bind(weights)
    dense_params = MoeMtpHead(small).bind(weights)  # a dense head dequantises instead
    assert torch.equal(dense_params["mlp.experts.down_proj.weight"][5], ops_moe.dequantize_blocks(
        weights["mlp.experts.5.down_proj.weight"], weights["mlp.experts.5.down_proj.weight_scale_inv"]))


def test_missing_expert_and_missing_scale_are_named(tmp_path):
    write_random_checkpoint(tmp_path / "a", CFG, seed=0)
    file = tmp_path / "a" / "model.safetensors"
    key = f"model.layers.{CFG.num_hidden_layers}.mlp.experts.3.up_proj.weight"
    tensors = load_file(str(file))
    save_file({k: v for k, v in tensors.items() if k != key}, str(file))
    with pytest.raises(ckpt.MissingTensorError, match=r"mlp\.experts\.3\.up_proj\.weight"):
        ckpt.load_mtp_weights(tmp_path / "a")
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, str(file))
    with pytest.raises(ckpt.CorruptFileError, match="up_proj.weight_scale_inv"):
        ckpt.load_mtp_weights(tmp_path / "a")
    with pytest.raises(ValueError, match="needs a MoeConfig"):
        write_random_checkpoint(tmp_path / "b", fp8_experts=True)
