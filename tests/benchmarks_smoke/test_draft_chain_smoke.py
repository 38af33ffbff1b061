"""CPU smoke test of the draft-chain benchmark (benchmarks/draft_chain.py).

1. The benchmark's plain-torch peer (benchmarks/torch_mtp.py) drafts exactly what the project's
   EagerRunner drafts on the same circuit (fp32, CPU), KV writes included: the peer is right.
2. The floor's byte count equals a hand count for a tiny config.
3. `--dry-run` runs end to end on CPU (every strategy; graphs stand in uncaptured, torch.compile
   with the eager backend) and writes its JSON and markdown.
4. The MoE config: the peer's MoE MLP (gather and dense paths) equals the op references, its
   chain equals EagerRunner on a MoeMtpHead circuit, the MoE floor equals a hand count, and
   `--dry-run --configs moe` runs every strategy with the same drafts.
"""
import json

import pytest
import torch

from benchmarks import draft_chain as dc
from benchmarks import torch_mtp as tm
from draft_circuit.ops.basic import linear_ref
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.moe import (BIAS, EXPERTS_DOWN, EXPERTS_GATE_UP, GATE, SHARED_DOWN, SHARED_GATE_UP,
                            MoeConfig, MoeMtpHead, random_moe_weights)
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.ops.moe import experts_ref, route_select
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights

CFG = MtpConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=8)
K = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py beside this file


@pytest.mark.parametrize("width", [1, 3])
@pytest.mark.parametrize("bounded", [False, True])
def test_torch_mtp_chain_equals_eager_runner(width, bounded):
    head = MtpHead(CFG)
    chain = emit_draft_chain(head, K, max_width=4, kv=KV)
    params = head.bind(random_mtp_weights(CFG, seed=7 + width))
    batch = random_draft_batch(CFG, KV, width, seed=100 + width, num_drafts=K)
    want_states = batch.clone_states()
    want = EagerRunner(chain, params, want_states).run(batch.inputs)

    blocks = (tm.attn_blocks_for(max(batch.lives), K, KV.block_size, KV.max_blocks_per_seq)
              if bounded else KV.max_blocks_per_seq)
    shape = tm.StepShape(CFG, KV.block_size, blocks)
    got_states = batch.clone_states()
    x = batch.inputs
    tables = x["block_tables"].clamp(min=0)  # unused tail entries are -1: any valid id will do
    drafts, confs, hidden = tm.mtp_chain(
        params, shape, tm.inv_freq(CFG.head_dim, CFG.rope_theta, "cpu"), K, x["tokens"],
        x["hidden"], x["positions"], tables, x["live_rows"], got_states["k_cache"],
        got_states["v_cache"])
    assert drafts.dtype == torch.int32 and drafts.shape == (width, K)
    assert torch.equal(drafts, want["drafts"]), (drafts, want["drafts"])
    torch.testing.assert_close(confs, want["confidences"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, want["hidden_out"], atol=1e-5, rtol=1e-5)
    for name in ("k_cache", "v_cache"):  # the same rows written with the same values
        torch.testing.assert_close(got_states[name], want_states[name], atol=1e-5, rtol=0)


def test_step_advance_hands_on_position_and_row():
    shape = tm.StepShape(CFG, KV.block_size, KV.max_blocks_per_seq)
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=3))
    batch = random_draft_batch(CFG, KV, 2, seed=5, num_drafts=K)
    x, st = batch.inputs, batch.clone_states()
    out = tm.mtp_step_advance(params, shape, tm.inv_freq(CFG.head_dim, CFG.rope_theta, "cpu"),
                              x["tokens"], x["hidden"], x["positions"],
                              x["block_tables"].clamp(min=0), x["live_rows"], st["k_cache"],
                              st["v_cache"])
    assert torch.equal(out[3], x["positions"] + 1) and torch.equal(out[4], x["live_rows"] + 1)
    assert out[3].dtype == out[4].dtype == torch.int32


def test_floor_bytes_by_hand():
    tiny = MtpConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                     num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=64)
    # weights a step, in elements (embedding table excluded): norms enorm, hnorm, input,
    # post-attention, shared_head 5 x 4 = 20; eh_proj 4 x 8 = 32; q 4 x 4 = 16; k, v 2 x 4 = 8
    # each; o 4 x 4 = 16; gate, up 6 x 4 = 24 each; down 4 x 6 = 24; lm head 10 x 4 = 40
    per_step = 20 + 32 + 16 + 8 + 8 + 16 + 24 + 24 + 24 + 40
    assert per_step == 212
    assert dc.weight_bytes(tiny, 2) == 424
    parts = dc.floor_bytes(tiny, width=3, num_drafts=2, kv_rows=10, dtype_bytes=2, max_blocks=4)
    kv_row = 2 * 1 * 2 * 2                      # K and V, 1 kv head, head_dim 2, bf16
    assert parts["weights"] == 2 * 424
    assert parts["kv_read"] == 3 * ((10 + 1) + (10 + 2)) * kv_row == 552
    assert parts["kv_write"] == 3 * 2 * kv_row == 48
    # a row: tokens, positions, live rows (12) + hidden 8 + table 16 in; drafts and
    # confidences 2 x 2 x 4 = 16 + hidden_out 8 out; 2 embedding rows of 8
    assert parts["activations"] == 3 * (12 + 8 + 16 + 16 + 8 + 16) == 228
    assert parts["total"] == 848 + 552 + 48 + 228 == 1676
    assert dc.floor_us(parts["total"], 1.0) == pytest.approx(1.676)  # 1 GB/s: 1676 ns


def test_dry_run_writes_json_and_markdown(tmp_path):
    md = tmp_path / "RESULTS.md"
    data = dc.main(["--dry-run", "--out", str(tmp_path), "--results-md", str(md)])
    files = list(tmp_path.glob("*-cpu.json"))
    assert len(files) == 1
    saved = json.loads(files[0].read_text())
    assert saved["partial"] is False and saved["copy_bandwidth_gbps"] > 0
    cfg = saved["configs"]["tiny"]
    row = cfg["widths"]["3"]
    assert set(row) == set(dc.STRATEGIES)
    for strategy, entry in row.items():
        assert "error" not in entry, (strategy, entry)
        assert entry["median_us"] > 0 and len(entry["samples_us"]) == 3
        assert entry["drafts_agree_eager"] == 1.0, strategy  # fp32: every strategy drafts the same
        assert entry["x_floor"] == pytest.approx(entry["median_us"] / cfg["floors"]["3"]["floor_us"])
    assert row["circuit"]["x_circuit"] == pytest.approx(1.0)
    assert cfg["circuit"]["widths_compiled"] == [1, 2, 3, 4]
    assert cfg["circuit"]["launches_per_step"]["3"] > 0
    assert data["configs"]["tiny"]["widths"]["3"]["eager"]["median_us"] == row["eager"]["median_us"]
    text = md.read_text()
    assert text.startswith("# Draft-chain benchmark results")
    assert "| n | floor us |" in text and "| 3 |" in text and "circuit: compile" in text


def test_markdown_sections_replace_and_stack(tmp_path):
    md = tmp_path / "R.md"
    base = {"date": "2026-01-01", "device": "X", "partial": False, "dry_run": False,
            "torch": "t", "cuda": None, "triton": None, "copy_bandwidth_gbps": 100.0,
            "copy_bytes": 2**30, "timing": "events", "strategies": [], "configs": {}}
    dc.write_markdown(str(md), {**base, "device": "first"}, "a.json")
    dc.write_markdown(str(md), {**base, "device": "second"}, "b.json")
    dc.write_markdown(str(md), {**base, "device": "first again"}, "a.json")
    text = md.read_text()
    assert text.count("<!-- run: a -->") == 1 and text.count("<!-- run: b -->") == 1
    assert "first again" in text and "2026-01-01, first\n" not in text
    assert text.index("<!-- run: b -->") < text.index("<!-- run: a -->")  # newest first


# ---- the MoE config ----
MOE_CFG = MoeConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                    num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)


def test_torch_moe_mlp_gather_and_dense_equal_the_references():
    params = MoeMtpHead(MOE_CFG).bind(random_moe_weights(MOE_CFG, seed=11))
    x = torch.randn(5, MOE_CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    attrs = tm.route_attrs(MOE_CFG)
    ids, weights = route_select(linear_ref(x, params[GATE]), params[BIAS], attrs)
    want = experts_ref(x, ids, weights, params[EXPERTS_GATE_UP], params[EXPERTS_DOWN],
                       (params[SHARED_GATE_UP], params[SHARED_DOWN]))
    for gather in (True, False):
        got = tm.moe_mlp(params, MOE_CFG, x, gather=gather)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert tm.moe_gathers(MOE_CFG, 1) and not tm.moe_gathers(MOE_CFG, 2)  # 3 x n x k < E


@pytest.mark.parametrize("width", [1, 3])  # 1: the gather path, 3: the dense one
def test_torch_moe_chain_equals_eager_runner(width):
    head = MoeMtpHead(MOE_CFG)
    chain = emit_draft_chain(head, K, max_width=4, kv=KV)
    params = head.bind(random_moe_weights(MOE_CFG, seed=7 + width))
    batch = random_draft_batch(MOE_CFG, KV, width, seed=100 + width, num_drafts=K)
    want_states = batch.clone_states()
    want = EagerRunner(chain, params, want_states).run(batch.inputs)
    shape = tm.StepShape(MOE_CFG, KV.block_size, KV.max_blocks_per_seq)
    got_states = batch.clone_states()
    x = batch.inputs
    drafts, confs, hidden = tm.mtp_chain(
        params, shape, tm.inv_freq(MOE_CFG.head_dim, MOE_CFG.rope_theta, "cpu"), K, x["tokens"],
        x["hidden"], x["positions"], x["block_tables"].clamp(min=0), x["live_rows"],
        got_states["k_cache"], got_states["v_cache"])
    assert torch.equal(drafts, want["drafts"]), (drafts, want["drafts"])
    torch.testing.assert_close(confs, want["confidences"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, want["hidden_out"], atol=1e-5, rtol=1e-5)
    for name in ("k_cache", "v_cache"):
        torch.testing.assert_close(got_states[name], want_states[name], atol=1e-5, rtol=0)


def test_moe_floor_bytes_by_hand():
    tiny = MoeConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                     num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=64,
                     n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=3,
                     n_shared_experts=1)
    # non-expert weights a step, in elements: norms 5 x 4 = 20; eh_proj 32; q 16; k, v 8 each;
    # o 16; lm head 40 -> 140 x 2 bytes = 280; router gate 4 x 4 x 2 = 32; its fp32 bias 4 x 4 =
    # 16; shared expert gate, up 3 x 4 and down 4 x 3 -> 36 x 2 = 72. No dense MLP.
    assert dc.weight_bytes(tiny, 2) == 280 + 32 + 16 + 72 == 400
    assert dc.expert_bytes(tiny, 2) == (3 * 4 + 3 * 4 + 4 * 3) * 2 == 72
    parts = dc.floor_bytes(tiny, width=3, num_drafts=2, kv_rows=10, dtype_bytes=2, max_blocks=4)
    # 3 rows picking 2 of 4 experts: 4 x (1 - (1/2)^3) = 3.5 distinct experts a step, 2 steps
    assert parts["experts"] == 2 * 3.5 * 72 == 504
    assert parts["weights"] == 2 * 400
    assert parts["kv_read"] == 552 and parts["kv_write"] == 48 and parts["activations"] == 228
    assert parts["total"] == 800 + 552 + 48 + 228 + 504 == 2132


def test_moe_dry_run_every_strategy_agrees(tmp_path):
    data = dc.main(["--dry-run", "--configs", "moe", "--out", str(tmp_path),
                    "--results-md", str(tmp_path / "R.md")])
    assert list(data["configs"]) == ["tiny_moe"]
    cfg = data["configs"]["tiny_moe"]
    row = cfg["widths"]["3"]
    assert set(row) == set(dc.STRATEGIES)
    for strategy, entry in row.items():
        assert "error" not in entry, (strategy, entry)
        assert entry["drafts_agree_eager"] == 1.0, strategy
    assert cfg["floors"]["3"]["bytes"]["experts"] > 0 and cfg["torch_moe_mode"] == {"3": "dense"}
    assert "MoE 8 experts" in (tmp_path / "R.md").read_text()
    assert dc.parse_args([]).configs == "small,8b"  # moe runs only when asked
