"""A reduced draft vocabulary's map_ids in the lm-head argmax (issue 18): fuse_lm_head_argmax
absorbs a map_ids that alone reads the argmax's token through a param table of one id per
vocabulary row, so the keep / last / gate rows fold the chain's bookkeeping into the merge as for
the full vocabulary. The fused circuit equals the unfused one's eager run bitwise on CPU fp32
(widths 1, 3, 8); a table of another length, a computed table or a token with another reader
stays unfused; a subset MTP chain launches what the full chain launches a step (the small chain
on CPU with the interpreter, its kernels counted as they run, and the 8B chain over 32,768 ids
planned for CUDA on meta weights)."""
import math

import pytest
import torch
import triton.runtime.interpreter as interpreter

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.layers.draft_vocab import DRAFT_VOCAB_IDS, DraftVocab, bind_draft_vocab
from draft_circuit.circuit.layers.mtp import KvLayout, MtpConfig, MtpHead, emit_draft_chain
from draft_circuit.circuit.passes import run_passes
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights

MAX_WIDTH, HIDDEN, V, TARGET = 8, 12, 40, 300


def head_block(table_rows: int = V, computed_table: bool = False, raw_out: bool = False):
    """The chain's lm-head step alone: norm -> linear -> argmax -> map_ids -> keep, last, gate."""
    b = CircuitBuilder("lm_head", max_width=MAX_WIDTH)
    x = b.input("x", "float32", ("n", HIDDEN))
    mask = b.input("mask", "int32", ("n", 2))
    active, fallback = b.input("active", "int32", ("n",)), b.input("fallback", "int32", ("n",))
    log_tau = b.input("log_tau", "float32", ("n",))
    b.param("wn", "float32", (HIDDEN,))
    b.param("head", "float32", (V, HIDDEN))
    table = b.param("ids", "int32", (table_rows,))
    if computed_table:  # a table some node makes: not there where the fused node goes
        table = b.op1("map_ids", [b.param("order", "int32", (V,)), table], name="table")
    y = b.op1("rmsnorm", [x, "wn"], name="norm")
    logits = b.op1("linear", [y, "head"], {"out_dtype": "float32"}, name="lm_head")
    tok, lp = b.op("argmax_logprob", [logits, mask], name="top1")
    mapped = b.op1("map_ids", [tok, table], name="draft_id")
    b.output(b.op1("keep_if_active", [mapped, active], name="draft"), "kept")
    b.output(b.op1("keep_if_active", [mapped, active, fallback], name="last_kept"), "last")
    b.output(b.op1("confidence_gate", [active, lp, log_tau], name="gate"), "active_next")
    b.output(lp, "logprob")
    b.output(mapped, "token")
    if raw_out:
        b.output(tok, "raw")
    return b.build()


def values(c, width, seed):
    g = torch.Generator().manual_seed(seed)
    params = {"wn": 1 + 0.1 * torch.randn(HIDDEN, generator=g), "head": torch.randn(V, HIDDEN, generator=g),
              "ids": torch.randperm(TARGET, generator=g)[:c.value("ids").shape[0]].sort().values.int()}
    if "order" in {v.name for v in c.values}:
        params["order"] = torch.randperm(params["ids"].shape[0], generator=g)[:V].int()
    mask = torch.randint(-2**31, 2**31 - 1, (width, 2), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0] = 0  # nothing allowed: -1 stays -1 through the table
    inputs = {"x": torch.randn(width, HIDDEN, generator=g), "mask": mask,
              "active": torch.tensor([i % 3 != 2 for i in range(width)], dtype=torch.int32),
              "fallback": torch.randint(-1, TARGET, (width,), generator=g, dtype=torch.int32),
              "log_tau": torch.tensor([float("nan") if i % 2 else -2.5 for i in range(width)])}
    return params, inputs


@pytest.mark.parametrize("width", [1, 3, 8])
def test_the_default_pipeline_folds_map_ids_and_the_bookkeeping_into_the_merge(width):
    c = head_block()
    fused = run_passes(c)
    (node,) = fused.nodes
    assert node.op == "rmsnorm_linear_argmax_keep_last_gate" and node.attrs == {"ids": True}
    assert node.inputs[-1] == "ids" and "draft_id" in node.name
    params, inputs = values(c, width, seed=width)
    want = EagerRunner(c, params, {}).run(inputs)
    assert want["token"][0] == -1 and set(want["token"].tolist()) <= set(params["ids"].tolist()) | {-1}
    for circuit_run in (EagerRunner(fused, params, {}).run(inputs),
                        ProgramRunner(compile_draft(c, params, [width]), {}).run(inputs)):
        assert circuit_run.keys() == want.keys()
        for k in want:
            assert torch.equal(circuit_run[k], want[k]), k


@pytest.mark.parametrize("kwargs", [{"table_rows": V + 5}, {"computed_table": True}, {"raw_out": True}],
                         ids=["longer_table", "computed_table", "raw_token_read"])
def test_a_map_ids_that_may_not_ride_stays_and_the_rest_still_fuses(kwargs):
    c = head_block(**kwargs)
    fused = run_passes(c)
    ops = [n.op for n in fused.nodes]
    assert ops.count("map_ids") == 1 + bool(kwargs.get("computed_table"))
    (argmax,) = [n for n in fused.nodes if "argmax" in n.op]
    # the token the keeps read is map_ids' now, so the argmax fuses with the lm-head and norm only
    assert argmax.op == "rmsnorm_linear_argmax_logprob" and not argmax.attrs.get("ids")
    params, inputs = values(c, 3, seed=7)
    want = EagerRunner(c, params, {}).run(inputs)
    got = ProgramRunner(compile_draft(c, params, [3]), {}).run(inputs)
    assert all(torch.equal(got[k], want[k]) for k in want)


# ---- the subset MTP chain: a step launches what the full chain's does ----
CFG = MtpConfig(vocab_size=133, hidden_size=40, intermediate_size=72, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=60, block_size=8, max_blocks_per_seq=5)
K, S = 3, 45
PROPOSER = {"bitmask": True, "embed_target": True, "confidence_stop": True}


def vocab() -> DraftVocab:
    return DraftVocab(tuple(torch.randperm(CFG.vocab_size, generator=torch.Generator().manual_seed(3))[:S].tolist()),
                      CFG.vocab_size)


def meta(c, dtype=torch.bfloat16):
    return {v.name: torch.empty(v.shape, device="meta", dtype=getattr(torch, v.dtype)) for v in c.values
            if v.kind == "param"}


@pytest.mark.parametrize("kw", [{}, PROPOSER], ids=["plain", "proposer"])
def test_a_subset_chain_plans_the_full_chains_launches(kw):
    head = MtpHead(CFG)
    params = head.bind(random_mtp_weights(CFG, seed=1))
    reports = []
    for size, p in ((None, params), (S, bind_draft_vocab(params, head, vocab()))):
        c = emit_draft_chain(head, K, max_width=MAX_WIDTH, kv=KV, draft_vocab=size, **kw)
        compiled = compile_draft(c, p, [1, MAX_WIDTH], options=CompileOptions(interpret_kernels=True))
        reports.append(compiled.report())
        in_steps = [x for x in compiled.programs[1].launches if x.step is not None]
        assert all(x.kernel != "reference" and x.op != "map_ids" for x in in_steps), [x.node for x in in_steps]
    for w in (1, MAX_WIDTH):
        full, sub = reports[0].width(w), reports[1].width(w)
        assert sub.launches_per_step == full.launches_per_step == 8
        assert sub.gpu_launches_per_step == full.gpu_launches_per_step == 10
        # the mask remapped once a chain, before the steps: one Triton launch more (the
        # interpreted kernel here; a reference before it, the torch binding being CUDA-only)
        remap = int(bool(kw.get("bitmask")))
        assert sub.reference_launches == full.reference_launches
        assert sub.gpu_launches == full.gpu_launches + remap
        assert len(sub.schedule) == len(full.schedule) + remap


@pytest.mark.parametrize("width", [1, 3])
def test_the_interpreter_runs_what_the_subset_plan_counts(width, monkeypatch):
    head = MtpHead(CFG)
    params = bind_draft_vocab(head.bind(random_mtp_weights(CFG, seed=5)), head, vocab())
    c = emit_draft_chain(head, K, max_width=MAX_WIDTH, kv=KV, draft_vocab=S, **PROPOSER)
    compiled = compile_draft(c, params, [width], options=CompileOptions(interpret_kernels=True))
    batch = random_draft_batch(CFG, KV, width, seed=width, num_drafts=K, bitmask=True)
    batch.inputs["log_tau"] = torch.full((width,), math.log(0.02))
    states = {**batch.clone_states(), "embed_target": torch.zeros(MAX_WIDTH, CFG.hidden_size)}
    seen: list[str] = []
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        if not warmup and self.fn.__module__ != "draft_circuit.kernels.input_guard":
            seen.append(self.fn.__name__)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    got = ProgramRunner(compiled, {k: v.clone() for k, v in states.items()}).run(batch.inputs)
    monkeypatch.undo()
    report = compiled.report().width(width)
    in_steps = [x for x in compiled.programs[width].launches if x.step is not None]
    assert all(x.kernel != "reference" for x in in_steps), [x.node for x in in_steps]  # keeps folded
    assert len(seen) == report.gpu_launches and report.gpu_launches_per_step == 10
    assert seen.count("_merge_partials_kernel") == K  # the ids read there: no kernel of their own
    want = EagerRunner(c, params, {k: v.clone() for k, v in states.items()}).run(batch.inputs)
    assert torch.equal(got["drafts"], want["drafts"])
    assert set(got["drafts"].flatten().tolist()) <= set(vocab().ids) | {-1}
    torch.testing.assert_close(got["confidences"], want["confidences"], atol=1e-5, rtol=1e-5)


def test_the_8b_chain_over_32768_ids_launches_the_full_chains_15_a_step():
    """Issue 18's measurement at plan level: the 8B chain (benchmarks' `8b` shapes) over a
    32,768-id subset planned for CUDA on meta weights, 18 GPU launches a step before (map_ids'
    torch kernels and keep_if_active unfused), the full chain's 15 now (14, plus q/k/v's norm as
    a launch of its own: kernels.prologue_norm); once a chain, the bitmask's remap is one Triton
    launch (15 aten kernels of its torch binding before)."""
    cfg = MtpConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                    num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=8192)
    head = MtpHead(cfg, "bfloat16")
    got, per_chain = {}, {}
    for size in (None, 32768):
        c = emit_draft_chain(head, 3, max_width=8, kv=KvLayout(60, 8, 5), draft_vocab=size, **PROPOSER)
        compiled = compile_draft(c, meta(c), [1, 8], device="cuda")
        got[size] = [compiled.report().width(w).gpu_launches_per_step for w in (1, 8)]
        per_chain[size] = [compiled.report().width(w).gpu_launches for w in (1, 8)]
        argmax = [n for n in compiled.circuit.nodes if "argmax" in n.op]
        assert len(argmax) == 3 and all(bool(n.attrs.get("ids")) == (size is not None) for n in argmax)
        assert all(n.inputs[-1] == DRAFT_VOCAB_IDS for n in argmax if size)
    assert got[32768] == got[None] == [15, 15]
    assert per_chain[32768] == [x + 1 for x in per_chain[None]] == [53, 53]  # + triton_remap_bitmask
