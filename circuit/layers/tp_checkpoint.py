"""Shard-by-shard checkpoint loading for tensor-parallel heads and targets (issue 21): each rank
reads only the slices it holds through safetensors' `get_slice`, never a whole sharded tensor;
replicated tensors are read whole, through the same call.

The read plans are the whole loaders' own (`mtp_read_plan` of `load_mtp_weights`,
`target_read_plan` of `load_target_weights`: fallbacks, tied heads, refusals, strict mode), so a
sharded load refuses exactly what a whole load refuses; the slicing is one hook over a plan
(`read_sliced`: a name's `Slice`, from `TpPlan.slice_of` or `target_slice_of`). Each header's
shape is checked against the whole tensor's before any data is read. A stored tensor serving
several names is read once per distinct slice, and not at all where one of its names reads it
whole (a tied lm-head's rows come out of the replicated embedding), so a rank reads exactly the
union of its slices. An fp8 weight with DeepSeek-V3's 128x128 block scales is read as its slice
and the scale blocks covering it, and dequantised into the load dtype: bitwise the whole load's
dequantised weight, narrowed (`dequantize_blocks` is elementwise), as a shard's bind needs
(fp8-kept experts do not shard). An fp8 tensor with no scales is refused (`TpShardError`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import SafetensorError

from draft_circuit.circuit.layers import checkpoint as _ckpt
from draft_circuit.circuit.layers.checkpoint_errors import CheckpointError, CorruptFileError, TensorShapeError
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.moe import SCALE, MoeConfig
from draft_circuit.circuit.layers.qwen3_next import Qwen3NextMtpConfig
from draft_circuit.circuit.layers.tensor_checks import check_finite, check_stored_dtype
from draft_circuit.circuit.layers.tp import ShardWeights, Slice, TpPlan, target_slice_of, tp_plan
from draft_circuit.ops.moe import SCALE_BLOCK, expand_block_scales

__all__ = ["TpShardError", "load_mtp_shard", "load_target_shard", "read_sliced"]

# the one way this module opens a file (tests wrap it to count the bytes each rank reads)
_open_file = _ckpt._open


class TpShardError(CheckpointError):
    """A checkpoint tensor that cannot be read as a rank's slice; names the tensor and file."""


def _header(handle: Any, path: Path, key: str, shapes: set[tuple[int, ...]], scaled: bool) -> Any:
    """The tensor's slice handle, its stored shape and dtype checked (no data read yet); fp8 only
    where `scaled` (its block scales are read beside it)."""
    sl = handle.get_slice(key)
    actual = tuple(sl.get_shape())
    for shape in shapes:
        if actual != shape:
            raise TensorShapeError(f"{path}: tensor {key!r} has shape {list(actual)}, expected {list(shape)}")
    if sl.get_dtype() == "F8_E4M3" and not scaled:
        raise TpShardError(f"{path}: tensor {key!r} is stored float8_e4m3fn with no {SCALE} block scales "
                           "beside it; sharded loading dequantises block-scaled fp8 weights only")
    check_stored_dtype(path, key, sl.get_dtype())
    return sl


def _take(sl: Any, s: Slice | None) -> torch.Tensor:
    t: torch.Tensor = sl[:] if s is None else sl[s.start:s.stop] if s.dim == 0 else sl[:, s.start:s.stop]
    return t


def read_sliced(inv: Any, wanted: dict[str, tuple[str, torch.dtype]],
                shapes: dict[str, tuple[int, ...]], slice_of: Callable[[str], Slice | None],
                device: str | torch.device, scaled: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The slicing hook over a read plan: `wanted` maps a result name to (stored name, dtype),
    `shapes` gives each name's whole shape, `slice_of(name)` the run this rank holds (None:
    whole). Every name comes back as its slice in its dtype on `device`, checked finite; every
    stored tensor is read once per distinct slice, none where a name needs it whole. Stored
    names in `scaled` may be fp8 and then stay fp8 (the caller applies their block scales)."""
    pieces: dict[str, dict[Slice | None, list[str]]] = {}
    for name, (key, _) in wanted.items():
        pieces.setdefault(key, {}).setdefault(slice_of(name), []).append(name)
    by_file: dict[Path, list[str]] = {}
    for key in pieces:
        by_file.setdefault(inv.where[key], []).append(key)
    out: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with _open_file(file) as handle:
            for key in keys:
                try:
                    sl = _header(handle, file, key, {shapes[n] for ns in pieces[key].values() for n in ns},
                                 key in scaled)
                    whole = _take(sl, None) if None in pieces[key] else None
                    for s, names in pieces[key].items():
                        if whole is None:
                            t = _take(sl, s)
                        elif s is None:
                            t = whole
                        else:  # a slice of a tensor read whole anyway: no second read
                            t = whole.narrow(s.dim, s.start, s.stop - s.start)
                        check_finite(file, key, t)
                        for name in names:
                            dt = t.dtype if t.dtype == torch.float8_e4m3fn else wanted[name][1]
                            out[name] = t.to(device=device, dtype=dt).contiguous()
                            if out[name].dtype == torch.float16 != t.dtype:  # fp16's smaller range
                                check_finite(file, key, out[name], converted_to=out[name].dtype)
                except SafetensorError as e:
                    raise CorruptFileError(f"{file}: cannot read tensor {key!r} (truncated or corrupt?): "
                                           f"{e}") from e
    return {name: out[name] for name in wanted}


def load_mtp_shard(path: str | os.PathLike[str], rank: int, world_size: int,
                   config: MtpConfig | None = None, *, dtype: torch.dtype = torch.float32,
                   device: str | torch.device = "cpu", strict: bool = False
                   ) -> tuple[MtpConfig, ShardWeights]:
    """(the whole head's config, rank's slices under canonical names): what `load_mtp_weights`
    returns, each tensor narrowed to `tp_plan(config, rank, world_size).slice_of(name)`, ready for
    the shard's `bind`. The routing bias (and a fp32-by-family gate) is read in float32; a
    block-scaled fp8 weight comes back dequantised into `dtype` (as load_mtp_weights without
    keep_fp8), read as its slice and the scale blocks covering it."""
    root = Path(path)
    config = config if config is not None else _ckpt.read_config(root)
    plan: TpPlan = tp_plan(config, rank, world_size)  # refusals before any file is read
    if isinstance(config, Qwen3NextMtpConfig):
        raise TpShardError(f"{root}: a Qwen3-Next MTP layer (`mtp.*`) does not shard yet; the dense and "
                           "MoE MTP heads do")
    inv, shapes, reads, fp32, scales = _ckpt.mtp_read_plan(root, config, strict)
    wanted: dict[str, tuple[str, torch.dtype]] = {
        **{n: (k, dtype) for n, k in reads.items()}, **{n: (k, torch.float32) for n, k in fp32.items()}}
    out = read_sliced(inv, wanted, shapes, plan.slice_of, device,
                      frozenset(wanted[s.removesuffix(SCALE)][0] for s in scales))
    for scale_name, key in scales.items():
        name = scale_name.removesuffix(SCALE)
        out[name] = _dequantized(inv, name, key, out[name], shapes[name], plan.slice_of(name), dtype, device)
    return config, ShardWeights(plan, out)


def _dequantized(inv: Any, name: str, key: str, weight: torch.Tensor, shape: tuple[int, ...], s: Slice | None,
                 dtype: torch.dtype, device: str | torch.device) -> torch.Tensor:
    """`weight` (the slice `s` of a block-scaled tensor of `shape`) dequantised into `dtype` with
    the scale blocks covering the slice alone, read by the same hook (`key`: the stored scale)."""
    blocks = tuple(math.ceil(d / SCALE_BLOCK) for d in shape)
    cover = None if s is None else Slice(s.dim, s.start // SCALE_BLOCK, math.ceil(s.stop / SCALE_BLOCK))
    scale = read_sliced(inv, {name + SCALE: (key, torch.float32)}, {name + SCALE: blocks},
                        lambda _: cover, device)[name + SCALE]
    if s is None or cover is None:
        full = expand_block_scales(scale, shape)
    else:  # the covering blocks' scales, from the slice's first row (or column) on
        span = list(shape)
        span[s.dim] = (cover.stop - cover.start) * SCALE_BLOCK
        full = expand_block_scales(scale, span).narrow(s.dim, s.start - cover.start * SCALE_BLOCK, s.stop - s.start)
    out = (weight.float() * full).to(dtype)  # dequantize_blocks' arithmetic, element by element
    if dtype == torch.float16:  # a block scale may carry a weight past float16's range
        check_finite(inv.where[key], key, out, converted_to=dtype)
    return out


def load_target_shard(path: str | os.PathLike[str], rank: int, world_size: int,
                      config: MtpConfig | None = None, *, dtype: torch.dtype = torch.float32,
                      device: str | torch.device = "cpu", strict: bool = False) -> ShardWeights:
    """Rank's slices of a Llama-family dense target (Qwen2/3 attention options included): what
    `load_target_weights` returns, each tensor narrowed to `target_slice_of(plan, name)` (a
    layer's as the MTP layer's of that name, the lm-head by vocabulary rows, the embedding and
    norms whole). Targets whose layers load elsewhere (GLM-4.5's MoE, DeepSeek-V3's MLA,
    Qwen3-Next) are refused by name."""
    root = Path(path)
    config = config if config is not None else _ckpt.read_config(root)
    plan = tp_plan(config, rank, world_size)  # MLA refused here, before any file is read
    if isinstance(config, Qwen3NextMtpConfig) or (isinstance(config, MoeConfig)
                                                  and _ckpt.is_glm4_moe_checkpoint(root)):
        raise TpShardError(f"{root}: {_ckpt._label(root)}'s target layers do not shard yet; Llama-family "
                           "dense targets do")
    inv, shapes, reads = _ckpt.target_read_plan(root, config, strict)
    wanted: dict[str, tuple[str, torch.dtype]] = {n: (k, dtype) for n, k in reads.items()}
    return ShardWeights(plan, read_sliced(inv, wanted, shapes, lambda n: target_slice_of(plan, n), device))
