"""Capture measurements in the plan report (issue 15 item 5): `CompiledDraft.record_capture` puts
a width's capture time and the graph pool's reserved growth into its WidthReport (JSON and the
plan page), refusing an uncompiled width or a negative figure; on the GPU, GraphRunner records
both for every width it captures, warms up once per kernel-configuration class, and reports the
time 64 widths take to compile and capture (target: under 3 s on the H200)."""
import time

import pytest
import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import PlanError, compile_draft
from draft_circuit.circuit.report import PlanReport
from draft_circuit.circuit.viz.html import render_html
from draft_circuit.runners.testing import cuda, random_draft_batch, random_mtp_weights

CFG = MtpConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096)
KV = KvLayout(num_blocks=64 * 16 + 1, block_size=16, max_blocks_per_seq=16)


def _compiled(widths, device="cpu", dtype="float32"):
    head = MtpHead(CFG, dtype)
    chain = emit_draft_chain(head, 4, max_width=64, kv=KV)
    if device == "cpu":
        params = {k: torch.empty(s, device="meta") for k, s in head.param_shapes().items()}
    else:
        params = head.bind(random_mtp_weights(CFG, seed=1, dtype=getattr(torch, dtype), device=device))
    return compile_draft(chain, params, widths, device=device)


def test_recorded_capture_reaches_the_report_and_the_page():
    compiled = _compiled([1, 8])
    assert compiled.report().width(8).capture_ms is None  # before any capture
    compiled.record_capture(8, 12.3456, 3 * 2**20)
    w8, w1 = compiled.report().width(8), compiled.report().width(1)
    assert (w8.capture_ms, w8.graph_pool_bytes) == (12.346, 3 * 2**20)
    assert (w1.capture_ms, w1.graph_pool_bytes) == (None, None)
    back = PlanReport.from_json(compiled.report().to_json())
    assert back.width(8).graph_pool_bytes == 3 * 2**20
    page = render_html(compiled.report())
    assert "12.35" in page and "3145728 B reserved by the graph pool" in page


def test_record_capture_refuses_what_it_cannot_record():
    compiled = _compiled([1])
    with pytest.raises(PlanError, match="width 4 is not compiled"):
        compiled.record_capture(4, 1.0, 0)
    with pytest.raises(PlanError, match="must be >= 0"):
        compiled.record_capture(1, 1.0, -5)


def test_warmup_classes_follow_triton_integer_specialisation():
    from draft_circuit.runners.cudagraph import warmup_class
    classes = {warmup_class(n) for n in range(1, 65)}
    assert classes == {(True, False), (False, True), (False, False)}
    assert warmup_class(1) != warmup_class(2) == warmup_class(63) != warmup_class(64)


@cuda
def test_capture_records_reserved_pool_growth_in_the_report():
    """64 widths: every width's capture_ms and graph_pool_bytes (reserved growth) are in the
    report; the pool's total reserved growth is what the stats sum; only the first width of each
    warm-up class warms up; and the replays still equal the uncaptured program."""
    from draft_circuit.runners.cudagraph import GraphRunner
    from draft_circuit.runners.program import ProgramRunner

    widths = list(range(1, 65))
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved()
    start = time.perf_counter()
    compiled = _compiled(widths, "cuda", "bfloat16")
    compile_s = time.perf_counter() - start
    pool = random_draft_batch(CFG, KV, 1, seed=0, num_drafts=4, dtype=torch.bfloat16, device="cuda")
    states = pool.clone_states()
    runner = GraphRunner(compiled, states)
    total_s = time.perf_counter() - start
    print(f"\n64 widths: compile {compile_s:.2f} s + capture {total_s - compile_s:.2f} s = "
          f"{total_s:.2f} s (target < 3 s); pool reserved "
          f"{sum(runner.stats.pool_bytes.values()) / 2**20:.1f} MiB; warm-ups {runner.stats.warmed}")
    assert runner.widths == tuple(widths), runner.stats.failures
    report = compiled.report()
    for w in widths:
        wr = report.width(w)
        assert wr.capture_ms is not None and wr.capture_ms > 0
        assert wr.graph_pool_bytes == runner.stats.pool_bytes[w] >= 0
    assert sum(runner.stats.pool_bytes.values()) <= torch.cuda.memory_reserved() - reserved
    assert report.width(64).graph_pool_bytes > 0  # the first capture reserves the pool's segments
    assert sum(1 for v in runner.stats.warmed.values() if v) == 3
    for n in (1, 5, 16, 64):  # a warmed width and unwarmed ones of each class
        batch = random_draft_batch(CFG, KV, n, seed=n, num_drafts=4, dtype=torch.bfloat16, device="cuda")
        before = {k: v.clone() for k, v in states.items()}  # the KV the replay will write into
        got = {k: v.clone() for k, v in runner.run(batch.inputs).items()}
        want = ProgramRunner(compiled, before).run(batch.inputs)
        for k in want:
            assert torch.equal(got[k], want[k]), (n, k)
        for k in states:
            assert torch.equal(states[k], before[k]), (n, k)
