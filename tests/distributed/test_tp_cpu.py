"""Tensor-parallel drafting on CPU (issue 21): gloo groups of 2 and 4 spawned from pytest (each spawn
with a deadline: a hang fails the test, never the suite), and the single-process facts (world
size 1, shard plans, refusals, reading only a rank's slices)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.layers import tp_checkpoint
from draft_circuit.circuit.layers.checkpoint import load_mtp_weights
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.layers.tp import TpConfigError, shard_head, shard_kv, shard_weights, tp_plan, vocab_shard
from draft_circuit.circuit.layers.tp_checkpoint import load_mtp_shard
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.ops.collectives import CollectiveError
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights
from tests.distributed import tp_workers
from tests.distributed.harness import ReadSpy, spawn

# 4 query heads, 2 KV heads: split over 2 ranks, replicated over 4; a vocabulary no world divides
CFG = MtpConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=8)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("tp_ckpt") / "ckpt", CFG, seed=4, shards=2)


# ---- gloo groups: one spawn per world size runs every check (tp_workers.suite_worker) ----
SUITES = {2: ("dense_chain", "moe_chain", "family_chain", "argmax_ties"), 4: ("dense_chain", "argmax_ties")}


@pytest.fixture(scope="module")
def suite(checkpoint, tmp_path_factory):
    ran: dict[int, object] = {}

    def results(world: int):
        if world not in ran:
            out = tmp_path_factory.mktemp(f"tp_suite_{world}")
            spawn(tp_workers.suite_worker, world, out, str(out), str(checkpoint), SUITES[world])
            ran[world] = out
        return ran[world]
    return results


def _passed(out, name: str, world: int) -> None:
    for rank in range(world):
        text = (out / f"{name}_{rank}.txt").read_text()
        assert text == "ok", f"rank {rank} of {world}:\n{text}"


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_chains_equal_the_whole_chain(world, suite):
    """Per rank: its slices loaded by get_slice, sharded eager and program chains (with and without
    a bitmask) == the unsharded chain (near-tie rule, confidences within 1e-4), program == sharded
    eager bitwise, a row alone == in the batch, every rank the same drafts (tp_workers)."""
    _passed(suite(world), "dense_chain", world)


def test_moe_head_sharded_within_each_expert(suite):
    _passed(suite(2), "moe_chain", 2)


def test_family_attention_options_shard(suite):
    _passed(suite(2), "family_chain", 2)


@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel_argmax_tie_rule_across_ranks(world, suite):
    _passed(suite(world), "argmax_ties", world)


def test_a_rank_that_fails_to_load_refuses_on_every_rank(checkpoint, tmp_path):
    bad = write_random_checkpoint(tmp_path / "bad", CFG, seed=4)
    tensors = load_file(bad / "model.safetensors")
    del tensors[f"model.layers.{CFG.num_hidden_layers}.mlp.gate_proj.weight"]  # rank 1's copy lacks it
    save_file(tensors, bad / "model.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    spawn(tp_workers.refusal_worker, 2, tmp_path, str(checkpoint), str(bad), str(out),
          collective_timeout_s=10.0)
    for rank in (0, 1):
        text = (out / f"load_{rank}.txt").read_text()
        assert text.startswith("ShardLoadError: loading the MTP head's shards") and "1 of 2 ranks" in text, text
        assert "rank 1: MissingTensorError" in text and "mlp.gate_proj.weight" in text and "rank 0:" not in text
    gone = (out / "gone_0.txt").read_text()
    assert gone.startswith("GroupTimeoutError: after rank 1 left: rank 0 got no answer"), gone


# ---- one process ----
def test_world_size_one_shard_is_the_head_bitwise():
    """A shard of one rank emits the collectives (world size 1) and drafts exactly as the head."""
    head, weights = MtpHead(CFG), random_mtp_weights(CFG, seed=2)
    tp = shard_head(head, 0, 1)
    whole = emit_draft_chain(head, 3, max_width=4, kv=KV, bitmask=True)
    sharded = emit_draft_chain(tp, 3, max_width=4, kv=KV, bitmask=True)
    assert {n.op for n in sharded.nodes} >= {"all_reduce", "vocab_parallel_argmax"}
    batch = random_draft_batch(CFG, KV, 4, num_drafts=3, bitmask=True)
    want = EagerRunner(whole, head.bind(weights), batch.clone_states()).run(batch.inputs)
    params = tp.bind(shard_weights(weights, tp.tp))
    got = EagerRunner(sharded, params, batch.clone_states()).run(batch.inputs)
    prog = ProgramRunner(compile_draft(sharded, params, [4]), batch.clone_states()).run(batch.inputs)
    for k in want:
        assert torch.equal(got[k], want[k]) and torch.equal(prog[k], want[k]), k


def test_collectives_refuse_a_world_without_its_group():
    tp = shard_head(MtpHead(CFG), 0, 2)
    chain = emit_draft_chain(tp, 1, max_width=2, kv=KV)
    weights = shard_weights(random_mtp_weights(CFG, seed=2), tp.tp)
    batch = random_draft_batch(CFG, KV, 2, num_drafts=1)
    states = {k: shard_kv(v, tp.tp) for k, v in batch.states().items()}
    with pytest.raises(CollectiveError, match="emitted for 2 ranks; the process group has 1"):
        EagerRunner(chain, tp.bind(weights), states)  # no group given, torch.distributed not started
    with pytest.raises(CollectiveError, match="emitted for 2 ranks; the process group has 1"):
        ProgramRunner(compile_draft(chain, tp.bind(weights), [2]), states)


def test_shard_plans_and_refusals():
    with pytest.raises(TpConfigError, match="a reduced draft vocabulary does not shard yet"):
        emit_draft_chain(shard_head(MtpHead(CFG), 0, 2), 1, max_width=2, kv=KV, draft_vocab=64)
    assert [vocab_shard(250, r, 4) for r in range(4)] == [(0, 63), (63, 63), (126, 62), (188, 62)]
    p = tp_plan(CFG, 3, 4)
    assert p.q_heads == (3, 4) and p.kv_heads == (1, 2) and p.kv_replicated  # q head 3 reads kv head 1
    assert tp_plan(CFG, 1, 2).kv_heads == (1, 2) and not tp_plan(CFG, 1, 2).kv_replicated
    with pytest.raises(TpConfigError, match="'num_attention_heads' = 4 is not divisible by 3"):
        tp_plan(CFG, 0, 3)
    with pytest.raises(TpConfigError, match="'num_key_value_heads' = 3"):
        tp_plan(dataclasses.replace(CFG, num_attention_heads=6, num_key_value_heads=3,
                                    intermediate_size=96), 0, 2)
    with pytest.raises(TpConfigError, match="rank 2 of world size 2"):
        tp_plan(CFG, 2, 2)
    moe = MoeConfig(**{**dataclasses.asdict(CFG), "n_routed_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 16, "expert_parallel_size": 2})
    with pytest.raises(TpConfigError, match=r"expert parallelism \(config field 'expert_parallel_size' = 2\)"):
        shard_head(MoeMtpHead(moe), 0, 2)
    with pytest.raises(TpConfigError, match="fp8 experts do not shard"):
        shard_head(MoeMtpHead(dataclasses.replace(moe, expert_parallel_size=1), fp8_experts=True), 0, 2)


def test_a_rank_reads_only_its_slices(checkpoint, monkeypatch):
    """Bytes read per rank == its slices' bytes (the sharded tensors' 1/world, replicated ones
    whole); the slices equal the whole load's, narrowed; never a get_tensor."""
    _, whole = load_mtp_weights(checkpoint)
    world = 4
    for rank in range(world):
        counts: dict[str, int] = {}
        monkeypatch.setattr(tp_checkpoint, "_open_file", ReadSpy(counts))
        config, shard = load_mtp_shard(checkpoint, rank, world)
        plan = tp_plan(config, rank, world)
        want = shard_weights(whole, plan)
        assert shard.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(shard[name], t), name
        read = sum(counts.values())
        assert read == sum(t.numel() * 4 for t in want.values())  # exactly the slices, once each
        layer = f"model.layers.{CFG.num_hidden_layers}."
        assert counts[layer + "shared_head.head.weight"] == plan.vocab[1] * CFG.hidden_size * 4
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
            assert counts[layer + name] == whole[name].numel() * 4 // world, name
        assert counts[layer + "embed_tokens.weight"] == whole["embed_tokens.weight"].numel() * 4  # replicated


def test_a_moe_ranks_slices_load_from_its_checkpoint(tmp_path):
    """Per-expert tensors (routed and shared) load as their intermediate-dim slices; the router whole."""
    moe = MoeConfig(**{**dataclasses.asdict(CFG), "n_routed_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 16, "n_shared_experts": 1})
    path = write_random_checkpoint(tmp_path / "moe", moe, seed=1)
    _, whole = load_mtp_weights(path)
    for rank in range(2):
        config, shard = load_mtp_shard(path, rank, 2)
        want = shard_weights(whole, tp_plan(config, rank, 2))
        assert shard.keys() == want.keys() and all(torch.equal(shard[k], want[k]) for k in want)
        assert shard["mlp.experts.3.down_proj.weight"].shape == (CFG.hidden_size, 8)
        assert shard["mlp.shared_experts.up_proj.weight"].shape == (8, CFG.hidden_size)
        assert shard["mlp.gate.weight"].shape == (4, CFG.hidden_size)


@pytest.mark.parametrize("dtype,inter,world", [(torch.float32, 16, 2), (torch.bfloat16, 16, 2),
                                               (torch.float32, 384, 4)])
def test_fp8_block_scaled_experts_load_dequantised_as_their_slices(tmp_path, monkeypatch, dtype, inter, world):
    """Each fp8 expert weight is read as its slice (gate/up rows, down_proj columns; starting
    mid-block, or at 384 over 4 ranks spanning two 128-blocks) with the scale blocks covering it,
    and dequantised: bitwise the whole dequantised load's, narrowed; the bytes read are the fp8
    slices and the covering scales alone."""
    moe = MoeConfig(**{**dataclasses.asdict(CFG), "n_routed_experts": 4, "num_experts_per_tok": 2,
                       "moe_intermediate_size": inter})
    path = write_random_checkpoint(tmp_path / "fp8", moe, seed=1, fp8_experts=True)
    _, whole = load_mtp_weights(path, dtype=dtype)  # dequantised into dtype
    layer, per = f"model.layers.{CFG.num_hidden_layers}.", inter // world
    for rank in range(world):
        counts: dict[str, int] = {}
        monkeypatch.setattr(tp_checkpoint, "_open_file", ReadSpy(counts))
        config, shard = load_mtp_shard(path, rank, world, dtype=dtype)
        want = shard_weights(whole, tp_plan(config, rank, world))
        assert shard.keys() == want.keys()
        for name, t in want.items():
            assert shard[name].dtype == t.dtype and torch.equal(shard[name], t), name
        assert all(t.dtype != torch.float8_e4m3fn for t in shard.values())  # a shard binds unquantised
        up, down = layer + "mlp.experts.2.up_proj.weight", layer + "mlp.experts.2.down_proj.weight"
        assert counts[up] == counts[down] == per * CFG.hidden_size  # fp8: a byte a weight
        blocks = (rank + 1) * per // 128 - rank * per // 128 + (((rank + 1) * per) % 128 > 0)
        assert counts[up + "_scale_inv"] == counts[down + "_scale_inv"] == blocks * 4  # H is one block
        assert shard["mlp.experts.2.down_proj.weight"].shape == (CFG.hidden_size, per)


def test_collective_bindings_declare_the_kernels_they_run():
    """Plan reports count launches: the argmax's torch binding declares the aten kernels it runs
    (counted on real tensors here, world size 1: its gather is the one copy), gather_sum two."""
    from draft_circuit.circuit.ir import ROW, TensorSpec
    from draft_circuit.ops.bindings import aten_kernels
    from draft_circuit.ops.registry import get_op

    op = get_op("vocab_parallel_argmax")
    for with_mask in (False, True):
        specs = [TensorSpec(dtype="float32", shape=(ROW, 70))] + \
            ([TensorSpec(dtype="int32", shape=(ROW, 3))] if with_mask else [])
        attrs = op.parse_attrs({"vocab_size": 70})
        binding = next(k for k in op.kernels if k.name == "torch_vocab_parallel_argmax")
        ins = [torch.randn(3, 70)] + ([torch.full((3, 3), -1, dtype=torch.int32)] if with_mask else [])
        outs = [torch.empty(3, dtype=torch.int32), torch.empty(3)]
        ws = [torch.empty(shape, dtype=getattr(torch, dt)) for dt, shape in binding.workspace(specs, {ROW: 3}, attrs)]
        assert aten_kernels(lambda: binding.launch(ins, outs, ws, attrs)) == binding.launch_count(specs, attrs)
    triton = next(k for k in op.kernels if k.name == "triton_vocab_parallel_argmax")
    assert [triton.launch_count(specs, op.parse_attrs({"vocab_size": 70, "world_size": w, "vocab_offset": 0}))
            for w in (1, 2)] == [2, 3]  # partial, (gather,) combine
    assert {k.name: k.launches for k in get_op("all_reduce").kernels if not callable(k.launches)} == {
        "torch_all_reduce": 1, "gather_sum": 2, "torch_all_reduce_any": 1}


def test_a_shards_plan_report_renders_and_names_its_shard(tmp_path):
    """Regression: the report counts the argmax's launches at a concrete width (its launch count
    once traced 2 rows against 4-row specs and failed), states the shard, and the viz renders."""
    from draft_circuit.circuit.viz import write_all

    tp = shard_head(MtpHead(CFG), 1, 2)
    chain = emit_draft_chain(tp, 2, max_width=4, kv=KV)
    compiled = compile_draft(chain, tp.bind(shard_weights(random_mtp_weights(CFG, seed=2), tp.tp)), [1, 4],
                             notes=tp.plan_notes())
    report = compiled.report()
    assert report.notes["tensor_parallel"] == {
        "rank": 1, "world_size": 2, "query_heads": [2, 4], "kv_heads": [1, 2], "kv_replicated": False,
        "vocab_rows": [125, 250], "embedding": "replicated"}
    argmax = [x for x in compiled.programs[4].launches if x.op == "vocab_parallel_argmax"]
    assert len(argmax) == 2 and argmax[0].bytes_read == 4 * 125 * 4 + 12 * 4  # logits + partials received
    assert {p.name for p in write_all(report, tmp_path)} >= {"plan.html", "circuit.dot"}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_interpreted_partial_and_combine_kernels_match_the_whole_vocabulary(world):
    """kernels/vocab_parallel_argmax.py under the interpreter, ranks simulated in one process (the
    gather is a stack): tokens == argmax_logprob over the whole vocabulary, ties across and within
    ranks to the lowest id, mask by global id, NaN never, nothing allowed -1/-inf; log-probabilities
    close; a row alone == the row in the batch bitwise."""
    from draft_circuit.kernels.vocab_parallel_argmax import vocab_combine, vocab_partial
    from draft_circuit.ops.sampling import argmax_logprob_ref, mask_words

    vocab, n = 4100, 6  # more than one CHUNK a rank at world 1
    g = torch.Generator().manual_seed(world)
    logits = torch.randn(n, vocab, generator=g)
    last, _ = vocab_shard(vocab, world - 1, world)
    logits[0, [1, last + 1]] = 9.0
    logits[1, [last, last + 1]] = 9.0
    logits[2] = float("-inf")
    logits[3, 2], logits[3, last] = float("nan"), 7.0
    logits[4, [0, vocab - 1]] = 9.0
    mask = torch.randint(-2**31, 2**31 - 1, (n, mask_words(vocab)), generator=g, dtype=torch.int64).to(torch.int32)
    mask[:5] = -1
    mask[4, 0] = -2
    want_tok, want_lp = argmax_logprob_ref(logits, mask)

    def run(rows):
        parts = torch.empty(world, len(rows), 3, dtype=torch.int32)
        for r in range(world):
            off, size = vocab_shard(vocab, r, world)
            vocab_partial(logits[rows, off:off + size].contiguous(), mask[rows].contiguous(), off, parts[r])
        tok, lp = torch.empty(len(rows), dtype=torch.int32), torch.empty(len(rows))
        vocab_combine(parts, tok, lp)
        return tok, lp
    tok, lp = run(list(range(n)))
    assert torch.equal(tok, want_tok), (tok, want_tok)
    torch.testing.assert_close(lp, want_lp, atol=1e-5, rtol=1e-5)
    alone = run([5])
    assert torch.equal(alone[0], tok[5:]) and torch.equal(alone[1], lp[5:])
