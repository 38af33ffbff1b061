"""FAULTS 23, strengthened (issue 19): a world size the head cannot shard over is refused when the
shard is built (`shard_head` / `tp_plan`, before any weight or circuit exists), as a
TpConfigError (a ConfigError) naming the config field and its value, for the query heads, the
KV heads either way (split when the world divides them, replicate when they divide the world),
the dense and the MoE intermediate sizes, and a vocabulary smaller than the world; and not only
the expert count (layers/moe.py's expert_parallel_size). A vocabulary no world size divides is
not refused: its shards are balanced runs that cover every id exactly once."""
import dataclasses

import pytest

from draft_circuit.circuit.layers.config import ConfigError, MtpConfig
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead
from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.circuit.layers.tp import TpConfigError, shard_head, tp_plan, vocab_shard

CFG = MtpConfig(vocab_size=250, hidden_size=64, intermediate_size=96, num_attention_heads=12,
                num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512)


def _moe(**kw):
    fields = {**dataclasses.asdict(CFG), "n_routed_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, **kw}
    return MoeConfig(**fields)


@pytest.mark.parametrize("config,world,message", [
    (dataclasses.replace(CFG, num_attention_heads=10, num_key_value_heads=5), 4,
     "'num_attention_heads' = 10 is not divisible by 4"),
    (dataclasses.replace(CFG, intermediate_size=90), 4, "'intermediate_size' = 90 is not divisible by 4"),
    (CFG, 3, "'num_key_value_heads' = 4: KV heads split when 3 divides them"),      # 4 >= 3, 3 ∤ 4
    (CFG, 6, "'num_key_value_heads' = 4: KV heads split when 6 divides them, or replicate"),  # 4 ∤ 6
    (dataclasses.replace(CFG, vocab_size=3), 4, "'vocab_size' = 3 leaves a rank no vocabulary rows"),
], ids=["query_heads", "intermediate", "kv_split", "kv_replicate", "vocab"])
def test_a_world_the_head_cannot_shard_over_is_refused_by_field(config, world, message):
    for rank in (0, world - 1):  # every rank refuses alike, before anything is built
        with pytest.raises(TpConfigError, match=message) as err:
            shard_head(MtpHead(config), rank, world)
        assert isinstance(err.value, ConfigError)


def test_moe_heads_refuse_their_own_sizes_too():
    with pytest.raises(TpConfigError, match="'moe_intermediate_size' = 18 is not divisible by 4"):
        shard_head(MoeMtpHead(_moe(moe_intermediate_size=18)), 0, 4)
    with pytest.raises(TpConfigError, match="'num_attention_heads' = 12 is not divisible by 8"):
        shard_head(MoeMtpHead(_moe()), 0, 8)
    with pytest.raises(ConfigError, match="'expert_parallel_size' = 3: must divide n_routed_experts = 4"):
        _moe(expert_parallel_size=3)  # the expert count: refused by the config itself


@pytest.mark.parametrize("world", [1, 2, 4, 12])
def test_worlds_that_fit_shard_and_an_indivisible_vocabulary_is_covered_once(world):
    for rank in range(world):
        assert tp_plan(CFG, rank, world).world_size == world
    runs = [vocab_shard(CFG.vocab_size, r, world) for r in range(world)]
    ids = [i for offset, rows in runs for i in range(offset, offset + rows)]
    assert ids == list(range(CFG.vocab_size))          # 250 over 4 or 12: no world divides it
    assert max(r for _, r in runs) - min(r for _, r in runs) <= 1  # balanced
