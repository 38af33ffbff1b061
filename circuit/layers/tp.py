"""Tensor-parallel MTP heads (issue 21): one rank's shard of the dense or MoE head, emitted from
the same layer library (`MtpHead.emit_step` with its two tensor-parallel hooks), Megatron style.

- Column-parallel: q/k/v (each rank its run of query heads; KV heads split across ranks, or,
  with fewer KV heads than ranks, each rank holding the one KV head its query heads read,
  replicated world_size / num_kv_heads times) and gate/up (a run of the intermediate dim; for a
  MoE head, of every routed and shared expert's: tensor parallelism within each expert).
- Row-parallel: o_proj and down_proj (the MoE block's output too) read the matching columns and
  are followed by `all_reduce`, so the residual stream is replicated on every rank.
- The lm-head is vocabulary-parallel (a run of vocabulary rows; balanced, the first V % w ranks
  one row more) and its draft is `vocab_parallel_argmax`: the highest logit, the lowest global id
  on ties, and a cross-rank log-sum-exp so the confidence is the full-vocabulary log-probability.
- The embedding is replicated. A draft step looks up n rows (n * hidden bytes whichever way),
  while a vocabulary-parallel embedding costs an all-reduce of [n, hidden] per step, on the
  latency-bound path k times a verify; its price is memory, vocab * hidden per rank (1.85 GB
  bf16 for DeepSeek-V3's 129280 x 7168), which the target's own shard usually shares.
  `embed_write` reads the same replicated table.
- Replicated too: the norms, eh_proj (a [hidden, 2 hidden] matmul, as SGLang's MTP layer keeps
  it) and the MoE router (every rank routes identically, so the expert slots agree).

Refused by name (`TpConfigError`): a world size that does not divide the query heads, the
intermediate sizes or the KV heads (either way), a vocabulary smaller than the world, expert
parallelism (as the single-device head refuses it), fp8 experts, MLA and EAGLE-3 heads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.layers.config import ConfigError, MtpConfig
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead
from draft_circuit.circuit.layers.mtp import MtpHead

__all__ = ["TpConfigError", "TpPlan", "TpMtpHead", "TpMoeMtpHead", "Slice", "ShardWeights", "tp_plan",
           "shard_head", "shard_weights", "shard_kv", "vocab_shard", "row_sum", "vocab_argmax", "target_slice_of",
           "shard_target_weights"]


class TpConfigError(ConfigError):
    """A head or config that cannot shard over the requested world; names the field."""


@dataclass(frozen=True)
class Slice:
    """The run [start, stop) of dimension `dim` of a checkpoint tensor that one rank holds."""

    dim: int
    start: int
    stop: int


def vocab_shard(vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """(offset, rows) of rank's vocabulary rows: balanced, the first vocab % world ranks hold one
    more, in rank order (so the lowest global id on a tie is the lowest rank's)."""
    base, extra = divmod(vocab, world_size)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class TpPlan:
    """Which slices rank `rank` of `world_size` holds of a head with config `config`."""

    config: MtpConfig
    rank: int
    world_size: int

    @property
    def q_heads(self) -> tuple[int, int]:
        per = self.config.num_attention_heads // self.world_size
        return self.rank * per, (self.rank + 1) * per

    @property
    def kv_heads(self) -> tuple[int, int]:
        """The KV heads this rank holds: its run, or the one its query heads read (replicated)."""
        kv, w = self.config.num_key_value_heads, self.world_size
        if kv >= w:
            return self.rank * (kv // w), (self.rank + 1) * (kv // w)
        head = self.rank // (w // kv)
        return head, head + 1

    @property
    def kv_replicated(self) -> bool:
        return self.config.num_key_value_heads < self.world_size

    def _run(self, size: int) -> tuple[int, int]:
        per = size // self.world_size
        return self.rank * per, (self.rank + 1) * per

    @property
    def vocab(self) -> tuple[int, int]:
        """(offset, rows) of the lm-head's vocabulary rows."""
        return vocab_shard(self.config.vocab_size, self.rank, self.world_size)

    @property
    def local_config(self) -> MtpConfig:
        """The shard as a config: its query and KV heads and intermediate sizes (the vocabulary,
        hidden size and everything else whole; the lm-head's rows are the head's own)."""
        c = self.config
        fields: dict[str, Any] = {
            "num_attention_heads": c.num_attention_heads // self.world_size,
            "num_key_value_heads": self.kv_heads[1] - self.kv_heads[0],
            "intermediate_size": c.intermediate_size // self.world_size}
        if isinstance(c, MoeConfig):
            fields["moe_intermediate_size"] = c.moe_intermediate_size // self.world_size
        return dataclasses.replace(c, **fields)

    def slice_of(self, name: str) -> Slice | None:
        """The slice of checkpoint tensor `name` (canonical MTP-layer names, as load_mtp_weights
        gives them) this rank holds; None: the whole tensor (replicated)."""
        c, d = self.config, self.config.head_dim
        q0, q1 = self.q_heads
        k0, k1 = self.kv_heads
        if name.startswith("self_attn.q_proj."):
            return Slice(0, q0 * d, q1 * d)
        if name.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
            return Slice(0, k0 * d, k1 * d)
        if name == "self_attn.o_proj.weight":
            return Slice(1, q0 * d, q1 * d)
        if name == "shared_head.head.weight":
            off, rows = self.vocab
            return Slice(0, off, off + rows)
        if name.startswith("mlp.") and name.endswith(("gate_proj.weight", "up_proj.weight", "down_proj.weight")):
            if name.startswith("mlp.experts."):
                assert isinstance(c, MoeConfig)  # only a MoE layout names experts
                i0, i1 = self._run(c.moe_intermediate_size)
            elif name.startswith("mlp.shared_experts."):
                assert isinstance(c, MoeConfig)
                i0, i1 = self._run(c.shared_intermediate_size)
            else:
                i0, i1 = self._run(c.intermediate_size)
            return Slice(1 if name.endswith("down_proj.weight") else 0, i0, i1)
        return None


def tp_plan(config: MtpConfig, rank: int, world_size: int) -> TpPlan:
    """The shard plan of `config` for rank `rank`, after every refusal (TpConfigError)."""
    from draft_circuit.circuit.layers.eagle3 import Eagle3Config
    from draft_circuit.circuit.layers.mla import MlaConfig

    w = world_size
    if isinstance(w, bool) or not isinstance(w, int) or w < 1 or not isinstance(rank, int) \
            or not 0 <= rank < w:
        raise TpConfigError(f"tensor parallelism: rank {rank!r} of world size {w!r}: need 0 <= rank < "
                            "world_size")
    if isinstance(config, (MlaConfig, Eagle3Config)):
        raise TpConfigError(f"tensor parallelism: {type(config).__name__} heads (MLA, EAGLE-3) do not "
                            "shard yet; the dense and MoE MTP heads do")
    c = config
    for field in ("num_attention_heads", "intermediate_size"):
        if getattr(c, field) % w:
            raise TpConfigError(f"tensor parallelism over {w} ranks: config field {field!r} = "
                                f"{getattr(c, field)} is not divisible by {w}")
    kv = c.num_key_value_heads
    if (kv >= w and kv % w) or (kv < w and w % kv):
        raise TpConfigError(f"tensor parallelism over {w} ranks: config field 'num_key_value_heads' = "
                            f"{kv}: KV heads split when {w} divides them, or replicate when they divide "
                            f"{w}")
    if c.vocab_size < w:
        raise TpConfigError(f"tensor parallelism over {w} ranks: config field 'vocab_size' = "
                            f"{c.vocab_size} leaves a rank no vocabulary rows")
    if isinstance(c, MoeConfig):
        if c.expert_parallel_size > 1:
            raise TpConfigError(f"expert parallelism (config field 'expert_parallel_size' = "
                                f"{c.expert_parallel_size}) is refused: tensor parallelism shards "
                                "each expert's intermediate dim instead")
        if c.moe_intermediate_size % w:
            raise TpConfigError(f"tensor parallelism over {w} ranks: config field "
                                f"'moe_intermediate_size' = {c.moe_intermediate_size} is not divisible "
                                f"by {w}")
    return TpPlan(config, rank, w)


# ---- what a layer emits for a shard (None: the single-device circuit, unchanged) ----
def row_sum(b: CircuitBuilder, x: str, plan: TpPlan | None) -> str:
    """A row-parallel projection's output: x itself, or its all-reduced partial sum."""
    if plan is None:
        return x
    return b.op1("all_reduce", [x], {"world_size": plan.world_size}, name=f"{x.rsplit('.', 1)[-1]}_sum")


def vocab_argmax(b: CircuitBuilder, logits: str, bitmask: str | None, plan: TpPlan | None) -> tuple[str, str]:
    """(token, logprob) of the lm-head's logits: argmax_logprob, or over a shard's vocabulary rows
    vocab_parallel_argmax (the whole vocabulary's tie rule and log-probability)."""
    if plan is None:
        tok, lp = b.op("argmax_logprob", [logits, bitmask])
        return tok, lp
    offset, rows = plan.vocab
    if b.spec(logits).shape[1] != rows:  # the lm-head's rows were replaced (a draft vocabulary)
        raise TpConfigError(f"tensor parallelism: the lm-head gives {b.spec(logits).shape[1]} logits a "
                            f"row, the shard holds vocabulary rows {rows}; a reduced draft vocabulary "
                            "does not shard yet")
    tok, lp = b.op("vocab_parallel_argmax", [logits, bitmask],
                   {"world_size": plan.world_size, "vocab_size": plan.config.vocab_size,
                    "vocab_offset": offset}, name="argmax")
    return tok, lp


def target_slice_of(plan: TpPlan, name: str) -> Slice | None:
    """A Llama target's HF-named tensor: a layer's as the MTP layer's of the same name, the
    lm-head by vocabulary rows, the embedding and norms whole."""
    if name == "lm_head.weight":
        return plan.slice_of("shared_head.head.weight")
    if name.startswith("model.layers."):
        return plan.slice_of(name.split(".", 3)[3])
    return None


class ShardWeights(dict[str, torch.Tensor]):
    """Weights that already are `plan`'s slices: what the shard-by-shard loaders return
    (tp_checkpoint.py). `shard_weights` / `shard_target_weights` hand them back unchanged, so a
    caller written for whole weights (the engine's target and drafter) binds a sliced load
    without narrowing it twice; asked for another plan's slices, they refuse (TpConfigError)."""

    def __init__(self, plan: TpPlan, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__(tensors)
        self.plan = plan

    def of(self, plan: TpPlan) -> "ShardWeights":
        if plan != self.plan:
            mine = self.plan
            raise TpConfigError(f"tensor parallelism: these weights are rank {mine.rank} of {mine.world_size}'s "
                                f"slices, asked for rank {plan.rank} of {plan.world_size}'s"
                                + ("" if plan.config == mine.config else " of another config"))
        return self


def shard_target_weights(weights: dict[str, torch.Tensor], plan: TpPlan) -> dict[str, torch.Tensor]:
    """Whole HF-named target weights -> the slices `plan`'s rank holds (a `ShardWeights` of
    `plan`, already sliced, as it is)."""
    if isinstance(weights, ShardWeights):
        return weights.of(plan)
    return {name: _take(t, target_slice_of(plan, name)).contiguous() for name, t in weights.items()}


class _TpShard:
    """What a shard changes in a head: the lm-head's rows, all_reduce after the row-parallel
    projections, the vocabulary-parallel argmax. Mixed in before the head's class."""

    tp: TpPlan
    lm_head: str
    dtype: str

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = dict(super().param_shapes())  # type: ignore[misc]  # a head class follows in the MRO
        shapes[self.lm_head] = (self.tp.vocab[1], shapes[self.lm_head][1])
        return shapes

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        specs = dict(super().param_specs())  # type: ignore[misc]
        dtype, shape = specs[self.lm_head]
        specs[self.lm_head] = (dtype, (self.tp.vocab[1], shape[1]))
        return specs

    def row_parallel_sum(self, b: CircuitBuilder, x: str) -> str:
        return row_sum(b, x, self.tp)

    def emit_argmax(self, b: CircuitBuilder, logits: str, bitmask: str | None) -> tuple[str, str]:
        return vocab_argmax(b, logits, bitmask, self.tp)

    def plan_notes(self) -> dict[str, Any]:
        notes = dict(super().plan_notes())  # type: ignore[misc]
        q0, q1 = self.tp.q_heads
        k0, k1 = self.tp.kv_heads
        off, rows = self.tp.vocab
        notes["tensor_parallel"] = {
            "rank": self.tp.rank, "world_size": self.tp.world_size, "query_heads": [q0, q1],
            "kv_heads": [k0, k1], "kv_replicated": self.tp.kv_replicated,
            "vocab_rows": [off, off + rows], "embedding": "replicated"}
        return notes


class TpMtpHead(_TpShard, MtpHead):
    """Rank `plan.rank`'s shard of the dense MTP head; `bind` takes its sliced checkpoint weights
    (`shard_weights`, or `load_mtp_shard`, which reads only them)."""

    def __init__(self, plan: TpPlan, dtype: str = "float32") -> None:
        if isinstance(plan.config, MoeConfig):
            raise TypeError("TpMtpHead shards a dense head; use TpMoeMtpHead for a MoeConfig")
        super().__init__(plan.local_config, dtype)
        self.tp = plan


class TpMoeMtpHead(_TpShard, MoeMtpHead):
    """Rank `plan.rank`'s shard of the MoE head: the router replicated, each routed and shared
    expert sharded within (its intermediate dim), the MoE output all-reduced."""

    config: MoeConfig

    def __init__(self, plan: TpPlan, dtype: str = "float32") -> None:
        local = plan.local_config
        assert isinstance(local, MoeConfig)  # the plan of a MoeConfig keeps its class
        super().__init__(local, dtype)
        self.tp = plan


def shard_head(head: MtpHead, rank: int, world_size: int) -> MtpHead:
    """Rank `rank`'s shard of `head` (an `MtpHead` or a `MoeMtpHead` with unquantised experts)."""
    plan = tp_plan(head.config, rank, world_size)
    if type(head) is MtpHead:
        return TpMtpHead(plan, head.dtype)
    if type(head) is MoeMtpHead:
        if head.fp8_experts:
            raise TpConfigError("tensor parallelism: fp8 experts do not shard yet (their 128x128 scale "
                                "blocks would split); load the experts dequantised")
        return TpMoeMtpHead(plan, head.dtype)
    raise TpConfigError(f"tensor parallelism: {type(head).__name__} does not shard yet; MtpHead and "
                        "MoeMtpHead do")


def _take(t: torch.Tensor, s: Slice | None) -> torch.Tensor:
    return t if s is None else t.narrow(s.dim, s.start, s.stop - s.start)


def shard_weights(weights: dict[str, torch.Tensor], plan: TpPlan) -> dict[str, torch.Tensor]:
    """Whole canonical weights -> the slices `plan`'s rank holds (what load_mtp_shard reads; its
    `ShardWeights` of `plan`, already sliced, as it is)."""
    if isinstance(weights, ShardWeights):
        return weights.of(plan)
    return {name: _take(t, plan.slice_of(name)).contiguous() for name, t in weights.items()}


def shard_kv(cache: torch.Tensor, plan: TpPlan) -> torch.Tensor:
    """A whole [blocks, block_size, kv_heads, head_dim] pool -> the KV heads this rank holds."""
    k0, k1 = plan.kv_heads
    return cache[:, :, k0:k1].clone()
