"""The plain-torch DeepSeek-V3 MTP peer (benchmarks/torch_mtp_mla.py) against the project's eager
oracle (DeepseekMtpHead's draft chain under EagerRunner), fp32 on CPU: the same drafts (exactly),
confidences, hidden out and written latent rows (tight tolerance), at n = 1 and wider, with the
chain's rows crossing block boundaries and positions past original_max_position_embeddings, for
q_lora_rank set and None, interleaved and rotate-half RoPE, real and fp8 block-scaled weights.
Its YaRN table, attention factor, softmax scale and router equal the project's; the benchmark's
deepseek_v3 setup shares the big tensors with the circuit's params."""
from __future__ import annotations

import pytest
import torch

from benchmarks import deepseek_head as dsh
from benchmarks import torch_mtp as tm
from benchmarks import torch_mtp_mla as tmla
from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead, mtp_checkpoint_shapes
from draft_circuit.circuit.layers.moe import BIAS, GATE
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.ops.moe import MoeRouteAttrs, route_select
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import random_draft_batch
from tests.layers.deepseek_fixtures import random_weights, tiny_config

K = 3
KV = KvLayout(num_blocks=80, block_size=4, max_blocks_per_seq=9)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py beside this file


def run_both(c, head, weights, width: int, seed: int, offset: int):
    """(oracle outputs, oracle pools, peer outputs, peer pool, inputs) of one random batch."""
    batch = random_draft_batch(c, KV, width, seed=seed, num_drafts=K)
    g = torch.Generator().manual_seed(seed)
    k_shape, v_shape = head.cache_shapes(KV)
    states = {"k_cache": torch.randn(k_shape, generator=g), "v_cache": torch.randn(v_shape, generator=g)}
    x = batch.inputs
    x["positions"] += offset
    pool = tmla.latent_pool(states["k_cache"], states["v_cache"])
    want = EagerRunner(emit_draft_chain(head, K, max_width=8, kv=KV), head.bind(weights), states).run(x)
    w = tmla.peer_weights(c, weights, torch.float32)
    blocks = tm.attn_blocks_for(max(batch.lives), K, KV.block_size, KV.max_blocks_per_seq)
    shape = tm.StepShape(c, KV.block_size, blocks)
    got = tmla.mla_chain(w, shape, tmla.rope_inv_freq(c.rope, c.qk_rope_head_dim), K, x["tokens"], x["hidden"],
                         x["positions"], x["block_tables"].clamp(min=0), x["live_rows"], pool)
    return want, states, got, pool, x


def check_same(want, states, got, pool):
    drafts, confs, hidden = got
    assert drafts.dtype == torch.int32 and drafts.shape == want["drafts"].shape
    assert torch.equal(drafts, want["drafts"]), (drafts, want["drafts"])
    torch.testing.assert_close(confs, want["confidences"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden, want["hidden_out"], atol=1e-5, rtol=1e-5)
    # the same rows written with the same values, nothing else touched
    torch.testing.assert_close(pool, tmla.latent_pool(states["k_cache"], states["v_cache"]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("offset", [40, 5000])  # original_max_position_embeddings is 16
def test_peer_chain_equals_eager_oracle(width, offset):
    c = tiny_config()
    head = DeepseekMtpHead(c)
    weights = random_weights(mtp_checkpoint_shapes(c), 1 + width)
    want, states, got, pool, x = run_both(c, head, weights, width, seed=10 + width, offset=offset)
    assert int(x["positions"].min()) > c.rope.original_max_position_embeddings
    if width == 8:  # some sequence's k rows span two blocks
        assert any(len({r // KV.block_size for r in range(live, live + K)}) > 1
                   for live in x["live_rows"].tolist())
    check_same(want, states, got, pool)


@pytest.mark.parametrize("overrides", [{"q_lora_rank": None}, {"rope_interleave": False}],
                         ids=["q_proj", "rotate_half"])
def test_peer_variants_equal_eager_oracle(overrides):
    c = tiny_config(**overrides)
    head = DeepseekMtpHead(c)
    weights = random_weights(mtp_checkpoint_shapes(c), 5)
    check_same(*run_both(c, head, weights, 4, seed=21, offset=40)[:4])


def test_peer_equals_oracle_on_fp8_block_scaled_weights():
    """The benchmark's own tiny config and weights: fp8 projections and experts (the circuit
    keeps them fp8, the peer dequantises them once)."""
    c = dsh.DRY_DEEPSEEK
    head = DeepseekMtpHead(c, "float32", fp8_experts=True, fp8_dense=True)
    weights = dsh.random_weights(c, torch.device("cpu"), torch.float32, seed=3)
    assert weights["self_attn.q_b_proj.weight"].dtype == torch.float8_e4m3fn
    assert weights["mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    kv = KvLayout(num_blocks=80, block_size=4, max_blocks_per_seq=9)
    assert kv == KV
    check_same(*run_both(c, head, weights, 3, seed=8, offset=40)[:4])


def test_rope_tables_and_scale_equal_the_projects():
    for c in (tiny_config(), dsh.DEEPSEEK_V3, dsh.DRY_DEEPSEEK):
        p = c.qk_rope_head_dim
        assert torch.equal(tmla.rope_inv_freq(c.rope, p), c.rope.inv_freq(p))
        assert tmla.attention_factor(c.rope) == c.rope.attention_factor
        assert tmla.softmax_scale(c) == c.softmax_scale
    assert tmla.attention_factor(tiny_config().rope) != 1.0  # mscale 0.9 / mscale_all_dim 0.7


def test_router_equals_route_select():
    c = tiny_config()
    g = torch.Generator().manual_seed(2)
    w = {GATE: torch.randn(c.n_routed_experts, c.hidden_size, generator=g),
         BIAS: 0.1 * torch.randn(c.n_routed_experts, generator=g)}
    x = torch.randn(16, c.hidden_size, generator=g)
    ids, weights = tmla.route(w, c, x)
    attrs = MoeRouteAttrs(top_k=c.num_experts_per_tok, scoring_func="sigmoid", n_group=c.n_group,
                          topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob,
                          routed_scaling_factor=c.routed_scaling_factor)
    want_ids, want_w = route_select(torch.nn.functional.linear(x, w[GATE]), w[BIAS], attrs)
    order, want_order = ids.argsort(1), want_ids.long().argsort(1)  # compare by expert id
    assert torch.equal(ids.gather(1, order), want_ids.long().gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order), atol=1e-6, rtol=1e-6)


def test_dequantize_is_the_block_scaled_value():
    g = torch.Generator().manual_seed(0)
    real = torch.randn(200, 300, generator=g)
    from draft_circuit.circuit.layers.moe import quantize_blocks
    from draft_circuit.ops.moe import dequantize_blocks
    q, s = quantize_blocks(real)
    assert torch.equal(tmla.dequantize(q, s, torch.float32), dequantize_blocks(q, s))
    assert tmla.dequantize(real, None, torch.float32) is real  # stored in the dtype: shared
