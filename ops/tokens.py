"""Token ops: `embedding` (a negative id, an all-masked draft, embeds as zeros; an id >= vocab is a
TokenError naming its row) and `embed_write` (the last kept draft's embedding into a host buffer,
inert rows untouched), with their capturable torch bindings for CUDA."""
from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.bindings import CUDA, Applies, KernelBinding, Tensors, traced_launches
from draft_circuit.ops.registry import (GATHER, Cost, CostContext, Env, OpDef, Specs, check, index_dtype, rank,
                                        register)


class TokenError(ValueError):
    """A token id outside [0, vocab): named with its row."""


def embedding_ref(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows of `table`; a negative id (an all-masked draft, -1) gives a zero row, by policy."""
    vocab = table.shape[0]
    lowest = 0
    if ids.numel():
        lowest, highest = torch.stack(torch.aminmax(ids)).tolist()  # one read for both bounds
        if highest >= vocab:
            row = int((ids >= vocab).nonzero()[0, 0])
            raise TokenError(f"token id {int(ids[row])} at row {row} is outside the vocabulary "
                             f"[0, {vocab})")
    if lowest >= 0 and ids.dim() == 1 and ids.dtype in (torch.int32, torch.int64):  # one op (issue 20)
        return table.index_select(0, ids)
    out = table[ids.clamp(min=0).long()]
    return out.masked_fill((ids < 0).unsqueeze(-1), 0)


def _infer_embedding(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    table, ids = ins
    rank(table, 2, "embedding table [vocab, hidden]")
    rank(ids, 1, "token ids")
    index_dtype(ids, "token ids")
    return [TensorSpec(dtype=table.dtype, shape=(ids.shape[0], table.shape[1]))]


def _embedding_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env) -> Cost:
    row_bytes = outs[-1].nbytes(env)  # only the gathered rows of the table are read
    return Cost(row_bytes + ins[-1].nbytes(env), outs[-1].nbytes(env), 0)


def _gather_capturable(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    table, ids = ins[0], ins[1]
    torch.index_select(table, 0, ids.clamp(min=0), out=outs[0])
    outs[0].masked_fill_((ids < 0).unsqueeze(-1), 0)  # an all-masked draft (-1) embeds as zeros


register(OpDef(
    name="embedding", inputs=("table", "ids"), outputs=("out",), infer=_infer_embedding,
    reference=lambda t, a: (embedding_ref(t[0], t[1]),), cost=_embedding_cost,
    tags=frozenset({GATHER}),
    kernels=(KernelBinding("torch_gather", _gather_capturable, Applies(CUDA),
                           launches=traced_launches(_gather_capturable, _infer_embedding)),),
))


def _infer_embed_write(ins: list[TensorSpec], a: BaseModel) -> list[TensorSpec]:
    target, table, ids = ins[:3]
    (emb,) = _infer_embedding([table, ids], a)
    check(target.dtype == emb.dtype and target.shape == emb.shape,
          lambda: f"embed target {target} must be {emb}")
    if len(ins) > 3:
        check(ins[3].dtype == "int32" and ins[3].shape == ids.shape,
              lambda: f"active must be int32{list(ids.shape)}, got {ins[3]}")
    return [target]


def _embed_write(t: list[torch.Tensor], a: BaseModel) -> tuple[torch.Tensor]:
    """Rows whose `active` is 0 (inert padding) keep what the host buffer held."""
    target, table, ids = t[:3]
    emb = embedding_ref(table, ids)
    if len(t) > 3:  # written in place: each element reads only its own target value
        torch.where(t[3].bool().unsqueeze(-1), emb, target, out=target)
    else:
        target.copy_(emb)
    return (target,)


def _embed_write_capturable(ins: Tensors, outs: Tensors, ws: Tensors, a: Any) -> None:
    target, table, ids, *active = ins
    emb = torch.index_select(table, 0, ids.clamp(min=0)).masked_fill_((ids < 0).unsqueeze(-1), 0)
    if active:  # inert rows keep what the host buffer held
        emb = torch.where(active[0].bool().unsqueeze(-1), emb, target)
    target.copy_(emb)


register(OpDef(
    name="embed_write", inputs=("target", "table", "ids", "active"), outputs=("target",),
    num_required=3, infer=_infer_embed_write, reference=_embed_write, mutates={0: 0},
    cost=lambda ins, outs, a, ctx, env: Cost(2 * outs[0].nbytes(env), outs[0].nbytes(env), 0),
    tags=frozenset({GATHER}),
    kernels=(KernelBinding("torch_embed_write", _embed_write_capturable, Applies(CUDA),
                           launches=traced_launches(_embed_write_capturable, _infer_embed_write)),),
))
