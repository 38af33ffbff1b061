"""The MoE head through the runners. CPU: each refusal (kill switch, fp32 routing, expert
parallelism) makes propose_batch return None before anything runs, logged once with its reason,
and drafting each sequence alone gives what the unrefused batch gives, on both forwards; the plan
note. CUDA (`-m cuda`): the captured MoE chain in fp32 (dense experts, fp8 experts, and the kill
switch's reference experts) against the eager oracle."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from draft_circuit.circuit.planner import compile_draft
from draft_circuit.ops import moe as ops_moe
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead, moe_plan_note, random_moe_weights
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.runners import proposer_batch as proposer_module  # its once-per-process log
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.testing import compare_drafts, cuda, random_draft_batch

CFG = MoeConfig(vocab_size=90, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)
K = 3
REFUSALS = {
    "kill_switch": (CFG, "CIRCUIT_NO_GROUPED_MOE_DECODE=1"),
    "fp32_routing": (dataclasses.replace(CFG, routing_dtype="float32"), "routing configured in float32"),
    "expert_parallel": (dataclasses.replace(CFG, expert_parallel_size=2), "expert_parallel_size=2"),
}


def make(cfg: MoeConfig, forward: str) -> MtpProposer:
    head = MoeMtpHead(cfg)
    return MtpProposer(head, head.bind(random_moe_weights(cfg, seed=11)), num_drafts=K,
                       num_blocks=40, block_size=8, max_blocks_per_seq=6, max_width=4,
                       widths=(1, 2, 4), forward=forward)


def prefilled(p: MtpProposer, seed: int, length: int):
    g = torch.Generator().manual_seed(seed)
    s = p.alloc_state()
    p.prefill_drafter(torch.randint(0, CFG.vocab_size, (length,), generator=g).tolist(),
                      torch.randn(length, CFG.hidden_size, generator=g), s)
    return s


def seq_kv(p: MtpProposer, s) -> torch.Tensor:
    return torch.stack([p.states["k_cache"][b, o] for b, o in (s.blocks.slot(r) for r in range(s.rows))])


def test_unrefused_head_serves_batches(monkeypatch):
    monkeypatch.delenv(ops_moe.KILL_SWITCH, raising=False)
    assert MoeMtpHead(CFG).batch_refusal(3) is None
    monkeypatch.setenv(ops_moe.KILL_SWITCH, "0")  # "0" means off
    assert MoeMtpHead(CFG).batch_refusal(3) is None


@pytest.mark.parametrize("forward", ["eager", "circuit"])
@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_refused_batch_returns_none_and_per_sequence_equals_the_batch(refusal, forward, monkeypatch, caplog):
    cfg, reason = REFUSALS[refusal]
    monkeypatch.setattr(proposer_module, "_WARNED", set())  # the once-per-process log, afresh
    monkeypatch.delenv(ops_moe.KILL_SWITCH, raising=False)
    refused, plain = make(cfg, forward), make(CFG, forward)
    lengths, width = (5, 9, 12), 3
    mine = [prefilled(refused, 20 + i, n) for i, n in enumerate(lengths)]
    theirs = [prefilled(plain, 20 + i, n) for i, n in enumerate(lengths)]
    tokens, positions = [4, 50, 81], list(lengths)
    hid = torch.randn(width, CFG.hidden_size, generator=torch.Generator().manual_seed(1))
    if refusal == "kill_switch":
        monkeypatch.setenv(ops_moe.KILL_SWITCH, "1")
    runs = {kind: dict(counts) for kind, counts in refused.stats.items()}
    with caplog.at_level(logging.WARNING, logger="draft_circuit.runners.proposer"):
        assert refused.propose_batch(tokens, hid, positions, K, mine) is None
        assert refused.propose_batch(tokens, hid, positions, K, mine) is None
    logged = [r.message for r in caplog.records if "propose_batch refused" in r.message]
    assert len(logged) == 1 and reason in logged[0], logged
    assert [refused.drafter_rows(s) for s in mine] == [n - 1 for n in lengths]  # nothing ran
    assert {kind: dict(counts) for kind, counts in refused.stats.items()} == runs
    alone = [refused.propose(t, hid[i], positions[i], K, s) for i, (t, s) in enumerate(zip(tokens, mine))]
    monkeypatch.delenv(ops_moe.KILL_SWITCH, raising=False)
    batch = plain.propose_batch(tokens, hid, positions, K, theirs)
    assert batch is not None and alone == batch
    for a, b in zip(mine, theirs):
        assert torch.equal(seq_kv(refused, a), seq_kv(plain, b))


def test_plan_note_states_what_the_program_could_serve(monkeypatch):
    monkeypatch.setenv(ops_moe.KILL_SWITCH, "1")
    note = moe_plan_note(REFUSALS["expert_parallel"][0])
    by = {r["reason"]: r for r in note["refusals"]}
    assert set(by) == set(REFUSALS)
    assert by["kill_switch"]["active"] and by["expert_parallel"]["active"] and not by["fp32_routing"]["active"]
    assert by["kill_switch"]["n_row_program_serves"] and by["fp32_routing"]["n_row_program_serves"]
    assert not by["expert_parallel"]["n_row_program_serves"]
    assert note["num_experts"] == 8 and note["top_k"] == 2


# ---- CUDA: the captured MoE chain against the eager oracle ----
GPU_CFG = MoeConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                    num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096,
                    n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                    n_shared_experts=1, routed_scaling_factor=2.5)
GPU_KV = KvLayout(num_blocks=16 * 16 + 1, block_size=16, max_blocks_per_seq=16)
GPU_WIDTHS = [1, 2, 3, 8, 16]


def _eager_with_gaps(chain, params, batch):
    """The oracle's outputs and, per (row, step), the smaller of the lm_head top-2 gap and the
    routing margin (k-th minus (k+1)-th selection score): near ties any rounding may flip."""
    from draft_circuit.runners.eager import EagerRunner
    keep = tuple(f"s{j}.{v}" for j in range(K) for v in ("lm_head", "post_attention_layernorm"))
    out = EagerRunner(chain, params, batch.clone_states()).run(batch.inputs, keep=keep)
    k, gaps = GPU_CFG.num_experts_per_tok, []
    for j in range(K):
        top2 = out[f"s{j}.lm_head"].float().log_softmax(-1).topk(2, dim=-1).values
        m = out[f"s{j}.post_attention_layernorm"].float()
        choice = torch.sigmoid(m @ params["mlp.gate.weight"].float().T) + params["mlp.gate.e_score_correction_bias"]
        ranked = choice.topk(k + 1, dim=-1).values
        margin = ranked[:, k - 1] - ranked[:, k]
        gaps.append(torch.where(margin < 1e-4, torch.zeros_like(margin), top2[:, 0] - top2[:, 1]))
    return out, torch.stack(gaps, dim=1)


@cuda
@pytest.mark.parametrize("variant", ["dense", "fp8", "kill_switch"])
def test_captured_moe_chain_matches_eager(variant, monkeypatch):
    from draft_circuit.runners.cudagraph import GraphRunner
    if variant == "kill_switch":
        monkeypatch.setenv(ops_moe.KILL_SWITCH, "1")  # planned with the reference experts
    head = MoeMtpHead(GPU_CFG, "float32", fp8_experts=variant == "fp8")
    chain = emit_draft_chain(head, K, max_width=16, kv=GPU_KV)
    params = {k: v.cuda() for k, v in head.bind(random_moe_weights(GPU_CFG, seed=1)).items()}
    compiled = compile_draft(chain, params, GPU_WIDTHS, device="cuda")
    kernels = {x.op: x.kernel for x in compiled.programs[8].launches}
    experts_op = "moe_experts_fp8" if variant == "fp8" else "moe_experts"
    want_kernel = "reference" if variant == "kill_switch" else "triton_moe_grouped"
    assert kernels[experts_op] == want_kernel and kernels["moe_route"] == "triton_moe_route"
    runner = GraphRunner(compiled, random_draft_batch(GPU_CFG, GPU_KV, 1, device="cuda").clone_states())
    assert runner.widths == tuple(GPU_WIDTHS), runner.stats.failures
    compared = 0
    for n in GPU_WIDTHS:
        batch = random_draft_batch(GPU_CFG, GPU_KV, n, seed=100 + n, num_drafts=K, device="cuda")
        want, gaps = _eager_with_gaps(chain, params, batch)
        for name, t in batch.clone_states().items():
            runner.program.states[name].copy_(t)
        got = runner.run(batch.inputs)
        compared += compare_drafts(got, want, gaps, conf_atol=1e-3, tie_gap=1e-3)[0]
        if bool((gaps > 1e-3).all()):  # no near tie anywhere: the whole chain agrees closely
            torch.testing.assert_close(got["hidden_out"], want["hidden_out"], atol=2e-3, rtol=2e-3)
    assert compared > 0.8 * K * sum(GPU_WIDTHS)


def test_the_plan_report_states_which_refusals_the_n_row_program_could_serve():
    head = MoeMtpHead(CFG)
    p = MtpProposer(head, head.bind(random_moe_weights(CFG, seed=1)), num_drafts=2, num_blocks=16,
                    block_size=8, max_blocks_per_seq=4, max_width=2, widths=(1, 2), forward="circuit")
    report = p.chain_runner(2).compiled.report()
    refusals = {r["reason"]: r for r in report.notes["moe"]["refusals"]}
    assert refusals["kill_switch"]["n_row_program_serves"] is True
    assert refusals["expert_parallel"]["n_row_program_serves"] is False
    assert "moe" in report.model_validate_json(report.to_json()).notes
