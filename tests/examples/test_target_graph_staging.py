"""examples/engine/target_staging.py: a target pass staged into its bucket runner's own input
buffers (one region copy, padding rows kept neutral) gives bitwise the pass's outputs of the
general path, over passes that grow, shrink and repeat their row count; rows past n stay inert.
On CPU the bucket runner is the program runner the CUDA graphs are captured from, so the
bookkeeping is tested here; test_engine_cuda covers the captured passes on the GPU."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.binding import BindingError
from examples.engine import Engine, EngineConfig, load_checkpoint
from examples.engine.model import TargetModel, TargetRows
from examples.engine.target_staging import TargetStaging
from draft_circuit.runners.testing import cuda
from tests.examples.test_target_staging import rows_for, stage_without_sync


def circuit_model(path):
    return Engine(load_checkpoint(path), EngineConfig(speculate=False, device="cpu", max_rows=64,
                                                      target_forward="circuit")).target.model


def general_inputs(rows):
    return {"tokens": rows.tokens, "positions": rows.positions, "block_tables": rows.block_tables,
            "live_rows": rows.live_rows, "active": torch.ones(rows.tokens.shape[0], dtype=torch.int32)}


SIZES = (5, 9, 3, 3, 16, 1, 12)  # a bucket's padding grows, shrinks, repeats; a full bucket


def test_staged_passes_equal_the_general_path_and_keep_padding_inert(small_checkpoint):
    plain, staged_model = circuit_model(small_checkpoint), circuit_model(small_checkpoint)
    want = []
    for n in SIZES:  # the general path: checked, copied in and padded by the runner itself
        out = plain.runner.run(n, general_inputs(rows_for(plain, n)))
        want.append({k: v.clone() for k, v in out.items()})
    passes = staged_model.runner
    staging = TargetStaging(passes, max_blocks=staged_model.kv.max_blocks_per_seq,
                            device=torch.device("cpu"))
    assert staging.region is not None
    static = passes.graphs.backend.static_inputs
    scratch = passes.graphs.scratch_block
    runs = passes.graphs.unstaged_runs
    for n, w in zip(SIZES, want):
        rows = rows_for(staged_model, n)
        staged = staging.stage(rows.tokens, rows.positions, rows.block_tables, rows.live_rows)
        assert staged is passes.graphs.staged_inputs(n)  # the runner's own: run takes it as is
        got = passes.run(n, staged)
        for k in w:
            assert torch.equal(got[k], w[k]), (n, k)
        assert static["active"][n:].eq(0).all() and static["active"][:n].eq(1).all()
        assert static["block_tables"][n:].eq(scratch).all()
    assert passes.graphs.unstaged_runs == runs  # no pass went the copying way


def test_an_unstaged_run_makes_the_next_fill_rewrite_every_row(small_checkpoint):
    model = circuit_model(small_checkpoint)
    passes = model.runner
    staging = TargetStaging(passes, max_blocks=model.kv.max_blocks_per_seq, device=torch.device("cpu"))
    rows = rows_for(model, 3)
    staging.stage(rows.tokens, rows.positions, rows.block_tables, rows.live_rows)
    passes.run(9, general_inputs(rows_for(model, 9)))  # writes rows 0..8 of the buffers itself
    staging.stage(rows.tokens, rows.positions, rows.block_tables, rows.live_rows)
    static = passes.graphs.backend.static_inputs
    assert static["active"][3:].eq(0).all() and static["block_tables"][3:].eq(passes.graphs.scratch_block).all()


def test_a_prefill_bucket_wider_than_the_graphs_is_not_staged(small_checkpoint):
    """Buckets past graph_rows run uncaptured on the wide runner: stage() declines them (the
    model's general staging serves them) and the model's pass there still equals the eager one."""
    ck = load_checkpoint(small_checkpoint)
    eng = Engine(ck, EngineConfig(speculate=False, device="cpu", max_rows=64))
    kv = eng.target.model.kv
    model = TargetModel(ck.config, ck.target, kv, max_rows=64, forward="circuit", graph_rows=8)
    eager = TargetModel(ck.config, ck.target, kv, max_rows=64, forward="eager")
    staging = TargetStaging(model.runner, max_blocks=kv.max_blocks_per_seq, device=torch.device("cpu"))
    rows = rows_for(model, 8)
    assert staging.stage(rows.tokens, rows.positions, rows.block_tables, rows.live_rows) is not None
    rows = rows_for(model, 9)
    assert staging.stage(rows.tokens, rows.positions, rows.block_tables, rows.live_rows) is None
    assert model.forward(rows)[0] == eager.forward(rows)[0]


@cuda
def test_captured_passes_stage_with_one_copy_and_no_sync_and_match_the_general_path(small_checkpoint):
    """On the GPU: a captured pass's inputs land in its graph's buffers through the pinned
    mirror without a synchronizing copy (device tokens too), and the replay's tokens and hiddens
    equal those of the same passes staged the general way (the runner copying and padding)."""
    ck = load_checkpoint(small_checkpoint)
    kv = Engine(ck, EngineConfig(speculate=False, device="cpu", max_rows=64)).target.model.kv
    staged_model = TargetModel(ck.config, ck.target, kv, max_rows=64, forward="circuit", device="cuda")
    plain = TargetModel(ck.config, ck.target, kv, max_rows=64, forward="circuit", device="cuda")
    staged_model.stage_inputs(rows_for(staged_model, 2))  # makes the staging (a pinned alloc)
    for n, tokens_on in ((5, "cpu"), (9, "cuda"), (3, "cpu"), (3, "cuda"), (16, "cpu")):
        rows = rows_for(staged_model, n, tokens_on)
        staged = stage_without_sync(staged_model, rows)
        assert staged is staged_model.runner.graphs.staged_inputs(n)
        got = staged_model.runner.run(n, staged)
        got = {k: v.clone() for k, v in got.items()}
        want = plain.runner.run(n, {k: v.to("cuda") for k, v in general_inputs(rows).items()})
        for k in want:
            assert torch.equal(got[k], want[k]), (n, tokens_on, k)
    assert staged_model._graph_staging.host.is_pinned()


def test_malformed_rows_go_the_checked_way_and_are_refused_by_name(small_checkpoint):
    """Rows the mirror cannot take as they are (int64 tokens, a table of the wrong width) are not
    staged: the model's general path checks them, and its error names the input."""
    model = circuit_model(small_checkpoint)
    staging = TargetStaging(model.runner, max_blocks=model.kv.max_blocks_per_seq, device=torch.device("cpu"))
    rows = rows_for(model, 4)
    assert staging.stage(rows.tokens.long(), rows.positions, rows.block_tables, rows.live_rows) is None
    short = rows.block_tables[:, :-1].contiguous()
    assert staging.stage(rows.tokens, rows.positions, short, rows.live_rows) is None
    with pytest.raises(BindingError, match="block_tables"):
        model.forward(TargetRows(tokens=rows.tokens, positions=rows.positions, block_tables=short,
                                 live_rows=rows.live_rows))
