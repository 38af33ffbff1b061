"""The DeepSeek-V3 MTP draft chain (MLA, YaRN, MoE): the CPU program equals the eager oracle
bitwise at widths 1..8; planned with the Triton kernels (interpreted) it drafts the same; each
chain writes exactly its k latent rows per sequence, across block boundaries, and nothing else."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead, mtp_checkpoint_shapes
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import assert_program_matches_eager, random_draft_batch, run_side_by_side

from tests.layers.deepseek_fixtures import random_weights, tiny_config

K = 3
KV = KvLayout(num_blocks=80, block_size=4, max_blocks_per_seq=9)


@pytest.fixture(scope="module")
def chain():
    c = tiny_config()
    head = DeepseekMtpHead(c)
    return c, head, emit_draft_chain(head, K, max_width=8, kv=KV), head.bind(random_weights(mtp_checkpoint_shapes(c), 1))


def batch(c, head, width: int, seed: int):
    b = random_draft_batch(c, KV, width, seed=seed, num_drafts=K)
    g = torch.Generator().manual_seed(seed)
    k_shape, v_shape = head.cache_shapes(KV)
    b.inputs["positions"] += 40  # far past original_max_position_embeddings (16)
    return b.inputs, {"k_cache": torch.randn(k_shape, generator=g), "v_cache": torch.randn(v_shape, generator=g)}


def test_chain_declares_the_latent_pools_and_mla_ops(chain):
    c, head, circuit, _ = chain
    assert circuit.value("k_cache").spec.shape == (80, 4, 1, c.qk_rope_head_dim)
    assert circuit.value("v_cache").spec.shape == (80, 4, 1, c.kv_lora_rank)
    ops = [n.op for n in circuit.nodes if n.name.startswith("s0.")]
    for op in ("rope_freqs", "mla_kv_write", "head_linear", "mla_decode_attention", "moe_route", "moe_experts"):
        assert op in ops, op
    assert circuit.node("s1.attention").attrs == {"scale": c.softmax_scale, "row_offset": 1}


def test_program_equals_eager_bitwise_at_widths_1_to_8(chain):
    c, head, circuit, params = chain
    assert_program_matches_eager(circuit, params, range(1, 9), lambda w: batch(c, head, w, seed=w))


def test_chain_writes_exactly_its_rows_across_block_boundaries(chain):
    c, head, circuit, params = chain
    inputs, states = batch(c, head, 6, seed=11)
    before = {k: v.clone() for k, v in states.items()}
    EagerRunner(circuit, params, states).run(inputs)
    written = torch.zeros(KV.num_blocks, KV.block_size, dtype=torch.bool)
    crossed = False
    for i, live in enumerate(inputs["live_rows"].tolist()):
        rows = range(live, live + K)
        crossed |= len({r // KV.block_size for r in rows}) > 1
        for r in rows:
            written[inputs["block_tables"][i, r // KV.block_size], r % KV.block_size] = True
    assert crossed  # some sequence's k rows span two blocks
    for name in states:
        changed = (states[name] != before[name]).flatten(2).any(-1)
        assert torch.equal(changed, written), name


def test_interpreted_kernels_draft_what_eager_drafts(chain):
    c, head, circuit, params = chain
    compiled = compile_draft(circuit, params, [3], options=CompileOptions(interpret_kernels=True))
    kernels = {x.op: x.kernel for x in compiled.programs[3].launches}
    assert kernels["mla_decode_attention"] == "triton_mla_decode" and kernels["head_linear"] == "triton_head_linear"
    assert kernels["mla_kv_write"] == "triton_mla_kv_write" and kernels["rope_freqs"] == "triton_rope_freqs"
    r = run_side_by_side(circuit, params, compiled, *batch(c, head, 3, seed=4))
    assert torch.equal(r.got["drafts"], r.want["drafts"])
    torch.testing.assert_close(r.got["hidden_out"], r.want["hidden_out"], atol=1e-4, rtol=1e-4)
    for name in r.want_states:
        torch.testing.assert_close(r.got_states[name], r.want_states[name], atol=1e-5, rtol=1e-5)
