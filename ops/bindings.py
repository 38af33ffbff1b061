"""Kernel bindings: which kernel serves which op, and when.

Triton kernels apply on CUDA (and on CPU under TRITON_INTERPRET when the planner is asked to, for
tests); the torch kernels here are capturable destination-passing versions of references that
would sync the host (a range check, a boolean-mask write). Kernel modules are imported on first
launch, so importing the registry never needs a GPU. Bindings marked `width_independent=False`
(cuBLAS) are chosen only when the planner's `width_independent` option is off.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.registry import KernelBinding, bind_kernel

FLOATS = ("float32", "float16", "bfloat16")
TRITON_DEVICES = ("cuda", "interpret")


def _on(devices: tuple[str, ...]):
    def applies(device: str, ins: Sequence[TensorSpec], attrs: Any) -> bool:
        return device in devices and all(s.dtype in FLOATS for s in ins if s.dtype.startswith("f")
                                         or s.dtype.startswith("b"))
    return applies


def _triton(module: str, fn: str):
    """Resolve kernels.<module>.<fn> on first use (triton is imported only then)."""
    cache: dict[str, Any] = {}

    def get():
        if "f" not in cache:
            import importlib
            cache["f"] = getattr(importlib.import_module(f"draft_circuit.kernels.{module}"), fn)
        return cache["f"]
    return get


# ---- Triton ----
_rmsnorm, _add_rmsnorm = _triton("rmsnorm", "rmsnorm"), _triton("rmsnorm", "add_rmsnorm")
_silu, _linear = _triton("silu_mul", "silu_mul"), _triton("linear", "linear")
_linear_silu = _triton("linear", "linear_silu_mul")
_linear_splitk = _triton("linear_splitk", "linear_splitk")
_splitk_ws, _splitk_splits = (_triton("linear_splitk", "splitk_workspace_shape"),
                              _triton("linear_splitk", "num_splits"))
_rope_kv = _triton("rope_kv_write", "rope_kv_write")
_attn = _triton("decode_attention", "decode_attention")
_attn_ws = _triton("decode_attention", "decode_attention_workspace_shape")
_argmax, _lin_argmax = _triton("argmax_logprob", "argmax_logprob"), _triton("argmax_logprob", "linear_argmax_logprob")
_lin_argmax_ws = _triton("argmax_logprob", "linear_argmax_workspace_shape")


def _rope_kv_write(ins, outs, ws, a) -> None:
    q, k, v, pos, kc, vc, tables, live, *active = ins
    d = a.head_dim
    _rope_kv()(q, k, v, pos, live, tables, kc, vc, outs[0], num_heads=q.shape[1] // d,
               num_kv_heads=kc.shape[2], head_dim=d, theta=a.theta, pos_offset=a.pos_offset,
               row_offset=a.row_offset, active=active[0] if active else None)


def _attention(ins, outs, ws, a) -> None:
    q, kc, vc, tables, live = ins
    d = kc.shape[3]
    _attn()(q, kc, vc, tables, live, outs[0], num_heads=q.shape[1] // d, num_kv_heads=kc.shape[2],
            head_dim=d, scale=a.scale if a.scale is not None else 1.0 / math.sqrt(d),
            row_offset=a.row_offset, workspace=ws[0])


def _attention_ws(ins: Sequence[TensorSpec], env: dict, a: Any):
    q, kc, tables = ins[0], ins[1], ins[3]
    n, d = q.concrete(env)[0], int(kc.shape[3])
    rows = int(tables.shape[1]) * int(kc.shape[1])
    return [("float32", _attn_ws()(n, int(q.shape[1]) // d, d, rows))]


def _splitk_applies(device: str, ins: Sequence[TensorSpec], a: Any) -> bool:
    """Where the plain kernel's grid is too small (K gets >= 2 splits; a function of the weight's
    shape only, so every width of a circuit picks the same kernel) and the output is computed in
    fp32 (out_dtype None or float32: the fp32-accumulating result, rounded once)."""
    if not _on(TRITON_DEVICES)(device, ins, a) or getattr(a, "out_dtype", None) not in (None, "float32"):
        return False
    rows, k = ins[1].shape
    return isinstance(rows, int) and isinstance(k, int) and _splitk_splits()(rows, k) >= 2


def _splitk_workspace(ins: Sequence[TensorSpec], env: dict, a: Any):
    rows, k = ins[1].shape
    return [("float32", _splitk_ws()(ins[0].concrete(env)[0], int(rows), int(k)))]


def _lin_argmax_launch(ins, outs, ws, a) -> None:
    _lin_argmax()(ins[0], ins[1], outs[0], outs[1], ins[2] if len(ins) > 2 else None, ws[0])


def _lin_argmax_workspace(ins: Sequence[TensorSpec], env: dict, a: Any):
    return [("float32", _lin_argmax_ws()(ins[0].concrete(env)[0], int(ins[1].shape[0])))]


TRITON = [
    ("rmsnorm", KernelBinding("triton_rmsnorm", lambda i, o, w, a: _rmsnorm()(i[0], i[1], o[0], a.eps),
                              _on(TRITON_DEVICES))),
    ("add_rmsnorm", KernelBinding("triton_add_rmsnorm",
                                  lambda i, o, w, a: _add_rmsnorm()(i[0], i[1], i[2], o[0], o[1], a.eps),
                                  _on(TRITON_DEVICES))),
    ("silu_mul", KernelBinding("triton_silu_mul", lambda i, o, w, a: _silu()(i[0], o[0]),
                               _on(TRITON_DEVICES))),
    # split-K first: chosen wherever it applies, the single-pass kernels serve the rest
    ("linear", KernelBinding("triton_linear_splitk",
                             lambda i, o, w, a: _linear_splitk()(i[0], i[1], o[0], w[0]),
                             _splitk_applies, workspace=_splitk_workspace)),
    ("linear", KernelBinding("triton_linear", lambda i, o, w, a: _linear()(i[0], i[1], o[0]),
                             _on(TRITON_DEVICES))),
    # no split-K for SwiGLU: on the H200 the fused single pass was as fast at n = 1 and 1.2-1.6x
    # faster at n = 64 (benchmarks/tune_kernels.py); kernels.linear_splitk keeps the variant
    ("linear_silu_mul", KernelBinding("triton_linear_silu_mul",
                                      lambda i, o, w, a: _linear_silu()(i[0], i[1], o[0]),
                                      _on(TRITON_DEVICES))),
    ("rope_kv_write", KernelBinding("triton_rope_kv_write", _rope_kv_write, _on(TRITON_DEVICES))),
    ("decode_attention", KernelBinding("triton_decode_attention", _attention, _on(TRITON_DEVICES),
                                       workspace=_attention_ws)),
    ("argmax_logprob", KernelBinding("triton_argmax_logprob",
                                     lambda i, o, w, a: _argmax()(i[0], o[0], o[1], i[1] if len(i) > 1 else None),
                                     _on(TRITON_DEVICES))),
    ("linear_argmax_logprob", KernelBinding("triton_linear_argmax_logprob", _lin_argmax_launch,
                                            _on(TRITON_DEVICES), workspace=_lin_argmax_workspace)),
]


# ---- capturable torch versions (CUDA), and cuBLAS where width independence is not asked ----
def _gather(ins, outs, ws, a) -> None:
    table, ids = ins[0], ins[1]
    torch.index_select(table, 0, ids.clamp(min=0), out=outs[0])
    outs[0].masked_fill_((ids < 0).unsqueeze(-1), 0)  # an all-masked draft (-1) embeds as zeros


def _embed_write(ins, outs, ws, a) -> None:
    target, table, ids, *active = ins
    emb = torch.index_select(table, 0, ids.clamp(min=0)).masked_fill_((ids < 0).unsqueeze(-1), 0)
    if active:  # inert rows keep what the host buffer held
        emb = torch.where(active[0].bool().unsqueeze(-1), emb, target)
    target.copy_(emb)


def _kv_write(ins, outs, ws, a) -> None:
    """Capturable paged write: inactive rows write back what the slot held (no boolean mask,
    so no data-dependent shapes and no host sync)."""
    kc, vc, k, v, tables, live, *active = ins
    block_size, heads, dim = kc.shape[1:]
    rows = live.long() + a.row_offset
    blocks = tables.long().gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    offs = rows % block_size
    for cache, new in ((kc, k), (vc, v)):
        new = new.view(-1, heads, dim)
        if active:
            new = torch.where(active[0].bool().view(-1, 1, 1), new, cache[blocks, offs])
        cache[blocks, offs] = new


def _cublas_linear(ins, outs, ws, a) -> None:
    torch.matmul(ins[0], ins[1].t(), out=outs[0])


CAPTURABLE = [
    ("embedding", KernelBinding("torch_gather", _gather, _on(("cuda",)))),
    ("embed_write", KernelBinding("torch_embed_write", _embed_write, _on(("cuda",)))),
    ("kv_write", KernelBinding("torch_kv_write", _kv_write, _on(("cuda",)))),
    ("linear", KernelBinding("cublas_linear", _cublas_linear,
                             lambda d, ins, a: d == "cuda" and a.out_dtype in (None, ins[0].dtype),
                             width_independent=False)),
]


def bind_all() -> None:
    for op, kernel in TRITON + CAPTURABLE:
        bind_kernel(op, kernel)
