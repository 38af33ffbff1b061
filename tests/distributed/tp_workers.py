"""What each rank runs in the tensor-parallel tests (spawned by harness.spawn): module-level
functions, so the spawn start method can pickle them by name."""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.ir import ROW
from draft_circuit.circuit.layers.checkpoint import load_mtp_weights
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead, random_moe_weights
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.layers.tp import shard_head, shard_kv, shard_weights, vocab_shard
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.ops.sampling import argmax_logprob_ref, mask_words
from draft_circuit.runners.distributed import GroupTimeoutError, ShardLoadError, agree, load_sharded_head
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import compare_drafts, random_draft_batch, random_mtp_weights

KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=8)
K = 3
WIDTH = 4


def _gaps(out: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each draft's top-2 log-probability gap from the unsharded oracle's logits."""
    gaps = []
    for j in range(K):
        top2 = out[f"s{j}.lm_head"].float().log_softmax(-1).topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    return torch.stack(gaps, dim=1)


def _same_on_every_rank(group, t: torch.Tensor, what: str) -> None:
    gathered = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(gathered, t.contiguous(), group=group)
    for r, g in enumerate(gathered):
        assert torch.equal(g, t), f"{what}: rank {r} differs from rank {dist.get_rank(group)}"


def _check_shard_against_whole(rank, group, head: MtpHead, params, tp_head, tp_params, *, bitmask: bool,
                               seed: int) -> None:
    """Sharded eager and program chains against the unsharded eager chain (fp32): drafts equal under
    the near-tie rule, confidences, hidden and the KV rows written close; program == sharded eager
    bitwise; a row alone == the row inside the batch bitwise; every rank holds the same drafts."""
    c = head.config
    whole = emit_draft_chain(head, K, max_width=WIDTH, kv=KV, bitmask=bitmask)
    sharded = emit_draft_chain(tp_head, K, max_width=WIDTH, kv=KV, bitmask=bitmask)
    batch = random_draft_batch(c, KV, WIDTH, seed=seed, num_drafts=K, bitmask=bitmask)
    want_states = batch.clone_states()
    want = EagerRunner(whole, params, want_states).run(batch.inputs, keep=tuple(f"s{j}.lm_head" for j in range(K)))
    gaps = _gaps(want)
    plan = tp_head.tp
    states = {k: shard_kv(v, plan) for k, v in batch.states().items()}
    got_eager = EagerRunner(sharded, tp_params, states, group=group).run(batch.inputs)
    compared, _ = compare_drafts(got_eager, want, gaps, conf_atol=1e-4)
    assert compared >= WIDTH * K // 2, f"only {compared} drafts compared"  # not all near ties
    torch.testing.assert_close(got_eager["hidden_out"], want["hidden_out"], atol=1e-4, rtol=1e-4)
    for k in states:  # the KV rows the chain wrote: the shard's heads of the whole chain's
        torch.testing.assert_close(states[k], shard_kv(want_states[k], plan), atol=1e-4, rtol=1e-4)
    compiled = compile_draft(sharded, tp_params, [1, WIDTH])
    assert {x.op for x in compiled.programs[WIDTH].launches} >= {"all_reduce", "vocab_parallel_argmax"}
    prog_states = {k: shard_kv(v, plan) for k, v in batch.states().items()}
    runner = ProgramRunner(compiled, prog_states, group=group)
    got = {k: v.clone() for k, v in runner.run(batch.inputs).items()}
    for k in ("drafts", "confidences", "hidden_out"):
        assert torch.equal(got[k], got_eager[k]), f"program != sharded eager: {k}"
    for k in prog_states:
        assert torch.equal(prog_states[k], states[k]), f"program != sharded eager: {k}"
    alone_states = {k: shard_kv(v, plan) for k, v in batch.states().items()}
    alone = ProgramRunner(compiled, alone_states, group=group).run(
        {k: v[:1] for k, v in batch.inputs.items()})
    for k in ("drafts", "confidences", "hidden_out"):
        assert torch.equal(alone[k][0], got[k][0]), f"row 0 alone != row 0 in the batch: {k}"
    _same_on_every_rank(group, got["drafts"], "drafts")
    _same_on_every_rank(group, got["hidden_out"], "hidden_out")


def dense_chain_worker(rank: int, world: int, group, ckpt: str) -> None:
    """Each rank loads its slices of a written checkpoint; the oracle loads it whole."""
    head, tp_params = load_sharded_head(ckpt, group)
    config, weights = load_mtp_weights(ckpt)
    whole = MtpHead(config)
    assert head.config.num_key_value_heads == max(config.num_key_value_heads // world, 1)
    for bitmask, seed in ((False, 10 + world), (True, 20 + world)):
        _check_shard_against_whole(rank, group, whole, whole.bind(weights), head, tp_params,
                                   bitmask=bitmask, seed=seed)


def moe_chain_worker(rank: int, world: int, group) -> None:
    """The MoE head sharded within each expert (routed and shared), router replicated."""
    config = MoeConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                       num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                       n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                       n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.0)
    whole = MoeMtpHead(config)
    weights = random_moe_weights(config, seed=3)
    tp_head = shard_head(whole, rank, world)
    tp_params = tp_head.bind(shard_weights(weights, tp_head.tp))
    _check_shard_against_whole(rank, group, whole, whole.bind(weights), tp_head, tp_params,
                               bitmask=False, seed=5)


def family_chain_worker(rank: int, world: int, group) -> None:
    """The attention's family options shard too: q/k/v biases with their rows (Qwen2, GLM-4.5),
    per-head q/k norms and partial rotary replicated (Qwen3, GLM-4.5)."""
    config = MtpConfig(vocab_size=77, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                       num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                       qkv_bias=True, qk_norm=True, partial_rotary_factor=0.5)
    whole = MtpHead(config)
    weights = random_mtp_weights(config, seed=6)
    assert "self_attn.q_proj.bias" in weights and "self_attn.k_norm.weight" in weights
    tp_head = shard_head(whole, rank, world)
    tp_params = tp_head.bind(shard_weights(weights, tp_head.tp))
    _check_shard_against_whole(rank, group, whole, whole.bind(weights), tp_head, tp_params,
                               bitmask=True, seed=8)


def argmax_ties_worker(rank: int, world: int, group) -> None:
    """vocab_parallel_argmax across ranks == argmax_logprob over the whole vocabulary: ties across
    and within ranks go to the lowest global id, the mask is the whole vocabulary's, non-finite
    logits are never picked, a row with nothing allowed gives -1 and -inf; eager and program."""
    vocab, n = 23, 6
    off, rows = vocab_shard(vocab, rank, world)
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(n, vocab, generator=g)
    last_off, _ = vocab_shard(vocab, world - 1, world)
    logits[0, [1, last_off + 1]] = 9.0                 # tie across the first and last rank: id 1
    logits[1, [last_off, last_off + 1]] = 9.0          # tie inside the last rank: its first id
    logits[2] = float("-inf")                          # nothing finite: -1, -inf
    logits[3, 2], logits[3, last_off] = float("nan"), 7.0  # NaN is never a draft
    logits[4, [0, vocab - 1]] = 9.0                    # the mask removes id 0: the last id
    mask = torch.full((n, mask_words(vocab)), -1, dtype=torch.int32)
    mask[4, 0] = -2  # bit 0 cleared
    mask[5] = 0      # nothing allowed
    want_tok, want_lp = argmax_logprob_ref(logits, mask)
    assert want_tok.tolist()[:3] == [1, last_off, -1]
    b = CircuitBuilder("vp_argmax", max_width=n)
    x = b.input("logits", "float32", (ROW, rows))
    m = b.input("bitmask", "int32", (ROW, mask_words(vocab)))
    tok, lp = b.op("vocab_parallel_argmax", [x, m], {"world_size": world, "vocab_size": vocab,
                                                     "vocab_offset": off})
    b.output(tok, "token")
    b.output(lp, "logprob")
    circuit = b.build()
    inputs = {"logits": logits[:, off:off + rows].contiguous(), "bitmask": mask}
    eager = EagerRunner(circuit, {}, {}, group=group).run(inputs)
    program = ProgramRunner(compile_draft(circuit, {}, [n]), {}, group=group).run(inputs)
    # the Triton partial and combine (interpreted) around the same gloo gather
    compiled = compile_draft(circuit, {}, [n], options=CompileOptions(interpret_kernels=True))
    assert [x.kernel for x in compiled.programs[n].launches] == ["triton_vocab_parallel_argmax"]
    triton = ProgramRunner(compiled, {}, group=group).run(inputs)
    # no group given: torch.distributed's default group (what an engine under torchrun relies on)
    default = EagerRunner(circuit, {}, {}).run(inputs)
    for got in (eager, program, triton, default):
        assert torch.equal(got["token"], want_tok), (got["token"], want_tok)
        torch.testing.assert_close(got["logprob"], want_lp, atol=1e-6, rtol=1e-6)


def refusal_worker(rank: int, world: int, group, good: str, bad: str, out: str) -> None:
    """Rank 1 reads a checkpoint missing a tensor: every rank raises ShardLoadError naming rank 1
    and the tensor. Then rank 1 leaves: the others' next agreement fails typed, never hangs."""
    try:
        load_sharded_head(bad if rank == 1 else good, group)
    except ShardLoadError as e:
        Path(out, f"load_{rank}.txt").write_text(f"{type(e).__name__}: {e}")
    else:
        Path(out, f"load_{rank}.txt").write_text("loaded")
    if rank == 1:  # dies before the next collective, as a crash would: no teardown of its group
        os._exit(0)  # (a clean destroy_process_group could race rank 0's send and abort in gloo)
    try:
        agree(group, None, "after rank 1 left")
    except GroupTimeoutError as e:
        Path(out, f"gone_{rank}.txt").write_text(f"{type(e).__name__}: {e}")


CHECKS = {"dense_chain": dense_chain_worker, "moe_chain": moe_chain_worker, "family_chain": family_chain_worker,
          "argmax_ties": argmax_ties_worker}


def suite_worker(rank: int, world: int, group, out: str, ckpt: str, names: tuple[str, ...]) -> None:
    """Every check in `names` on one group (one spawn, its start-up paid once): each writes
    `<name>_<rank>.txt`, "ok" or its traceback, for the test of that name to read. A check that
    fails on one rank makes its peers' next collective time out, so they fail too, typed."""
    import traceback

    for name in names:
        args = (ckpt,) if name == "dense_chain" else ()
        try:
            CHECKS[name](rank, world, group, *args)
            result = "ok"
        except Exception:  # noqa: BLE001 - reported to the test that reads this check
            result = traceback.format_exc()
        Path(out, f"{name}_{rank}.txt").write_text(result)
