"""Tensor-parallel drafting on torch.distributed (issue 21): the process group, the ranks' agreement
on loading, and a rank's sharded head loaded from a checkpoint.

No transport of our own: gloo on CPU, NCCL on CUDA, as `init_process_group` sets them up (torchrun's
environment, or explicit rank / world size / init method). Every collective runs with the group's
timeout, so a rank that died or hangs turns into an error on the others, never a hang. NVLink
multicast (NVLS) is switched off before NCCL starts: `NCCL_NVLS_ENABLE=0` unless the caller set it.

The runners take the group (`ProgramRunner(..., group=)`, `GraphRunner(..., group=)`,
`EagerRunner(..., group=)`); this module only makes and checks it.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from draft_circuit.circuit.layers.heads import head_for
from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.circuit.layers.tp import shard_head, tp_plan
from draft_circuit.circuit.layers.tp_checkpoint import load_mtp_shard

DEFAULT_TIMEOUT_S = 60.0


class ShardLoadError(RuntimeError):
    """Some rank could not load its shard; raised on every rank, naming each failed rank and why."""


class GroupTimeoutError(ShardLoadError):
    """A rank did not answer a collective within the group's timeout (it died or hangs)."""


def backend_for(device: str | torch.device) -> str:
    """gloo for CPU tensors, NCCL for CUDA ones."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_group(device: str | torch.device = "cpu", *, rank: int | None = None,
               world_size: int | None = None, init_method: str | None = None,
               timeout_s: float = DEFAULT_TIMEOUT_S) -> Any:
    """Start torch.distributed for `device` (rank, world size and rendezvous from torchrun's
    environment unless given) and return the world group. Collectives time out after timeout_s."""
    import torch.distributed as dist

    backend = backend_for(device)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (issue 21)
    kwargs: dict[str, Any] = {"timeout": datetime.timedelta(seconds=timeout_s)}
    if rank is not None:
        kwargs["rank"] = rank
    if world_size is not None:
        kwargs["world_size"] = world_size
    if init_method is not None:
        kwargs["init_method"] = init_method
    if backend == "nccl" and rank is not None:
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, **kwargs)
    return dist.group.WORLD


def agree(group: Any, error: BaseException | None, what: str) -> None:
    """Every rank learns whether every rank succeeded at `what`: if any failed, each raises
    `ShardLoadError` naming the failed ranks and their errors (so no rank goes on to a collective
    its peers never reach). A peer that never answers gives `GroupTimeoutError`."""
    import torch.distributed as dist

    mine = None if error is None else f"{type(error).__name__}: {error}"
    answers: list[Any] = [None] * int(group.size())
    try:
        dist.all_gather_object(answers, mine, group=group)
    except Exception as e:  # noqa: BLE001 - gloo/NCCL raise RuntimeError subclasses on timeouts
        raise GroupTimeoutError(f"{what}: rank {dist.get_rank(group)} got no answer from the group "
                                f"within its timeout (a rank died or hangs): {type(e).__name__}: {e}") from e
    failed = [(r, a) for r, a in enumerate(answers) if a is not None]
    if failed:
        listed = "; ".join(f"rank {r}: {a}" for r, a in failed)
        raise ShardLoadError(f"{what} failed on {len(failed)} of {len(answers)} ranks: {listed}") from error


def load_sharded_head(path: str | os.PathLike[str], group: Any, *, dtype: str = "float32",
                      device: str | torch.device = "cpu", strict: bool = False,
                      ) -> tuple[MtpHead, dict[str, torch.Tensor]]:
    """This rank's shard of the checkpoint's MTP head and its bound params, every rank reading
    only its slices (`load_mtp_shard`). A failure on any rank is `ShardLoadError` on all."""
    import torch.distributed as dist

    rank, world = dist.get_rank(group), int(group.size())
    error: BaseException | None = None
    try:
        config, weights = load_mtp_shard(path, rank, world, dtype=getattr(torch, dtype), device=device,
                                         strict=strict)
        head = shard_head(head_for(config, dtype), rank, world)
        params = head.bind(weights)
    except Exception as e:  # noqa: BLE001 - every failure must reach the other ranks, typed
        error = e
    agree(group, error, f"loading the MTP head's shards from {os.fspath(path)}")
    return head, params


__all__ = ["DEFAULT_TIMEOUT_S", "ShardLoadError", "GroupTimeoutError", "backend_for", "init_group",
           "agree", "load_sharded_head", "tp_plan"]
