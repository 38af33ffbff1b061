"""CUDA-graph capture (run with `-m cuda` on the GPU machine): every captured width 1..64 against
the eager oracle, no allocation during replay, every output element written, padded rows inert,
a forced capture failure leaving the other widths served, and whole-chain width independence.
The module also checks, on any machine, that importing the capture code needs no GPU."""
import time

import pytest
import torch

from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.runners.testing import (assert_no_allocation, compare_drafts, cuda, poison_runner,
                             random_draft_batch, random_mtp_weights)

CFG = MtpConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096)
KV = KvLayout(num_blocks=64 * 16 + 1, block_size=16, max_blocks_per_seq=16)
K = 4
WIDTHS = list(range(1, 65))


def test_capture_code_imports_without_a_gpu():
    import draft_circuit.runners.cudagraph  # noqa: F401  (every CUDA call is behind a guard)


def _build(dtype: str, widths, **options):
    head = MtpHead(CFG, dtype)
    chain = emit_draft_chain(head, K, max_width=64, kv=KV, bitmask=False, embed_target=False)
    weights = random_mtp_weights(CFG, seed=1, dtype=getattr(torch, dtype), device="cuda")
    params = head.bind(weights)
    return chain, params, compile_draft(chain, params, widths, device="cuda",
                                        options=CompileOptions(**options))


def _batch(n: int, dtype: str, seed: int):
    b = random_draft_batch(CFG, KV, n, seed=seed, num_drafts=K, dtype=getattr(torch, dtype),
                           device="cuda")
    return b


def _eager_with_gaps(chain, params, batch):
    """The oracle's outputs, its KV writes and each draft's top-2 log-probability gap."""
    from draft_circuit.runners.eager import EagerRunner
    states = batch.clone_states()
    keep = tuple(f"s{j}.lm_head" for j in range(K))
    out = EagerRunner(chain, params, states).run(batch.inputs, keep=keep)
    gaps = []
    for name in keep:
        top2 = out[name].float().log_softmax(-1).topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
    return out, states, torch.stack(gaps, dim=1)


@pytest.fixture(scope="module")
def bf16():
    from draft_circuit.runners.cudagraph import GraphRunner
    chain, params, compiled = _build("bfloat16", WIDTHS)
    pool = _batch(1, "bfloat16", 0)
    start = time.perf_counter()
    runner = GraphRunner(compiled, pool.clone_states())
    print(f"\ncaptured {len(runner.widths)} widths in {time.perf_counter() - start:.2f} s; "
          f"graph pools {sum(runner.stats.pool_bytes.values()) / 2**20:.1f} MiB; "
          f"arena {compiled.arena_bytes / 2**20:.2f} MiB")
    return chain, params, compiled, runner


@cuda
def test_every_width_matches_eager(bf16):
    """Capture changes nothing: each replay equals the same program run uncaptured, bitwise
    (drafts, confidences, hidden, KV). Against the eager oracle (the unfused circuit, torch
    references) bf16 pipelines that round in different places drift: drafts are compared under
    the near-tie rule and at most 5% of compared drafts may differ (fp32 below: none may)."""
    from draft_circuit.runners.program import ProgramRunner
    chain, params, compiled, runner = bf16
    assert runner.widths == tuple(WIDTHS), runner.stats.failures
    compared = mismatched = 0
    for n in WIDTHS:
        batch = _batch(n, "bfloat16", seed=100 + n)
        want, want_states, gaps = _eager_with_gaps(chain, params, batch)
        uncaptured_states = batch.clone_states()
        plain = ProgramRunner(compiled, uncaptured_states).run(batch.inputs)
        for name, t in batch.clone_states().items():
            runner.program.states[name].copy_(t)
        got = runner.run(batch.inputs)
        for k in ("drafts", "confidences", "hidden_out"):
            assert torch.equal(got[k], plain[k]), (n, k)
        for k, t in uncaptured_states.items():
            assert torch.equal(runner.program.states[k], t), (n, k)
        c, m = compare_drafts(got, want, gaps, conf_atol=0.1, strict=False)
        compared, mismatched = compared + c, mismatched + m
    print(f"\nbf16 vs eager: {compared} drafts compared, {mismatched} differ")
    assert compared > 0.8 * K * sum(WIDTHS) and mismatched <= 0.05 * compared


@cuda
def test_replay_allocates_nothing_and_writes_every_output(bf16):
    _, _, _, runner = bf16
    for n in (1, 7, 64):
        batch = _batch(n, "bfloat16", seed=n)
        for name, dst in runner.input_buffers(n).items():
            dst.copy_(batch.inputs[name])
        assert_no_allocation(runner.execute, n)
        poison_runner(runner)
        for name, dst in runner.input_buffers(n).items():
            dst.copy_(batch.inputs[name])
        runner.execute(n)
        out = runner.output_buffers(n)
        assert (out["drafts"] >= 0).all() and (out["drafts"] < CFG.vocab_size).all()
        assert torch.isfinite(out["confidences"]).all() and torch.isfinite(out["hidden_out"]).all()


@cuda
def test_padded_rows_are_inert():
    from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
    chain, params, compiled = _build("float32", [1, 8])
    for n in range(2, 8):
        batch = _batch(n, "float32", seed=n)
        states = batch.clone_states()
        runner = CircuitDraftRunner(compiled, states, scratch_block=0,
                                    policy=WidthPolicy(allow_split=False))
        # garbage in the rows padding will cover: a stale real batch
        stale = _batch(8, "float32", seed=99)
        for name, dst in runner.backend.input_buffers(8).items():
            dst.copy_(stale.inputs[name])
        want, want_states, gaps = _eager_with_gaps(chain, params, batch)
        assert runner.plan(n).kind == "pad"
        got = runner.run(n, batch.inputs)
        compare_drafts(got, want, gaps, conf_atol=1e-3)
        for name in states:  # live KV as eager wrote it, and nothing else (scratch included)
            torch.testing.assert_close(states[name], want_states[name], atol=1e-4, rtol=1e-4)


@cuda
def test_forced_capture_failure_leaves_other_widths_served():
    from draft_circuit.runners.cudagraph import CaptureError, GraphRunner
    _, _, compiled = _build("bfloat16", [1, 2, 4])
    batch = _batch(1, "bfloat16", 3)
    runner = GraphRunner(compiled, batch.clone_states(), fail_widths=frozenset({2}))
    assert runner.widths == (1, 4) and 2 in runner.stats.failures
    assert not runner.serves(2)
    out = runner.run(_batch(4, "bfloat16", 4).inputs)
    assert (out["drafts"] >= 0).all()
    _assert_rng_usable()  # regression: the failed capture left the generator "capturing"
    again = GraphRunner(compiled, batch.clone_states())  # a later capture still works
    assert again.widths == (1, 2, 4)
    with pytest.raises(CaptureError):
        GraphRunner(compiled, batch.clone_states(), fail_widths=frozenset({4}), strict=True)
    _assert_rng_usable()


def _assert_rng_usable() -> None:
    """Eager random ops and a captured one still work on the device (a host engine samples
    with them): on torch 2.11 a failed capture used to leave the default generator in capture
    mode, and the next `torch.randn` raised "Offset increment outside graph capture"."""
    assert torch.randn(64, device="cuda").isfinite().all()
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph.capture_begin()
        sample = torch.rand(64, device="cuda")
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    graph.replay()
    first = sample.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert not torch.equal(first, sample)  # the captured draw advances per replay
    assert torch.randn(64, device="cuda").isfinite().all()


@cuda
def test_whole_chain_row_alone_equals_row_in_batch(bf16):
    _, _, _, runner = bf16
    big = _batch(64, "bfloat16", seed=7)
    states0 = {k: v.clone() for k, v in runner.program.states.items()}
    outs = {}
    for n in [1, *range(2, 65, 7), 64]:
        for name, t in big.clone_states().items():
            runner.program.states[name].copy_(t)
        inputs = {k: v[:n] for k, v in big.inputs.items()}
        outs[n] = {k: v.clone() for k, v in runner.run(inputs).items()}
    for n, out in outs.items():
        for k in ("drafts", "confidences", "hidden_out"):
            assert torch.equal(out[k][0], outs[1][k][0]), (n, k)
    for k, v in states0.items():
        runner.program.states[k].copy_(v)


@cuda
def test_fp32_graph_matches_eager_tightly():
    from draft_circuit.runners.cudagraph import GraphRunner
    chain, params, compiled = _build("float32", [1, 5, 16])
    runner = GraphRunner(compiled, _batch(1, "float32", 0).clone_states())
    compared = 0
    for n in (1, 5, 16):
        batch = _batch(n, "float32", seed=n)
        want, want_states, gaps = _eager_with_gaps(chain, params, batch)
        for name, t in batch.clone_states().items():
            runner.program.states[name].copy_(t)
        got = runner.run(batch.inputs)
        compared += compare_drafts(got, want, gaps, conf_atol=1e-4)[0]
        for name in want_states:
            torch.testing.assert_close(runner.program.states[name], want_states[name],
                                       atol=1e-4, rtol=1e-4)
    print(f"\nfp32: {compared} of {K * 22} drafts compared under the 1e-3 near-tie rule")
    assert compared > 0.9 * K * 22
