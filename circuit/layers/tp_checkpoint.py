"""Shard-by-shard checkpoint loading for tensor-parallel heads (issue 21): each rank reads only
the slices it holds (`TpPlan.slice_of`) through safetensors' `get_slice`, never a whole sharded
tensor; replicated tensors are read whole, through the same call.

The read plan is `load_mtp_weights`' own (`mtp_read_plan`: fallbacks, tied heads, refusals,
strict mode), so a sharded load refuses exactly what a whole load refuses; the header's shape is
checked against the whole tensor's before any data is read. fp8 block-scaled tensors are refused
(`TpShardError`): a slice would split their 128x128 scale blocks.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from draft_circuit.circuit.layers import checkpoint as _ckpt
from draft_circuit.circuit.layers.checkpoint_errors import CheckpointError, CorruptFileError, TensorShapeError
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.tensor_checks import check_finite, check_stored_dtype
from draft_circuit.circuit.layers.tp import Slice, TpPlan, tp_plan

__all__ = ["TpShardError", "load_mtp_shard"]

# the one way this module opens a file (tests wrap it to count the bytes each rank reads)
_open_file = _ckpt._open


class TpShardError(CheckpointError):
    """A checkpoint tensor that cannot be read as a rank's slice; names the tensor and file."""


def _read_slice(handle: Any, path: Path, key: str, shape: tuple[int, ...], s: Slice | None) -> torch.Tensor:
    try:
        sl = handle.get_slice(key)
        actual = tuple(sl.get_shape())
        if actual != shape:
            raise TensorShapeError(f"{path}: tensor {key!r} has shape {list(actual)}, expected {list(shape)}")
        check_stored_dtype(path, key, sl.get_dtype())
        if s is None:
            t: torch.Tensor = sl[:]
        elif s.dim == 0:
            t = sl[s.start:s.stop]
        else:
            t = sl[:, s.start:s.stop]
        return t
    except SafetensorError as e:
        raise CorruptFileError(f"{path}: cannot read tensor {key!r} (truncated or corrupt?): {e}") from e


def load_mtp_shard(path: str | os.PathLike[str], rank: int, world_size: int,
                   config: MtpConfig | None = None, *, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", strict: bool = False
                   ) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    """(the whole head's config, rank's slices under canonical names): what `load_mtp_weights`
    returns, each tensor narrowed to `tp_plan(config, rank, world_size).slice_of(name)`, ready for
    the shard's `bind`. The routing bias (and a fp32-by-family gate) is read in float32."""
    root = Path(path)
    config = config if config is not None else _ckpt.read_config(root)
    plan: TpPlan = tp_plan(config, rank, world_size)  # refusals before any file is read
    inv, shapes, reads, fp32, scales = _ckpt.mtp_read_plan(root, config, strict)
    if scales:
        first = next(iter(scales.values()))
        raise TpShardError(f"{inv.where[first]}: {first!r} block-scales an fp8 tensor; sharded loading "
                           "reads unquantised weights only (a slice would split its 128x128 blocks)")
    wanted = {**{n: (k, dtype) for n, k in reads.items()}, **{n: (k, torch.float32) for n, k in fp32.items()}}
    by_file: dict[Path, list[str]] = {}
    for name, (key, _) in wanted.items():
        by_file.setdefault(inv.where[key], []).append(name)
    out: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        with _open_file(file) as handle:
            for name in names:
                key, dt = wanted[name]
                t = _read_slice(handle, file, key, shapes[name], plan.slice_of(name))
                check_finite(file, key, t)
                out[name] = t.to(device=device, dtype=dt).contiguous()
                if out[name].dtype == torch.float16 != t.dtype:
                    check_finite(file, key, out[name], converted_to=out[name].dtype)
    return config, {name: out[name] for name in wanted}
