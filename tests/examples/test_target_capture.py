"""The compiled target's passes (examples/engine/capture.py, issue 20 item 4): buckets up to
graph_rows on CUDA graphs (by default every bucket: prefills replay too), wider ones uncaptured
on the same program. On CPU: which bucket
serves a pass, and that the split between the two runners changes no bit. On the GPU
(`pytest -m cuda`): the captured target equals the uncaptured one bitwise (tokens, hiddens,
every KV row) and a replay allocates nothing."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.runners.testing import assert_no_allocation, cuda
from examples.engine import load_checkpoint
from examples.engine.capture import TargetPasses, buckets
from examples.engine.model import TargetModel, TargetRows
from tests.examples.helpers import SMALL

KV = KvLayout(num_blocks=40, block_size=16, max_blocks_per_seq=8)
TABLES = {0: list(range(1, 9)), 1: list(range(9, 17)), 2: list(range(17, 25))}


def rows(pieces: list[tuple[int, int, list[int]]]) -> TargetRows:
    """(sequence, first position, tokens) pieces -> one pass: row j of a piece at position and
    live rows first + j, through that sequence's table."""
    toks, pos, tables = [], [], []
    for seq, first, tokens in pieces:
        toks += tokens
        pos += range(first, first + len(tokens))
        tables += [TABLES[seq]] * len(tokens)
    p = torch.tensor(pos, dtype=torch.int32)
    return TargetRows(torch.tensor(toks, dtype=torch.int32), p, torch.tensor(tables, dtype=torch.int32), p.clone())


def passes() -> list[TargetRows]:
    """Prefills (37 and 20 rows: wide buckets), then decode and verify passes of 1..15 rows."""
    g = torch.Generator().manual_seed(5)
    t = lambda n: torch.randint(0, SMALL.vocab_size, (n,), generator=g).tolist()  # noqa: E731
    return [rows([(0, 0, t(37))]), rows([(1, 0, t(20)), (2, 0, t(3))]),
            rows([(0, 37, t(1))]), rows([(0, 38, t(5)), (1, 20, t(5)), (2, 3, t(5))]),
            rows([(1, 25, t(1)), (2, 8, t(1))]), rows([(0, 43, t(4))])]


@pytest.fixture(scope="module")
def weights(small_checkpoint) -> dict[str, torch.Tensor]:
    return load_checkpoint(small_checkpoint, with_mtp=False).target


def model(weights, device: str, graph_rows: int, dtype: torch.dtype = torch.float32) -> TargetModel:
    return TargetModel(SMALL, weights, KV, max_rows=64, device=device, dtype=dtype,
                       forward="circuit", graph_rows=graph_rows)


def test_buckets_and_which_runner_serves_a_pass(weights):
    assert buckets(64) == [1, 2, 4, 8, 16, 32, 64] and buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    runner = model(weights, "cpu", graph_rows=8).runner
    assert isinstance(runner, TargetPasses)
    assert runner.max_width == 64 and runner.widths == tuple(range(1, 65))
    assert runner.plan(3).parts == ((4, 3),) and runner.plan(8).kind == "own"
    assert runner.plan(9).parts == ((16, 9),)  # a prefill chunk: the uncaptured program
    assert runner._runner(8) is runner.graphs and runner._runner(9) is runner.wide
    assert not runner.captured(1), "CPU: nothing is captured"
    assert runner.uncaptured is None and runner.graphs.uncaptured_fallback() is None, \
        "no capture failed: no fallback runner"
    assert not runner.serves(65) and not runner.serves(0)
    with pytest.raises(ValueError, match="graph_rows must be >= 0"):
        model(weights, "cpu", graph_rows=-1)


def _run_all(m: TargetModel) -> list:
    out = []
    for r in passes():
        tokens, hidden = m.forward(r)
        kv = {k: v.clone() for k, v in m.runner.states.items()}
        out.append((tokens, hidden, kv))
    return out


def _assert_same(a: list, b: list) -> None:
    for i, ((ta, ha, kva), (tb, hb, kvb)) in enumerate(zip(a, b)):
        assert ta == tb, f"pass {i}: tokens"
        assert torch.equal(ha, hb), f"pass {i}: hiddens differ"
        for k in kva:
            assert torch.equal(kva[k], kvb[k]), f"pass {i}: {k} differs"


def test_bucket_split_changes_no_bit_on_cpu(weights):
    """graph_rows 8 (passes of <= 8 rows on the small programs, wider on the wide ones) against
    graph_rows 0 (every pass on the wide programs) and 64 (every pass on the small ones)."""
    runs = [_run_all(model(weights, "cpu", graph_rows=g)) for g in (8, 0, 64)]
    _assert_same(runs[0], runs[1])
    _assert_same(runs[0], runs[2])


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_captured_target_equals_uncaptured_bitwise(weights, dtype):
    captured, plain = model(weights, "cuda", 16, dtype), model(weights, "cuda", 0, dtype)
    assert all(captured.runner.captured(n) for n in range(1, 17))
    assert not captured.runner.captured(17) and not any(plain.runner.captured(n) for n in range(1, 65))
    _assert_same(_run_all(captured), _run_all(plain))


@cuda
def test_by_default_every_bucket_prefills_included_is_a_graph(weights):
    """Regression (2026-12-06, benchmarks/engine_timeline.py on the H100): prefill buckets ran
    uncaptured, ~60 us of Triton's Python launch path a kernel, a third of the quick start's
    speculative wall time. The default captures them, and changes no bit."""
    default = TargetModel(SMALL, weights, KV, max_rows=64, device="cuda", dtype=torch.bfloat16,
                          forward="circuit")
    assert all(default.runner.captured(n) for n in range(1, 65)) and default.runner.wide is None
    _assert_same(_run_all(default), _run_all(model(weights, "cuda", 0, torch.bfloat16)))


def test_the_default_captures_every_bucket_of_the_engines_default_max_rows():
    from examples.engine.capture import GRAPH_ROWS
    from examples.engine.engine import EngineConfig
    assert GRAPH_ROWS >= EngineConfig().max_rows


@cuda
def test_a_bucket_whose_capture_failed_runs_uncaptured(weights, monkeypatch):
    """The 64-row bucket's capture fails (GraphRunner's fail_widths): its passes run on the graph
    runner's own program, uncaptured, bitwise the uncaptured target's; the others replay."""
    from draft_circuit.runners.cudagraph import GraphRunner
    init = GraphRunner.__init__

    def failing(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "fail_widths": frozenset({64})})
    monkeypatch.setattr(GraphRunner, "__init__", failing)
    m = TargetModel(SMALL, weights, KV, max_rows=64, device="cuda", dtype=torch.bfloat16,
                    forward="circuit")
    assert 64 in m.runner.graphs.backend.stats.failures and not m.runner.captured(40)
    assert m.runner.serves(40) and m.runner._runner(40) is m.runner.uncaptured
    assert m.runner.captured(32) and m.runner.uncaptured.backend is m.runner.graphs.backend.program
    monkeypatch.setattr(GraphRunner, "__init__", init)
    _assert_same(_run_all(m), _run_all(model(weights, "cuda", 0, torch.bfloat16)))


@cuda
def test_captured_target_pass_allocates_nothing(weights):
    m = model(weights, "cuda", graph_rows=16)
    for r in passes()[:2]:  # prefill something to attend to
        m.forward(r)
    r = passes()[3]  # a 15-row verify pass: bucket 16, a graph
    n = r.tokens.shape[0]
    assert m.runner.captured(n)
    inputs = {"tokens": r.tokens, "positions": r.positions, "block_tables": r.block_tables,
              "live_rows": r.live_rows, "active": torch.ones(n, dtype=torch.int32)}
    inputs = {k: v.cuda() for k, v in inputs.items()}
    assert_no_allocation(m.runner.run, n, inputs)
