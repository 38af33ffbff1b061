"""TargetModel.stage_inputs (issue 14): on CPU a pass's inputs are the rows' own tensors and a
fresh `active`, as before; on a GPU every host int input travels in one pinned mirror with one
non_blocking copy and `active` is a persistent device buffer, so staging a verify pass never
blocks the host (no synchronizing copy: torch's sync debug mode raises on one)."""
from __future__ import annotations

import torch

from examples.engine import Engine, EngineConfig, load_checkpoint
from examples.engine.model import TargetRows
from draft_circuit.runners.testing import cuda


def rows_for(model, n, device="cpu"):
    m = model.kv.max_blocks_per_seq
    pos = torch.arange(n, dtype=torch.int32) + 3
    tables = torch.zeros(n, m, dtype=torch.int32)
    tables[:, 0] = 1
    return TargetRows(tokens=(torch.arange(n, dtype=torch.int32) + 5).to(device), positions=pos,
                      block_tables=tables, live_rows=pos)


def stage_without_sync(model, rows):
    """model.stage_inputs(rows) with torch's sync debug mode raising on any synchronizing call."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return model.stage_inputs(rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def model_on(path, device):
    return Engine(load_checkpoint(path), EngineConfig(speculate=False, device=device,
                                                      max_rows=64)).target.model


def test_cpu_staging_hands_the_rows_through(small_checkpoint):
    model = model_on(small_checkpoint, "cpu")
    rows = rows_for(model, 5)
    staged = model.stage_inputs(rows)
    assert staged["tokens"] is rows.tokens and staged["positions"] is rows.positions
    assert staged["block_tables"] is rows.block_tables and staged["live_rows"] is rows.live_rows
    assert staged["active"].tolist() == [1] * 5


@cuda
def test_a_verify_pass_stages_without_a_synchronizing_copy(small_checkpoint):
    model = model_on(small_checkpoint, "cuda")
    model.stage_inputs(rows_for(model, 2))  # made once (its pinned allocation is not a pass's)
    for n, tokens_on in ((5, "cpu"), (9, "cuda"), (3, "cpu")):  # device tokens: passed through
        rows = rows_for(model, n, tokens_on)
        staged = stage_without_sync(model, rows)
        assert all(t.device.type == "cuda" for t in staged.values())
        for name in ("tokens", "positions", "block_tables", "live_rows"):
            assert torch.equal(staged[name].cpu(), getattr(rows, name).cpu()), name
        assert staged["active"].tolist() == [1] * n
        assert staged["active"].data_ptr() == model._active.data_ptr()  # persistent, not fresh
        if tokens_on == "cuda":
            assert staged["tokens"] is rows.tokens
    assert model._mirror.is_pinned()
    rows = rows_for(model, 4)  # the pass itself: the tokens of the old pageable inputs
    old = {"tokens": rows.tokens, "positions": rows.positions, "block_tables": rows.block_tables,
           "live_rows": rows.live_rows, "active": torch.ones(4, dtype=torch.int32)}
    want = model.runner.run(4, {k: v.to("cuda") for k, v in old.items()})["token"].tolist()
    assert model.forward(rows)[0] == want
