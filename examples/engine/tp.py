"""Tensor parallelism for the engine (issue 21): `torchrun --nproc-per-node N -m examples.engine --tp N`.

Every rank runs the whole engine (scheduler, acceptance, catch-up) on the same requests; the target
and the drafter are each rank's shard (circuit/layers/tp.py: heads and intermediate rows split, the
lm-heads vocabulary-parallel), and their collectives run on torch.distributed's default group
(gloo on CPU, NCCL on CUDA), which the runners use when given none. The tokens each pass returns
are replicated bits on every rank, so every rank takes the same decisions and the output is the
TP = 1 run's, token for token (tests/distributed/test_tp_engine.py). Rank 0 prints and writes.

Shards: Llama-family dense targets (Qwen2/3 attention options included) and the dense or MoE MTP
head; refused by name (EngineError): MoE and MLA targets, EAGLE-3 drafters, reduced draft
vocabularies, world sizes the config does not divide. The checkpoint is read whole on each rank and
sliced in memory here (runners.distributed.load_sharded_head reads a drafter's slices alone).
"""
from __future__ import annotations

import os
from typing import Any

import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import MoeConfig
from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.circuit.layers.tp import TpConfigError, TpPlan, shard_head, shard_weights, tp_plan
from examples.engine.checkpoints import EngineError


def start(tp: int, device: str) -> int:
    """Join torchrun's group of `tp` ranks (gloo on CPU, NCCL on CUDA, one GPU a rank); this rank."""
    import torch.distributed as dist

    from draft_circuit.runners.distributed import init_group

    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != tp:
        raise EngineError(f"--tp {tp}: run under torchrun --nproc-per-node {tp} (WORLD_SIZE is "
                          f"{os.environ.get('WORLD_SIZE', 'unset')})")
    if device.startswith("cuda"):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    init_group(device)
    return int(dist.get_rank())


def plan_for(config: MtpConfig, tp: int) -> TpPlan | None:
    """This rank's shard of the target (None: tp == 1); refusals as EngineError."""
    if tp == 1:
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != tp:
        raise EngineError(f"--tp {tp}: torch.distributed must run {tp} ranks (torchrun --nproc-per-node {tp})")
    if isinstance(config, (MoeConfig, MlaConfig)):
        raise EngineError(f"--tp {tp}: a {type(config).__name__} target does not shard yet; Llama-family "
                          "dense targets do")
    try:
        return tp_plan(config, int(dist.get_rank()), tp)
    except TpConfigError as e:
        raise EngineError(f"--tp {tp}: the target: {e}") from None


def shard_drafter(head: MtpHead, weights: dict[str, torch.Tensor], plan: TpPlan | None,
                  draft_vocab: Any = None) -> tuple[MtpHead, dict[str, torch.Tensor]]:
    """The drafter head and its bound params: whole (plan None), or this rank's shard."""
    if plan is None:
        return head, head.bind(weights)
    if draft_vocab is not None:
        raise EngineError(f"--tp {plan.world_size}: a reduced draft vocabulary does not shard yet")
    try:
        shard = shard_head(head, plan.rank, plan.world_size)
    except TpConfigError as e:
        raise EngineError(f"--tp {plan.world_size}: the drafter: {e}") from None
    return shard, shard.bind(shard_weights(weights, shard.tp))
