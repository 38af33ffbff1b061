"""Reduced draft vocabularies on the device: `map_ids` (draft ids -> target ids through a table,
-1 stays -1) and `remap_bitmask` (a target-vocabulary token bitmask -> the bits of the subset's
tokens), each with a capturable torch binding for CUDA; remap_bitmask is first one Triton launch
(kernels/remap_bitmask.py), the torch binding its fallback (a `kernels=` allow-list without it).

A subset is an int32 table `ids[S]` of target ids: subset token s is target token ids[s]. The
draft head's logits run over the S subset rows; `map_ids` turns its argmax into a target id and
`remap_bitmask` gives it the mask over those S tokens (bit s of the result = bit ids[s] of the
input; bits past S in the last word are 0). Both are per-row, so width independent. A map_ids that
alone reads the lm-head argmax's token rides in that argmax's merge (fuse_lm_head_argmax; the
ops' `ids` attr, ops/sampling.py): its torch binding runs only where the fusion does not apply.
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.bindings import CUDA, TRITON, Applies, KernelBinding, Tensors, kernel, traced_launches
from draft_circuit.ops.registry import (GATHER, SAMPLING, Cost, CostContext, Env, OpDef, Specs, check,
                                        index_dtype, rank, register)
from draft_circuit.ops.sampling import map_through, mask_words


class DraftIdError(ValueError):
    """A draft id past the end of the subset table: named with its row."""


# ---- map_ids: subset index -> target id ----
def map_ids_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids]; a negative id (an all-masked draft, -1) stays -1, by policy."""
    size = table.shape[0]
    if ids.numel() and int(ids.max()) >= size:
        row = int((ids >= size).nonzero()[0, 0])
        raise DraftIdError(f"draft id {int(ids[row])} at row {row} is outside the subset table "
                           f"[0, {size})")
    return map_through(ids, table)  # the arithmetic the lm-head argmax's id table shares


def _infer_map_ids(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    ids, table = ins
    rank(ids, 1, "draft ids")
    index_dtype(ids, "draft ids")
    rank(table, 1, "id table [subset]")
    check(table.dtype == "int32", lambda: f"id table must be int32, got {table}")
    return [TensorSpec(dtype="int32", shape=ids.shape)]


def _map_ids_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    ids_bytes = ins[0].nbytes(env)  # one table entry read per row, not the whole table
    return Cost(ids_bytes + outs[0].nbytes(env), outs[0].nbytes(env), 0)


def _map_ids_capturable(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    ids, table = ins
    torch.index_select(table, 0, ids.clamp(min=0), out=outs[0])
    outs[0].masked_fill_(ids < 0, -1)


register(OpDef(
    name="map_ids", inputs=("ids", "table"), outputs=("out",), infer=_infer_map_ids,
    reference=lambda t, a: (map_ids_ref(t[0], t[1]),), cost=_map_ids_cost,
    tags=frozenset({GATHER, SAMPLING}),
    kernels=(KernelBinding("torch_map_ids", _map_ids_capturable, Applies(CUDA),
                           launches=traced_launches(_map_ids_capturable, _infer_map_ids)),),
))


# ---- remap_bitmask: target-vocabulary mask -> subset mask ----
def _subset_bits(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[n, W] int32 words, [S] target ids -> [n, S] int64 bits (bit ids[s] of each row)."""
    idx = ids.long()
    words = bitmask.index_select(1, idx >> 5).long()  # the sign bit is just bit 31
    return (words >> (idx & 31)) & 1


def _pack_bits(bits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[n, S] 0/1 -> [n, ceil(S/32)] int32 words, bit s in word s >> 5 at position s & 31."""
    n, size = bits.shape
    words = mask_words(size)
    padded = torch.nn.functional.pad(bits, (0, words * 32 - size))
    shifts = torch.arange(32, device=bits.device, dtype=torch.int64)
    packed = (padded.view(n, words, 32) << shifts).sum(-1)  # in [0, 2**32): bit 31 is the sign
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    if out is None:
        return packed.to(torch.int32)
    return out.copy_(packed)


def remap_bitmask_ref(bitmask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    covered = bitmask.shape[1] * 32
    if ids.numel() and (int(ids.max()) >= covered or int(ids.min()) < 0):
        bad = int(ids[(ids >= covered) | (ids < 0)][0])
        raise DraftIdError(f"subset id {bad} is outside the {bitmask.shape[1]}-word bitmask "
                           f"[0, {covered})")
    return _pack_bits(_subset_bits(bitmask, ids))


def _infer_remap(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    mask, ids = ins
    check(mask.dtype == "int32" and len(mask.shape) == 2,
          lambda: f"bitmask must be int32 [rows, words], got {mask}")
    rank(ids, 1, "subset ids [subset]")
    check(ids.dtype == "int32" and isinstance(ids.shape[0], int),
          lambda: f"subset ids must be int32 with a fixed size, got {ids}")
    return [TensorSpec(dtype="int32", shape=(mask.shape[0], mask_words(int(ids.shape[0]))))]


def _remap_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    mask, ids = ins
    n, words = mask.concrete(env)
    size = ids.concrete(env)[0]
    # each subset id reads one word of each row (no more than the row holds) and the id itself
    return Cost(4 * (n * min(words, size) + size), outs[0].nbytes(env), 0)


def _remap_capturable(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    _pack_bits(_subset_bits(ins[0], ins[1]), out=outs[0])


_k_remap = kernel("remap_bitmask", "remap_bitmask")

register(OpDef(
    name="remap_bitmask", inputs=("bitmask", "ids"), outputs=("out",), infer=_infer_remap,
    reference=lambda t, a: (remap_bitmask_ref(t[0], t[1]),), cost=_remap_cost,
    tags=frozenset({GATHER, SAMPLING}),
    # the Triton kernel gathers and packs in one launch where the torch binding runs ~15 aten
    # kernels; the ids are checked against the vocabulary when bound, not here (no host sync)
    kernels=(KernelBinding("triton_remap_bitmask", lambda i, o, w, a: _k_remap()(i[0], i[1], o[0]),
                           Applies(TRITON)),
             KernelBinding("torch_remap_bitmask", _remap_capturable, Applies(CUDA),
                           launches=traced_launches(_remap_capturable, _infer_remap))),
))
