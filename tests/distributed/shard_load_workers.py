"""What each rank runs in the engine's shard-by-shard loading test (spawned by harness.spawn):
module-level functions, so the spawn start method can pickle them by name."""
from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

from draft_circuit.circuit.layers import tp_checkpoint
from draft_circuit.circuit.layers.tp import ShardWeights, shard_target_weights, shard_weights, tp_plan
from draft_circuit.runners.distributed import agree
from examples.engine.checkpoints import EngineError, load_checkpoint
from tests.distributed.harness import ReadSpy


def _engine_reads_only_its_slices(rank: int, world: int, good: str) -> None:
    """load_checkpoint(tp=world) == the whole load's slices (target and drafter), as ShardWeights,
    and the bytes this rank read are exactly those slices: each loader its own, so the
    embedding the drafter borrows from the target is read whole once by each."""
    whole = load_checkpoint(good)  # the whole loaders open files through checkpoint._open: not counted
    counts: dict[str, int] = {}
    tp_checkpoint._open_file = ReadSpy(counts)
    try:
        mine = load_checkpoint(good, tp=world)
    finally:
        tp_checkpoint._open_file = tp_checkpoint._ckpt._open
    assert whole.mtp is not None and mine.mtp is not None and mine.mtp_config is not None
    target_plan, mtp_plan = tp_plan(mine.config, rank, world), tp_plan(mine.mtp_config, rank, world)
    assert isinstance(mine.target, ShardWeights) and mine.target.plan == target_plan
    assert isinstance(mine.mtp, ShardWeights) and mine.mtp.plan == mtp_plan
    want_target = shard_target_weights(whole.target, target_plan)
    want_mtp = shard_weights(whole.mtp, mtp_plan)
    for got, want in ((mine.target, want_target), (mine.mtp, want_mtp)):
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), name
    expected = sum(t.numel() * t.element_size() for t in (*want_target.values(), *want_mtp.values()))
    assert sum(counts.values()) == expected, (sum(counts.values()), expected)
    c = mine.config
    embed = c.vocab_size * c.hidden_size * 4
    assert counts["model.embed_tokens.weight"] == 2 * embed  # replicated: target + drafter's fallback
    assert counts["lm_head.weight"] == target_plan.vocab[1] * c.hidden_size * 4 * 2  # both lm-heads: rows
    assert counts["model.layers.0.self_attn.q_proj.weight"] == c.hidden_size * c.hidden_size * 4 // world


def _bad_files_refuse_everywhere(rank: int, world: int, good: str, corrupt: str, missing: str) -> str:
    """Rank 1 alone reads a truncated shard file, then an index naming a file that is gone: every
    rank raises EngineError naming rank 1 and the file's fault; afterwards the group still agrees
    (no rank was left inside a collective)."""
    lines = []
    for bad, fault in ((corrupt, "truncated or corrupt"), (missing, "which does not exist")):
        try:
            load_checkpoint(bad if rank == 1 else good, tp=world)
        except EngineError as e:
            text = str(e)
            assert text.startswith(f"--tp {world}: loading this rank's shards of the checkpoint failed on "
                                   f"1 of {world} ranks: rank 1: EngineError: target checkpoint {bad}"), text
            assert fault in text and "rank 0:" not in text, text
            lines.append(text)
        else:
            raise AssertionError(f"rank {rank}: loading {bad if rank == 1 else good} did not refuse")
    agree(torch.distributed.group.WORLD, None, "after the refusals")
    return "\n".join(lines)


def engine_loading_worker(rank: int, world: int, group, out: str, good: str, corrupt: str, missing: str) -> None:
    """Each check writes `<name>_<rank>.txt`: "ok" (or the refusals' messages) or its traceback.
    Last, rank 1 dies before loading: rank 0's load_checkpoint refuses (the group's timeout), typed."""
    for name, check in (("slices", lambda: _engine_reads_only_its_slices(rank, world, good)),
                        ("bad_files", lambda: _bad_files_refuse_everywhere(rank, world, good, corrupt, missing))):
        try:
            result = check() or "ok"
        except Exception:  # noqa: BLE001 - reported to the test that reads this check
            result = "FAILED\n" + traceback.format_exc()
        Path(out, f"{name}_{rank}.txt").write_text(result)
    if rank == 1:  # dies before the next collective, as a crash would (see tp_workers.refusal_worker)
        os._exit(0)
    try:
        load_checkpoint(good, tp=world)
        result = "loaded"
    except EngineError as e:
        result = str(e)
    Path(out, f"gone_{rank}.txt").write_text(result)
