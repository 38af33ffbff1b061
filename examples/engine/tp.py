"""Tensor parallelism for the engine (issue 21): `torchrun --nproc-per-node N -m examples.engine --tp N`.

Every rank runs the whole engine (scheduler, acceptance, catch-up) on the same requests; the target
and the drafter are each rank's shard (circuit/layers/tp.py: heads and intermediate rows split, the
lm-heads vocabulary-parallel), and their collectives run on torch.distributed's default group
(gloo on CPU, NCCL on CUDA), which the runners use when given none. The tokens each pass returns
are replicated bits on every rank, so every rank takes the same decisions and the output is the
TP = 1 run's, token for token (tests/distributed/test_tp_engine.py). Rank 0 prints and writes.

Shards: Llama-family dense targets (Qwen2/3 attention options included) and the dense or MoE MTP
head; refused by name (EngineError): MoE and MLA targets, EAGLE-3 drafters, reduced draft
vocabularies, world sizes the config does not divide. Each rank reads only
its slices of the target and the drafter (checkpoints.load_checkpoint(tp=N): tp_checkpoint.py's
loaders over the whole loaders' read plans); the weights come back as `ShardWeights`, which the
target and `shard_drafter` bind as they are. A rank that cannot load makes every rank refuse
(`agreed`), so none waits in a collective its peers never reach.
"""
from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import MoeConfig
from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.circuit.layers.tp import TpConfigError, TpPlan, shard_head, shard_weights, tp_plan
from examples.engine.checkpoints import EngineError

T = TypeVar("T")


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


def _joined(tp: int) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != tp:
        raise EngineError(f"--tp {tp}: torch.distributed must run {tp} ranks (torchrun --nproc-per-node {tp})")


def agreed(tp: int, load: Callable[[], T]) -> T:
    """`load()` on every rank of the default group, then agreement (runners.distributed.agree):
    if it failed anywhere, every rank raises EngineError naming each failed rank and its error
    (a rank whose files are missing or corrupt, a refusal on one rank only); a rank that never
    answers is a timeout on the others, typed the same way, never a hang."""
    import torch.distributed as dist

    from draft_circuit.runners.distributed import ShardLoadError, agree

    _joined(tp)
    result: T | None = None
    error: BaseException | None = None
    try:
        result = load()
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks, typed
        error = e
    try:
        agree(dist.group.WORLD, error, "loading this rank's shards of the checkpoint")
    except ShardLoadError as e:
        raise EngineError(f"--tp {tp}: {e}") from e
    assert result is not None  # no rank failed, this one included
    return result


def plan_for(config: MtpConfig, tp: int) -> TpPlan | None:
    """This rank's shard of the target (None: tp == 1); refusals as EngineError."""
    if tp == 1:
        return None
    import torch.distributed as dist

    _joined(tp)
    if isinstance(config, (MoeConfig, MlaConfig)):
        raise EngineError(f"--tp {tp}: a {type(config).__name__} target does not shard yet; Llama-family "
                          "dense targets do")
    try:
        return tp_plan(config, int(dist.get_rank()), tp)
    except TpConfigError as e:
        raise EngineError(f"--tp {tp}: the target: {e}") from None


def shard_drafter(head: MtpHead, weights: dict[str, torch.Tensor], plan: TpPlan | None,
                  draft_vocab: Any = None) -> tuple[MtpHead, dict[str, torch.Tensor]]:
    """The drafter head and its bound params: whole (plan None), or this rank's shard (`weights`
    whole, sliced here, or already this shard's `ShardWeights`, bound as they are)."""
    if plan is None:
        return head, head.bind(weights)
    if draft_vocab is not None:
        raise EngineError(f"--tp {plan.world_size}: a reduced draft vocabulary does not shard yet")
    try:
        shard = shard_head(head, plan.rank, plan.world_size)
    except TpConfigError as e:
        raise EngineError(f"--tp {plan.world_size}: the drafter: {e}") from None
    return shard, shard.bind(shard_weights(weights, shard.tp))
