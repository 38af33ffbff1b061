"""Shard-by-shard loading (issue 21 item 3): each rank reads only its slices of the target and the
drafter through get_slice (bytes counted by a wrapper around the loader's file handles), in one
process for the loaders and over a gloo group of 2 for the engine's `load_checkpoint(tp=2)`, whose
refusal when one rank's files are truncated or missing reaches every rank, typed, without a hang."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.layers import tp_checkpoint
from draft_circuit.circuit.layers.checkpoint import load_mtp_weights, load_target_weights
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.tp import TpConfigError, shard_target_weights, shard_weights, tp_plan
from draft_circuit.circuit.layers.tp_checkpoint import TpShardError, load_mtp_shard, load_target_shard
from tests.distributed import shard_load_workers
from tests.distributed.harness import ReadSpy, spawn
from tests.distributed.test_tp_cpu import CFG

LAYER = f"model.layers.{CFG.num_hidden_layers}."  # the MTP layer's prefix


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("tied", [False, True])
def test_a_target_rank_reads_only_its_slices(tmp_path, monkeypatch, tied):
    """Per rank of 4: the target's slices == the whole load's, narrowed; the bytes read are exactly
    them, once each (tied: the lm-head's rows come out of the embedding read whole, no second
    read); never a get_tensor."""
    config = dataclasses.replace(CFG, tie_word_embeddings=tied)
    path = write_random_checkpoint(tmp_path / "ckpt", config, seed=2, shards=2)
    whole = load_target_weights(path)
    world, h = 4, config.hidden_size
    for rank in range(world):
        counts: dict[str, int] = {}
        monkeypatch.setattr(tp_checkpoint, "_open_file", ReadSpy(counts))
        shard = load_target_shard(path, rank, world)
        plan = tp_plan(config, rank, world)
        want = shard_target_weights(whole, plan)
        assert shard.plan == plan and shard.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(shard[name], t), name
        head = want["lm_head.weight"]
        assert head.shape == (plan.vocab[1], h)
        assert sum(counts.values()) == _bytes(want.values()) - (_bytes([head]) if tied else 0)
        assert counts["model.embed_tokens.weight"] == config.vocab_size * h * 4  # replicated, once
        assert ("lm_head.weight" in counts) is not tied
        if not tied:
            assert counts["lm_head.weight"] == plan.vocab[1] * h * 4
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight"):
            key = "model.layers.0." + name
            assert counts[key] == whole[key].numel() * 4 // world, key
        assert counts["model.layers.0.self_attn.k_proj.weight"] == whole[
            "model.layers.0.self_attn.k_proj.weight"].numel() * 4 // 2  # 2 KV heads: each on 2 ranks
        assert counts["model.norm.weight"] == h * 4


def test_a_tied_drafter_reads_its_embedding_once(tmp_path, monkeypatch):
    """The MTP layer's head tied to its embedding: the embedding is read whole once and the
    head's vocabulary rows are its rows, not a second read."""
    config = dataclasses.replace(CFG, tie_word_embeddings=True)
    path = write_random_checkpoint(tmp_path / "ckpt", config, seed=3, mtp_shares_head=True)
    _, whole = load_mtp_weights(path)
    for rank in range(2):
        counts: dict[str, int] = {}
        monkeypatch.setattr(tp_checkpoint, "_open_file", ReadSpy(counts))
        _, shard = load_mtp_shard(path, rank, 2)
        want = shard_weights(whole, tp_plan(config, rank, 2))
        assert all(torch.equal(shard[k], want[k]) for k in want) and shard.keys() == want.keys()
        head = want["shared_head.head.weight"]
        assert sum(counts.values()) == _bytes(want.values()) - _bytes([head])
        assert counts[LAYER + "embed_tokens.weight"] == config.vocab_size * config.hidden_size * 4


def test_shard_weights_pass_through_and_refuse_another_ranks(checkpoint_path):
    _, mine = load_mtp_shard(checkpoint_path, 0, 2)
    assert shard_weights(mine, tp_plan(CFG, 0, 2)) is mine  # already the slices: not narrowed again
    with pytest.raises(TpConfigError, match="rank 0 of 2's slices, asked for rank 1 of 2's"):
        shard_weights(mine, tp_plan(CFG, 1, 2))
    target = load_target_shard(checkpoint_path, 1, 2)
    with pytest.raises(TpConfigError, match="rank 1 of 2's slices, asked for rank 1 of 4's"):
        shard_target_weights(target, tp_plan(CFG, 1, 4))


def test_an_fp8_stored_target_tensor_is_refused(tmp_path):
    path = write_random_checkpoint(tmp_path / "ckpt", CFG, seed=5)
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = tensors[key].to(torch.float8_e4m3fn)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(TpShardError, match=f"tensor '{key}' is stored float8_e4m3fn with no _scale_inv block scales"):
        load_target_shard(path, 0, 2)


@pytest.fixture
def checkpoint_path(tmp_path):
    return write_random_checkpoint(tmp_path / "ckpt", CFG, seed=4, shards=2)


def test_engine_ranks_load_their_shards_and_refuse_together(tmp_path):
    """Over gloo, 2 ranks (shard_load_workers.engine_loading_worker): load_checkpoint(tp=2) reads
    exactly this rank's slices of the target and the drafter; a truncated shard file, then a
    missing one, on rank 1 alone is an EngineError on both ranks naming rank 1 and the fault; a
    rank that died makes the other's load refuse within the group's timeout, never hang."""
    good = write_random_checkpoint(tmp_path / "good", CFG, seed=6, shards=2, mtp_shares_embed=True,
                                   mtp_shares_head=True)
    corrupt, missing = tmp_path / "corrupt", tmp_path / "missing"
    shutil.copytree(good, corrupt)
    shutil.copytree(good, missing)
    first = sorted(corrupt.glob("*.safetensors"))[0]
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2])
    sorted(missing.glob("*.safetensors"))[1].unlink()
    out = tmp_path / "out"
    out.mkdir()
    spawn(shard_load_workers.engine_loading_worker, 2, tmp_path, str(out), str(good), str(corrupt),
          str(missing), collective_timeout_s=10.0)
    for rank in (0, 1):
        assert (out / f"slices_{rank}.txt").read_text() == "ok", (out / f"slices_{rank}.txt").read_text()
        refusals = (out / f"bad_files_{rank}.txt").read_text()
        assert not refusals.startswith("FAILED"), refusals
        assert refusals.count("rank 1: EngineError: target checkpoint") == 2, refusals
    gone = (out / "gone_0.txt").read_text()
    assert gone.startswith("--tp 2: loading this rank's shards of the checkpoint: rank 0 got no answer "
                           "from the group within its timeout"), gone
