"""On the GPU (`-m cuda`, issue 18): a small MTP head over a reduced vocabulary with the ids read in
the lm-head merge. The subset chain plans and launches what the full chain does a step (the
profiler's kernel events of one uncaptured run are the plan's gpu_launches); captured into CUDA
graphs, each replay equals the same program run uncaptured bitwise, and the eager oracle (map_ids
op by op) under the near-tie rule; drafts are subset ids or -1 (an all-masked row); replay
allocates nothing."""
import math

import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.draft_vocab import DraftVocab, bind_draft_vocab
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import (assert_no_allocation, compare_drafts, cuda, random_draft_batch,
                                           random_mtp_weights)

pytestmark = cuda.marks
CFG = MtpConfig(vocab_size=3000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096)
KV = KvLayout(num_blocks=8 * 16 + 1, block_size=16, max_blocks_per_seq=16)
K, S, WIDTHS = 4, 700, list(range(1, 9))
PROPOSER = {"bitmask": True, "embed_target": True, "confidence_stop": True}


def vocab() -> DraftVocab:
    g = torch.Generator().manual_seed(0)
    return DraftVocab(tuple(torch.randperm(CFG.vocab_size, generator=g)[:S].tolist()), CFG.vocab_size)


def batch(n: int, seed: int, dtype=torch.float32):
    b = random_draft_batch(CFG, KV, n, seed=seed, num_drafts=K, device="cuda", bitmask=True, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    b.inputs["bitmask"][:, :] = -1  # everything allowed in half the rows, a random mask in the rest
    b.inputs["bitmask"][1::2] = torch.randint(-2**31, 2**31 - 1, b.inputs["bitmask"][1::2].shape,
                                              generator=g, dtype=torch.int64).to(torch.int32).cuda()
    b.inputs["bitmask"][0] = 0  # nothing allowed: -1 at every step
    b.inputs["log_tau"] = torch.full((n,), math.log(0.01), device="cuda")
    return b


def states_of(b, dtype=torch.float32):
    return {**b.clone_states(), "embed_target": torch.zeros(8, CFG.hidden_size, dtype=dtype, device="cuda")}


def test_subset_chain_launches_the_full_chains_kernels_a_step():
    from torch.profiler import ProfilerActivity, profile

    from draft_circuit.circuit.report import gpu_launches
    from draft_circuit.runners.program import ProgramRunner
    head = MtpHead(CFG, "bfloat16")
    params = head.bind(random_mtp_weights(CFG, seed=3, dtype=torch.bfloat16, device="cuda"))
    per_step = {}
    for size, p in ((None, params), (S, bind_draft_vocab(params, head, vocab()))):
        c = emit_draft_chain(head, K, max_width=8, kv=KV, draft_vocab=size, **PROPOSER)
        compiled = compile_draft(c, p, [4], device="cuda")
        report = compiled.report().width(4)
        per_step[size] = report.gpu_launches_per_step
        assert "torch_map_ids" not in {x.kernel for x in report.schedule}
        b = batch(4, seed=4, dtype=torch.bfloat16)
        runner = ProgramRunner(compiled, states_of(b, torch.bfloat16))
        runner.run(b.inputs)  # compile every kernel first
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.run(b.inputs)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        # the plan's Triton kernels (torch's own, copies and the runner's input guard left out)
        triton_kernels = [n for n in names if not n.startswith(("void at::", "at::", "void (anonymous",
                                                                "Memcpy", "Memset")) and "input_guard" not in n]
        assert len(triton_kernels) == sum(gpu_launches(x) or 0 for x in compiled.programs[4].launches
                                          if x.kernel.startswith("triton_")), names
    assert per_step[S] == per_step[None]


def test_captured_subset_chain_equals_program_and_eager():
    from draft_circuit.runners.cudagraph import GraphRunner
    from draft_circuit.runners.program import ProgramRunner
    head, ids = MtpHead(CFG), vocab()
    params = {k: v.cuda() for k, v in bind_draft_vocab(head.bind(random_mtp_weights(CFG, seed=1)), head, ids).items()}
    chain = emit_draft_chain(head, K, max_width=8, kv=KV, draft_vocab=S, **PROPOSER)
    compiled = compile_draft(chain, params, WIDTHS, device="cuda")
    assert all(n.attrs.get("ids") for n in compiled.circuit.nodes if "argmax" in n.op)
    runner = GraphRunner(compiled, states_of(batch(1, 0)))
    assert runner.widths == tuple(WIDTHS), runner.stats.failures
    compared = 0
    for n in WIDTHS:
        b = batch(n, seed=10 + n)
        keep = tuple(f"s{j}.lm_head" for j in range(K))
        want = EagerRunner(chain, params, states_of(b)).run(b.inputs, keep=keep)
        gaps = torch.stack([(lambda t: t[:, 0] - t[:, 1])(want[k].log_softmax(-1).topk(2, dim=-1).values)
                            for k in keep], dim=1)
        plain = ProgramRunner(compiled, states_of(b)).run(b.inputs)
        for name, t in states_of(b).items():
            runner.program.states[name].copy_(t)
        got = runner.run(b.inputs)
        for k in ("drafts", "confidences", "hidden_out"):
            assert torch.equal(got[k], plain[k]), (n, k)
        drafts = got["drafts"].cpu()
        assert (drafts[0] == -1).all() and set(drafts.flatten().tolist()) <= set(ids.ids) | {-1}
        if n > 1:  # row 0's -inf confidences are equal, but compare_drafts subtracts them
            rest = lambda d: {k: d[k][1:] for k in ("drafts", "confidences")}  # noqa: E731
            compared += compare_drafts(rest(got), rest(want), gaps[1:], conf_atol=1e-3)[0]
        for name, dst in runner.input_buffers(n).items():
            dst.copy_(b.inputs[name])
        assert_no_allocation(runner.execute, n)
    assert compared > 0.6 * K * (sum(WIDTHS) - len(WIDTHS))
